"""Storage faults cost the cache server's clients a bounded time, never a stall: an eviction on the
server's loop thread (a store that needs room) does not ask a silent Redis whether it holds the
evicted object; the disk writer's thread asks, and waits, alone.
"""
from __future__ import annotations

import time

from cache_server_helpers import running_server
from kvbridge.cache_server.client import CacheClient
from kvbridge.store.objects import ObjectMeta
from tests.redis_helpers import RedisServer, needs_redis

PAGE = 64 << 10
META = ObjectMeta(namespace="ns", n_tokens=1, tokens_digest=b"", kind="chunk")


@needs_redis
def test_an_eviction_on_the_loop_thread_does_not_wait_for_a_silent_redis(make_settings):
    # A full Redis (noeviction) refuses every write at once, so L3's index never learns the objects and
    # the disk writer is idle when Redis then goes silent: the first to ask Redis about an evicted
    # object is whoever checks whether to demote it.
    with RedisServer(maxmemory=100_000, maxmemory_policy="noeviction") as redis:
        settings = make_settings(l1_bytes=8 * PAGE, cache_server_page_bytes=PAGE, l3_url=redis.url, l3_timeout=4.0,
                                 l2_enabled=False)
        with running_server(settings) as server, CacheClient(server.url, timeout_s=20) as client:
            for i in range(3):                                  # 6 of 8 pages: the next store must evict
                assert client.store(bytes([i]) * 16, bytes([i]) * (2 * PAGE), META)[0]
            client.flush()
            redis.pause(5)      # Redis accepts connections but answers nothing, past l3_timeout (a wait would take 4 s)
            started = time.monotonic()
            assert client.store(b"n" * 16, b"n" * (2 * PAGE), META)[0]   # evicts an object L3 does not hold
            elapsed = time.monotonic() - started
            # asking Redis whether it holds the evicted object, under the pool lock, took l3_timeout (4 s)
            assert elapsed < 2.0, f"a store that evicts took {elapsed:.1f} s with Redis silent"
            assert server.store.pool.stats()["evictions"] >= 1


def test_a_hung_server_costs_a_client_fewer_timeouts_as_it_stays_hung(make_settings, tmp_path):
    """A SIGSTOPped server: after each timeout the client fails at once for a back-off that doubles
    (1, 2, 4 ... 30 s), so a hung server is not paid for with a timeout every second; once it answers
    again the client is back after at most the back-off it was in."""
    import os
    import signal

    from cache_server_helpers import ServerProcess, local_url, server_env
    from kvbridge.cache_server.connection import CacheServerUnavailable

    settings = make_settings(l1_bytes=8 * PAGE, cache_server_page_bytes=PAGE)
    url = local_url()
    server = ServerProcess(server_env(settings), url, log_path=tmp_path / "server.log")
    try:
        with CacheClient(url, timeout_s=0.3) as client:
            assert client.lookup([b"k" * 16], "ns").n_hit == 0
            os.kill(server.proc.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 6.0
            failures = 0
            while time.monotonic() < deadline:
                try:
                    client.lookup([b"k" * 16], "ns")
                except CacheServerUnavailable:
                    failures += 1
                time.sleep(0.05)
            # a fixed 1 s back-off paid a 0.3 s timeout about every 1.3 s: 5 in 6 s; doubling pays 3
            assert client.counters["timeouts"] <= 3 and failures > 50
            os.kill(server.proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 10.0
            while True:
                try:
                    assert client.lookup([b"k" * 16], "ns").n_hit == 0
                    break
                except CacheServerUnavailable:
                    assert time.monotonic() < deadline, "the client did not come back after the server did"
                    time.sleep(0.1)
    finally:
        if server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.close()


def test_bad_client_arguments_name_themselves(make_settings):
    """An int instance id (a natural thing to pass) used to surface as 'no answer to hello ... not
    reachable' while the server logged a malformed request."""
    import pytest

    with running_server(make_settings(l1_bytes=8 * PAGE, cache_server_page_bytes=PAGE)) as server:
        for kwargs, named in (({"instance_id": 42}, "instance_id"), ({"instance_id": ""}, "instance_id"),
                              ({"priority": 12}, "priority"), ({"priority": "5"}, "priority")):
            started = time.monotonic()
            with pytest.raises(ValueError, match=named):
                CacheClient(server.url, timeout_s=5, **kwargs)
            assert time.monotonic() - started < 1.0       # at once, not after a timeout
        with pytest.raises(ValueError, match="tcp://HOST:PORT"):
            CacheClient("localhost:5555")
        with CacheClient(server.url, instance_id="engine-7", timeout_s=5) as client:
            assert client.lookup([b"k" * 16], "ns").n_hit == 0


def test_a_shadow_engines_prediction_gives_back_what_the_server_lent(make_settings):
    """ShadowIndex.predict reads a tail index object through the cache server's shared memory: the read
    lease is released at once, not left for the lease timeout (every shadow request leaked one)."""
    from kvbridge.cache_server.remote_store import RemoteStore
    from kvbridge.engine.shadow_index import ShadowIndex
    from kvbridge.engine.hashing import make_hasher

    settings = make_settings(l1_bytes=8 * PAGE, cache_server_page_bytes=PAGE, l2_enabled=False)
    with running_server(settings) as server:
        store = RemoteStore(CacheClient(server.url, timeout_s=5), namespace="ns-shadow")
        hasher = make_hasher(16, "ns-shadow", False)
        index = ShadowIndex(store, "ns-shadow", hasher.seed, 16)
        tokens = list(range(1, 41))
        index.record(tokens, hasher.chunk_hashes(tokens))
        store.flush()
        for _ in range(3):
            k, predicted, tier = index.predict(tokens + [99], hasher.chunk_hashes(tokens + [99]))
            assert (k, predicted, tier) == (2, 40, "L1")
        store.lookup([b"z" * 32])    # a round trip after the releases (sent without waiting) lands after them
        assert server.store.pool.stats()["read_leases"] == 0
        store.close()


def test_a_newer_tail_replaces_the_older_one_as_in_the_embedded_store(make_settings, tmp_path):
    """Tails are filed under their chunk boundary: a newer prompt's tail replaces the older one (in L1
    and on the server's disk), as the embedded store does; a chunk (content-keyed) is never replaced.
    The server used to refuse the newer tail as 'exists' while the client counted it stored."""
    settings = make_settings(l1_bytes=8 * PAGE, cache_server_page_bytes=PAGE, l2_dir=str(tmp_path / "l2"))
    tail = ObjectMeta(namespace="ns", n_tokens=3, tokens_digest=b"", kind="tail")
    with running_server(settings) as server, CacheClient(server.url, timeout_s=5) as client:
        assert client.store(b"t" * 16, b"older tail", tail)[0]
        client.flush()
        assert client.store(b"t" * 16, b"the newer tail", tail) == (True, "")
        assert client.store(b"c" * 16, b"a chunk", META)[0]
        assert client.store(b"c" * 16, b"a chunk", META) == (True, "exists")     # same key, same content
        found = client.retrieve(b"t" * 16, "ns")
        assert bytes(found.blob) == b"the newer tail"
        client.release([found])
        client.flush()
        client.clear("L1")
        found = client.retrieve(b"t" * 16, "ns")                  # from the server's L2 now
        assert found.tier == "L2" and bytes(found.blob) == b"the newer tail"
        client.release([found])
        server.store.pool.check_invariants()


def test_one_bad_lease_id_in_a_commit_does_not_strand_the_good_ones(make_settings):
    """store_commit_many with an unknown id first: the reply names the bad id, and the good leases after
    it are committed, not left to the lease timeout (then quarantined)."""
    import pytest

    from kvbridge.cache_server import protocol
    from kvbridge.cache_server.client import CacheServerError
    from kvbridge.cache_server.protocol import Kind

    settings = make_settings(l1_bytes=8 * PAGE, cache_server_page_bytes=PAGE)
    with running_server(settings) as server, CacheClient(server.url, timeout_s=5) as client:
        client.ping()
        keys = [b"a" * 16, b"b" * 16]
        prepared = client._call(Kind.STORE_PREPARE_MANY, protocol.StorePrepareMany(
            [protocol.StorePrepare(key, PAGE, protocol.WireMeta.of(META)) for key in keys]),
            protocol.PrepareManyReply).items
        for key, answer in zip(keys, prepared):
            client._segment.write(list(answer.pages), key[:1] * PAGE)
        with pytest.raises(CacheServerError, match="lease"):
            client._call(Kind.STORE_COMMIT_MANY, protocol.StoreCommitMany([2**40] + [a.lease_id for a in prepared]),
                         protocol.CommitManyReply)
        assert client.lookup(keys, "ns").n_hit == 2
        assert server.store.pool.stats()["pending_pages"] == 0
