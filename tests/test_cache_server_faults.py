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
            redis.pause(8)                                      # Redis accepts connections but answers nothing
            started = time.monotonic()
            assert client.store(b"n" * 16, b"n" * (2 * PAGE), META)[0]   # evicts an object L3 does not hold
            elapsed = time.monotonic() - started
            # asking Redis whether it holds the evicted object, under the pool lock, took l3_timeout (4 s)
            assert elapsed < 2.0, f"a store that evicts took {elapsed:.1f} s with Redis silent"
            assert server.store.pool.stats()["evictions"] >= 1
