"""L3 on real Redis: sharing between stores, pipelined lookups, the header checks, and every fault of
issue 11 (down, unreachable, slow, restarted, out of memory, wrong password, a cluster master lost).

Each fault must end as a counted miss or a counted skipped write within KVB_L3_TIMEOUT, never a
hang and never an exception; after a connection fault L3 is marked down and later calls skip it at
once until the backoff says to try again. All servers are real redis-server processes on loopback.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import pytest
import redis
from blake3 import blake3

from kvbridge.settings import Settings
from kvbridge.store import DiskTier, MemoryTier, ObjectMeta, TieredStore
from kvbridge.store.redis_link import redact
from kvbridge.store.redis_tier import VALUE_MAGIC, RedisTier
from tests.redis_helpers import RedisCluster, RedisServer, needs_redis

pytestmark = [needs_redis, pytest.mark.timeout(120)]

NS = "l3-test"
TIMEOUT = 0.5


def key(label) -> bytes:
    return blake3(f"l3-{label}".encode()).digest()


def blob(k: bytes, size: int = 4096) -> bytes:
    return blake3(k).digest(length=size)


def meta(n: int = 4) -> ObjectMeta:
    return ObjectMeta(NS, n, bytes(16))


def host_store(directory: Path, url: str, **tier_args) -> TieredStore:
    """One host: its own L1 and L2 directory, the shared L3."""
    tier_args.setdefault("timeout", TIMEOUT)
    return TieredStore([MemoryTier(1 << 26), DiskTier(directory, 1 << 26), RedisTier(url, **tier_args)], namespace=NS)


@pytest.fixture
def server():
    with RedisServer() as srv:
        yield srv


class RoundTrips:
    """Counts what redis-py writes to its sockets: a pipeline is one send, however many commands it holds."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        original = redis.connection.Connection.send_packed_command

        def counting(conn, command, check_health=True):
            self.count += 1
            return original(conn, command, check_health)

        monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counting)


# -- sharing ---------------------------------------------------------------------------------------
def test_an_object_stored_by_one_host_is_found_and_read_by_another(server, tmp_path):
    a, b = host_store(tmp_path / "a", server.url), host_store(tmp_path / "b", server.url)
    keys = [key(i) for i in range(3)]
    for k in keys:
        assert a.put(k, blob(k), meta())
    a.flush()
    assert b.lookup(keys).tiers == ["L3"] * 3
    got = b.get_many(keys)
    assert [obj.blob for obj in got] == [blob(k) for k in keys] and {obj.tier for obj in got} == {"L3"}
    b.drain()   # the L2 copies of the promoted objects are written behind the read
    assert b.lookup(keys).tiers == ["L1"] * 3
    assert all(b.tiers[1].contains(k) for k in keys)   # promoted into L2 too
    assert b.stats()["hits"]["L3"] == 3


def test_a_twelve_hash_lookup_is_one_round_trip(server, tmp_path, monkeypatch):
    a, b = host_store(tmp_path / "a", server.url), host_store(tmp_path / "b", server.url)
    keys = [key(i) for i in range(12)]
    for k in keys[:8]:
        a.put(k, blob(k), meta())
    a.flush()
    b.lookup([key("warm-up")])    # the connection is opened once per pool, not per lookup
    trips = RoundTrips(monkeypatch)
    assert b.lookup(keys).n_hit == 8
    assert trips.count == 1
    trips.count = 0
    assert [obj.tier for obj in b.get_many(keys[:8])] == ["L3"] * 8
    assert trips.count == 1
    c = host_store(tmp_path / "c", server.url)
    c.lookup([key("warm-up")])
    trips.count = 0      # a read of objects never looked up (a restore's tail): still one round trip
    assert [obj is not None for obj in c.get_many(keys[:9])] == [True] * 8 + [False]
    assert trips.count == 1 and c.stats()["discovered"] == 8


def test_values_carry_the_checked_header_and_live_under_the_prefix_only(server, tmp_path):
    store = host_store(tmp_path / "a", server.url, prefix="team-a", ttl=60)
    store.put(key(1), blob(key(1)), meta())
    store.flush()
    with server.client() as client:
        registry, name = sorted(client.keys("*"))   # the object, and the registry of namespaces (issue 35)
        assert (registry, name) == (b"team-a:namespaces", f"team-a:obj:{key(1).hex()}".encode())
        assert client.get(name).startswith(VALUE_MAGIC)
        assert 0 < client.pttl(name) <= 60_000 and 0 < client.pttl(registry) <= 60_000
    other = host_store(tmp_path / "b", server.url, prefix="team-b")
    assert other.lookup([key(1)]).n_hit == 0


def test_a_damaged_value_is_a_counted_miss_and_is_deleted(server, tmp_path):
    a, b = host_store(tmp_path / "a", server.url), host_store(tmp_path / "b", server.url)
    k = key("bad")
    a.put(k, blob(k), meta())
    a.flush()
    name = a.tiers[2].redis_key(k)
    with server.client() as client:
        client.setrange(name, client.strlen(name) - 1, b"\x00" if blob(k)[-1] else b"\x01")
    assert b.lookup([k]).n_hit == 1        # the header is sound; the payload is checked when read
    assert b.get(k) is None
    assert b.stats()["corrupt"] == 1
    with server.client() as client:
        assert not client.exists(name)


def test_an_object_the_server_evicted_is_a_miss_not_an_error(server, tmp_path):
    a = host_store(tmp_path / "a", server.url)
    k = key("evicted")
    a.put(k, blob(k), meta())
    a.flush()
    a.clear("L1")
    a.clear("L2")
    with server.client() as client:
        client.delete(a.tiers[2].redis_key(k))   # what maxmemory's LRU would do
    assert a.get(k) is None
    assert a.stats()["vanished"] == 1 and not a.tiers[2].contains(k)


def test_a_lossy_codec_is_recorded_and_any_reader_decodes_by_the_header(server, tmp_path):
    from kvbridge.store.serde import TierCodec

    a = host_store(tmp_path / "a", server.url, codec=TierCodec.named("zstd"))
    b = host_store(tmp_path / "b", server.url)           # reads with its own codec set to raw
    k = key("zstd")
    a.put(k, bytes(8192), meta())
    a.flush()
    with server.client() as client:
        assert client.strlen(a.tiers[2].redis_key(k)) < 1024      # stored compressed
    obj = b.get(k)
    assert obj.blob == bytes(8192) and obj.meta.codec == "zstd" and obj.meta.lossy == ""


# -- faults ----------------------------------------------------------------------------------------
def wait_until_up(store: TieredStore, timeout: float = 10.0) -> None:
    """The background prober marks L3 up once a ping is answered (at the backoff's retry times)."""
    deadline = time.monotonic() + timeout
    while store.stats()["tiers"]["L3"]["remote"]["state"] != "up":
        assert time.monotonic() < deadline, store.stats()["tiers"]["L3"]["remote"]
        time.sleep(0.1)


def _timed(fn):
    start = time.monotonic()
    result = fn()
    return result, time.monotonic() - start


def test_a_stopped_server_costs_one_failure_then_nothing_while_down(server, tmp_path):
    store = host_store(tmp_path / "a", server.url)
    tier = store.tiers[2]
    store.put(key(1), blob(key(1)), meta())
    store.flush()
    store.clear("L1")
    store.clear("L2")
    server.stop()
    obj, took = _timed(lambda: store.get(key(1)))
    assert obj is None and took < TIMEOUT + 0.5
    assert tier.health()["state"] == "down"
    for i in range(5):
        result, took = _timed(lambda: store.lookup([key(f"new-{i}")]))
        assert result.n_hit == 0 and took < 0.05
    assert store.put(key(2), blob(key(2)), meta())      # L1 and L2 still take it
    store.flush()
    assert tier.counts["skipped_down"] >= 5
    assert store.stats()["remote_errors"] >= 1


def test_an_unreachable_server_costs_the_timeout_once(tmp_path):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)            # accepts connections (the kernel does) and never answers a byte
    try:
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        store = host_store(tmp_path / "a", url)
        result, took = _timed(lambda: store.lookup([key(1), key(2)]))
        assert result.n_hit == 0 and TIMEOUT * 0.8 <= took < TIMEOUT + 1.0
        health = store.stats()["tiers"]["L3"]["remote"]
        assert health["state"] == "down" and health["timeouts"] == 1 and "KVB_L3_TIMEOUT" in health["reason"]
        result, took = _timed(lambda: store.lookup([key(3)]))
        assert result.n_hit == 0 and took < 0.05
        time.sleep(1.5)     # past the first retry time: the prober pays the next timeout, no request does
        result, took = _timed(lambda: store.lookup([key(4)]))
        assert result.n_hit == 0 and took < 0.05
        store.close()
    finally:
        silent.close()


def test_a_slow_server_is_a_miss_within_the_timeout_then_serves_again(server, tmp_path):
    a, b = host_store(tmp_path / "a", server.url), host_store(tmp_path / "b", server.url)
    keys = [key(i) for i in range(3)]
    for k in keys:
        a.put(k, blob(k), meta())
    a.flush()
    server.pause(1.5)
    result, took = _timed(lambda: b.lookup(keys))
    assert result.n_hit == 0 and took < TIMEOUT + 0.5
    result, took = _timed(lambda: b.lookup(keys))
    assert result.n_hit == 0 and took < 0.05          # down: skipped, no second timeout
    wait_until_up(b)                                  # the prober's ping is answered once the pause is over
    assert b.lookup(keys).n_hit == 3
    assert b.stats()["tiers"]["L3"]["remote"]["state"] == "up"


def test_a_restarted_server_is_used_again_after_the_backoff(server, tmp_path):
    store = host_store(tmp_path / "a", server.url)
    k = key("before")
    store.put(k, blob(k), meta())
    store.flush()
    server.kill()
    assert store.lookup([key("during")]).n_hit == 0
    server.restart()                                     # empty: data is not persisted
    wait_until_up(store)
    store.clear("L1")
    store.clear("L2")
    assert store.get(k) is None                          # it was lost with the server: a counted miss
    assert store.put(key("after"), blob(key("after")), meta())
    store.flush()
    with server.client() as client:
        assert client.exists(store.tiers[2].redis_key(key("after")))
    assert store.stats()["tiers"]["L3"]["remote"]["state"] == "up"


def test_a_full_server_refuses_writes_which_are_counted_and_reads_go_on(tmp_path):
    with RedisServer(maxmemory=2 << 20, maxmemory_policy="noeviction") as server:
        store = host_store(tmp_path / "a", server.url)
        small = key("small")
        store.put(small, blob(small), meta())
        store.flush()
        for i in range(4):
            store.put(key(f"big-{i}"), blob(key(i), 1 << 20), meta())
        store.flush()
        health = store.stats()["tiers"]["L3"]["remote"]
        assert health["writes_refused"] >= 1 and health["state"] == "up"
        assert store.stats()["write_errors"] >= 1
        other = host_store(tmp_path / "b", server.url)
        assert other.get(small).blob == blob(small)


def test_a_wrong_password_is_a_clear_counted_failure_and_never_logged(tmp_path, caplog, monkeypatch):
    secret, wrong = "s3cret-right-pw", "not-the-pw-9"
    with RedisServer(password=secret) as server:
        monkeypatch.setenv("TEAM_REDIS_PW", wrong)
        settings = Settings().replace(l3_url=server.url, l3_password_env="TEAM_REDIS_PW", l3_timeout=TIMEOUT,
                                      l2_dir=str(tmp_path / "l2"))
        caplog.set_level(logging.DEBUG)
        store = TieredStore.from_settings(settings, namespace=NS)
        assert store.lookup([key(1)]).n_hit == 0
        assert store.put(key(1), blob(key(1)), meta())      # L1/L2 take it; L3 is skipped
        store.flush()
        health = store.stats()["tiers"]["L3"]["remote"]
        assert health["state"] == "down" and health["auth_errors"] == 1
        assert "TEAM_REDIS_PW" in health["reason"] and "KVB_L3_PASSWORD_ENV" in health["reason"]
        assert wrong not in caplog.text and secret not in caplog.text and wrong not in str(store.stats())
        store.close()
        monkeypatch.setenv("TEAM_REDIS_PW", secret)
        good = TieredStore.from_settings(settings.replace(l2_dir=str(tmp_path / "l2b")), namespace=NS)
        assert good.put(key(1), blob(key(1)), meta())
        good.flush()
        assert good.stats()["tiers"]["L3"]["remote"]["state"] == "up"
        good.close()


def test_concurrent_requests_while_down_do_not_each_pay_the_timeout(tmp_path):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    try:
        store = host_store(tmp_path / "a", f"redis://127.0.0.1:{silent.getsockname()[1]}/0")
        took: list[float] = []

        def one(i):
            start = time.monotonic()
            store.lookup([key(i)])
            took.append(time.monotonic() - start)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        # the connection pool lets every thread try at once the first time; none waits twice
        assert max(took) < 2 * TIMEOUT + 1.0 and time.monotonic() - start < 2 * TIMEOUT + 1.5
        store.close()
    finally:
        silent.close()


# -- settings --------------------------------------------------------------------------------------
@pytest.mark.parametrize("url,needle", [
    ("http://127.0.0.1:6379", "is not a Redis address"),
    ("redis://127.0.0.1:notaport/0", "is not host:port"),
    ("redis://user:hunter2@127.0.0.1:6379/0", "KVB_L3_PASSWORD_ENV"),
    ("unix://relative.sock", "absolute path"),
])
def test_a_bad_l3_url_is_a_clear_settings_error(url, needle):
    problems = Settings().replace(l3_url=url).validate()
    assert any(needle in p and "KVB_L3_URL" in p for p in problems), problems
    assert not any("hunter2" in p for p in problems)


def test_bad_codec_and_l3_numbers_are_clear_settings_errors():
    problems = Settings().replace(l2_serde="lz4", l3_serde="int4", zstd_level=40, l3_timeout=0, l3_ttl=-1,
                                  l3_prefix="has space").validate()
    text = "\n".join(problems)
    for needle in ("KVB_L2_SERDE", "KVB_L3_SERDE", "known codecs: int8, raw, zstd", "KVB_ZSTD_LEVEL",
                   "KVB_L3_TIMEOUT", "KVB_L3_TTL", "KVB_L3_PREFIX"):
        assert needle in text


def test_urls_are_shown_without_credentials():
    assert redact("rediss://user:pw@cache.example:6380/0") == "rediss://cache.example:6380/0"
    assert redact("redis-cluster://127.0.0.1:7000,127.0.0.1:7001") == "redis-cluster://127.0.0.1:7000,127.0.0.1:7001"


# -- cluster ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    with RedisCluster() as c:
        yield c


@pytest.mark.timeout(180)
def test_a_cluster_spreads_objects_over_its_masters_and_survives_a_failover(cluster, tmp_path, monkeypatch):
    a, b = host_store(tmp_path / "a", cluster.url), host_store(tmp_path / "b", cluster.url)
    keys = [key(f"c{i}") for i in range(12)]
    for k in keys:
        a.put(k, blob(k), meta())
    a.flush()
    names = [a.tiers[2].redis_key(k) for k in keys]
    holders = {cluster.master_for_key(name) for name in names}
    assert len(holders) >= 2                       # spread over the masters, no hash tag
    b.lookup([key(f"warm-{i}") for i in range(24)])   # the slot map and a connection to each master, once
    trips = RoundTrips(monkeypatch)
    assert b.lookup(keys).n_hit == 12
    assert trips.count <= len(holders)             # one round trip per master holding any of the keys
    assert [obj.blob for obj in b.get_many(keys)] == [blob(k) for k in keys]

    victim = names[0]
    with cluster.node(cluster.master_for_key(victim)).client() as master:
        master.execute_command("WAIT", 1, 2000)   # replication is asynchronous
    dead = cluster.kill_master_for_key(victim)
    c = host_store(tmp_path / "c", cluster.url)
    result, took = _timed(lambda: c.lookup(keys))
    assert took < 3 * TIMEOUT + 2.0                # a miss or a partial hit, bounded; never a hang
    cluster.wait_failover(dead)
    deadline = time.monotonic() + 20
    while c.lookup(keys).n_hit < 12 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert c.lookup(keys).n_hit == 12
    assert [obj.blob for obj in c.get_many(keys)] == [blob(k) for k in keys]


def test_objects_known_in_a_down_l3_are_not_promised_by_lookup(server, tmp_path):
    store = host_store(tmp_path / "a", server.url)
    keys = [key(i) for i in range(3)]
    for k in keys:
        store.put(k, blob(k), meta())
    store.flush()
    store.clear("L1")
    store.clear("L2")
    assert store.lookup(keys).n_hit == 3
    server.stop()
    assert store.get(keys[0]) is None               # the fault marks L3 down
    result, took = _timed(lambda: store.lookup(keys))
    assert result.n_hit == 0 and took < 0.05        # no hit a get could not keep
