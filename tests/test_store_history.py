"""The history of a key (issue 35): every store keeps a bounded ring of its evictions and answers, in one call,
why a restore missed a key: evicted (from which tier, by which policy, for what), being written, a tier down,
or stored under another namespace. Real parts: TieredStore over RAM and files, a real ZMQ cache server in a
thread, a real redis-server for L3.
"""
from __future__ import annotations

import dataclasses
import time

import pytest

from kvbridge.cache_server.client import CacheClient
from kvbridge.cache_server.remote_store import RemoteStore
from kvbridge.store import DiskTier, MemoryTier, ObjectMeta, TieredStore
from kvbridge.store.history import MIN_HISTORY, Eviction, EvictionRing
from kvbridge.store.redis_tier import RedisTier
from tests.cache_server_helpers import SMALL_POOL, running_server
from tests.redis_helpers import RedisServer, needs_redis

NS = "kvb1|model_sha256=aaaa|cache_type_k=f16|chunk=16"
OTHER_NS = "kvb1|model_sha256=aaaa|cache_type_k=f32|chunk=16"


def key(i) -> bytes:
    return str(i).encode().rjust(16, b"k")


def meta(namespace: str = NS, kind: str = "chunk") -> ObjectMeta:
    return ObjectMeta(namespace, 16, b"d" * 16, kind=kind)


# -- the embedded store ----------------------------------------------------------------------------
def test_the_ring_keeps_the_last_4096_evictions_and_drops_the_oldest():
    store = TieredStore([MemoryTier(100)], namespace=NS)   # room for one object: each put evicts the last
    n = MIN_HISTORY + 50
    for i in range(n + 1):
        store.put(key(i), b"x" * 100, meta())
    assert len(store.history) == MIN_HISTORY and store.history.recorded == n
    assert store.history.latest(key(0)) is None                 # among the 50 oldest: dropped
    assert store.history.latest(key(49)) is None
    assert store.history.latest(key(50)).for_key == key(51)    # the oldest kept
    newest = store.recent_evictions(3)
    assert [e.key for e in newest] == [key(n - 1), key(n - 2), key(n - 3)]
    assert EvictionRing(10).capacity == MIN_HISTORY           # never fewer than 4096, whatever is asked


def test_an_lru_eviction_names_its_tier_policy_and_the_object_it_made_room_for():
    store = TieredStore([MemoryTier(250)], namespace=NS)
    store.put(key("old"), b"o" * 100, meta())
    store.put(key("mid"), b"m" * 100, meta())
    assert store.get(key("old")) is not None          # "mid" is now the least recently used
    store.put(key("tail"), b"t" * 120, meta(kind="tail"))
    entry = store.history.latest(key("mid"))
    assert (entry.tier, entry.reason, entry.policy, entry.namespace) == ("L1", "lru", "LRU", NS)
    assert (entry.for_key, entry.for_kind, entry.for_size, entry.size, entry.gone) == (key("tail"), "tail", 120, 100, True)
    text = entry.describe()
    assert text.startswith("evicted from L1 by LRU") and f"120 B tail ({key('tail').hex()[:12]})" in text
    probe = store.probe_miss([key("mid"), key("never")], [key("old"), key("nowhere")])
    assert probe.history[0] == entry and probe.history[1] is None
    assert probe.pending == [False, False] and probe.found == ["L1", ""] and probe.down == {}
    assert probe.namespaces == {NS: 220} and probe.round_trips == 0
    store.put(key("mid"), b"m" * 100, meta())          # stored again: the old eviction explains nothing now
    assert store.probe_miss([key("mid")]).history == [None]


def test_a_demotion_to_l2_is_not_gone_and_a_clear_is_recorded(tmp_path):
    store = TieredStore([MemoryTier(150), DiskTier(tmp_path / "l2", 10_000)], namespace=NS)
    store.put(key(1), b"a" * 100, meta())
    store.put(key(2), b"b" * 100, meta())              # key 1 leaves L1 for L2
    entry = store.history.latest(key(1))
    assert (entry.tier, entry.reason, entry.gone) == ("L1", "lru", False)
    assert "a lower tier still held it" in entry.describe()
    assert store.probe_miss([key(1)]).history[0].gone is False
    store.clear("L2")
    cleared = store.history.latest(key(1))
    assert (cleared.tier, cleared.reason, cleared.policy, cleared.gone) == ("L2", "clear", "", True)
    assert store.probe_miss([key(1)]).history[0].reason == "clear"


@needs_redis
def test_a_write_still_queued_for_a_slow_tier_is_pending(tmp_path):
    """A copy queued behind the request (the write-behind queue, held while a request runs) is pending."""
    with RedisServer() as server:
        store = TieredStore([RedisTier(server.url)], namespace=NS)
        with store.quiet():                            # the writer starts nothing while a request runs
            store.put(key("slow"), b"s" * 100, meta())
            assert store.probe_miss([key("slow"), key("other")]).pending == [True, False]
        store.drain()
        assert store.probe_miss([key("slow")]).pending == [False]
        store.close()


# -- L3: what a fresh process learns -----------------------------------------------------------------
@needs_redis
def test_a_fresh_store_learns_the_namespaces_l3_holds_and_finds_a_probe_there(tmp_path):
    with RedisServer() as server:
        writer = TieredStore([MemoryTier(1 << 20), RedisTier(server.url, prefix="t")], namespace=OTHER_NS)
        writer.put(key("f32"), b"v" * 300, meta(OTHER_NS))
        writer.drain()
        writer.close()
        with server.client() as client:
            assert client.hgetall(b"t:namespaces") == {OTHER_NS.encode(): b"300"}
        fresh = TieredStore([MemoryTier(1 << 20), RedisTier(server.url, prefix="t")], namespace=NS)
        assert fresh.tiers[1].keys() == []             # it never listed the server
        probe = fresh.probe_miss([key("ours")], [key("f32")])
        assert probe.namespaces == {OTHER_NS: 300}
        assert probe.found == ["L3"] and probe.history == [None] and probe.down == {}
        fresh.clear("L3")                              # every object gone: so is the registry
        with server.client() as client:
            assert client.exists(b"t:namespaces") == 0
        fresh.close()


@needs_redis
def test_l3_down_is_named_with_the_breakers_reason(tmp_path):
    with RedisServer() as server:
        store = TieredStore([MemoryTier(1 << 20), RedisTier(server.url, timeout=0.5)], namespace=NS)
        url = server.url
    store.tiers[1].ping()                              # the server is gone: the breaker trips
    probe = store.probe_miss([key(1)], [key(2)])
    assert list(probe.down) == ["L3"] and "KVB_L3_URL" in probe.down["L3"] and url.split("//")[1] in probe.down["L3"]
    store.close()


# -- the cache server ------------------------------------------------------------------------------
def test_the_pool_records_a_pressure_shed_a_clear_and_whether_a_tier_below_keeps_it(tmp_path):
    from kvbridge.cache_server.pages import Watermarks
    from kvbridge.cache_server.pool import PagedPool
    from kvbridge.cache_server.shm import Segment

    segment = Segment.create(10, 4096, directory=tmp_path)
    try:
        pool = PagedPool(segment, Watermarks(0.2, 0.0, 0.0, 0.5), kept_below=lambda k: k == key(0))
        for i in range(9):                                   # 9 of 10 pages: under SOFT pressure
            lease = pool.prepare_write(key(i), 4000, meta(), "writer", 9)
            assert pool.commit(lease.lease_id, "writer")
        assert pool.evict_to_target() == 4                   # the background loop sheds down to 50 % free
        shed = pool.history.latest(key(1))
        assert (shed.tier, shed.reason, shed.policy, shed.for_key, shed.gone) == ("L1", "pressure", "LRU", b"", True)
        assert pool.history.latest(key(0)).gone is False     # a tier below keeps it (a demotion)
        pool.clear()
        assert {pool.history.latest(key(i)).reason for i in range(4, 9)} == {"clear"}
        assert "when the tier was cleared" in pool.history.latest(key(8)).describe()
    finally:
        segment.close(unlink=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kvbridge.settings import Settings

    root = tmp_path_factory.mktemp("history-server")
    settings = dataclasses.replace(Settings(), chunk_size=16, l2_enabled=False, l2_dir=str(root / "l2"),
                                   output_dir=str(root / "out"), input_dir=str(root / "in"), **SMALL_POOL)
    with running_server(settings) as srv:
        yield srv


def test_probe_miss_over_the_cache_server_finds_an_evicted_key_and_a_pending_one(server):
    store = RemoteStore(CacheClient(server.url, timeout_s=5), namespace=NS)
    try:
        blob = b"p" * (512 << 10)                      # 8 pages of 64 KiB; the pool holds 64 pages
        for i in range(12):
            assert store.put(key(f"e{i}"), blob, meta())
        probe = store.probe_miss([key("e0"), key("e11")], [key("e11"), key("none")])
        first = probe.history[0]
        assert first is not None and (first.tier, first.reason, first.policy, first.gone) == ("L1", "lru", "LRU", True)
        assert first.for_kind == "chunk" and first.for_size == len(blob) and first.for_key.startswith(b"kkkkkkkkkkkk")
        assert probe.history[1] is None and probe.found == ["L1", ""] and probe.round_trips == 1
        assert probe.namespaces.get(NS, 0) >= len(blob) and probe.down == {}
        # a write the server has leased but not committed yet: pending
        server.store.prepare(key("leased"), 1000, meta(), "another-client", 5)
        assert store.probe_miss([key("leased"), key("e0")]).pending == [True, False]
        recent = store.recent_evictions(5)
        assert recent and recent[0].tier == "L1" and all(isinstance(e, Eviction) for e in recent)
        assert server.modules.by_name["lookup"].report_status()["miss_probes"]["evicted"] >= 1
    finally:
        store.close()


def test_probe_miss_against_a_stopped_cache_server_is_down_within_the_timeout(tmp_path):
    from kvbridge.settings import Settings

    settings = dataclasses.replace(Settings(), chunk_size=16, l2_enabled=False, l2_dir=str(tmp_path / "l2"),
                                   output_dir=str(tmp_path / "out"), **SMALL_POOL)
    with running_server(settings) as srv:
        store = RemoteStore(CacheClient(srv.url, timeout_s=1.0), namespace=NS)
        assert store.probe_miss([key(1)]).down == {}
    started = time.monotonic()
    probe = store.probe_miss([key(1)], [key(2)])       # never raises
    waited = time.monotonic() - started
    assert waited < 1.5 and probe.round_trips == 1
    assert probe.down == {"cache server": f"{srv.url}: timed out after 1 s (KVB_CACHE_SERVER_TIMEOUT)"}
    assert probe.history == [None] and probe.found == [""]
    again = time.monotonic()
    assert "cache server" in store.probe_miss([key(1)]).down and time.monotonic() - again < 0.5   # backing off
    assert store.recent_evictions() == []
    store.close()
