"""The cache-server benchmarks run end to end on a real private server with tiny sizes.

Contracts only (the result's shape, positive figures, the server stopped cleanly); never a timing
threshold: the figures themselves are reported in Docs/Research.md with their commands.
"""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import closing

import numpy as np
import pytest

from conftest import needs_model
from kvbridge.backends import make_backend
from kvbridge.bench.cache_server_bench import (SodiumBox, bench_inline_vs_socket, bench_restore_through_server,
                                               bench_store_both_ways, fresh_key, measure_idle_cpu, measure_server_memory)
from kvbridge.cache_server import protocol
from kvbridge.bench.common.private_server import bench_client, private_cache_server
from kvbridge.cache_server.remote_store import RemoteStore
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.settings import WORK_DIR
from kvbridge.store import ObjectMeta

pytestmark = [pytest.mark.live, pytest.mark.timeout(120)]
OBJECT = 200_000


@pytest.fixture
def small_settings(make_settings):
    return make_settings(l1_bytes=8 << 20, cache_server_page_bytes=64 << 10)


def test_store_memory_and_idle_figures_from_a_private_server(small_settings):
    with private_cache_server(small_settings) as server:
        with bench_client(server) as client:
            store = bench_store_both_ways(client, OBJECT, repeats=3)
            assert client.counters["granted_stores"] > 0 and client.grants   # the lone stores used pages lent ahead
            memory = measure_server_memory(client, server.pid, server.pool_bytes, fill=0.5, object_bytes=OBJECT)
        idle = measure_idle_cpu(server, seconds=0.5)
    assert server.proc.returncode == 0, server.log_tail()
    for regime in ("first_touch", "pages_mapped"):
        s = store[regime]
        assert s["shared_memory"] and s["object_bytes"] == OBJECT
        assert min(s["store_ms"], s["copy_ms"], s["fresh_copy_ms"], s["store_vs_fresh_copy"], s["two_round_trips_ms"], s["ping_ms"], s["socket_round_trip_ms"], s["store_vs_copy"]) > 0
    assert memory["pool_bytes"] == 8 << 20 and 0.4 * memory["pool_bytes"] <= memory["filled_bytes"] <= 0.5 * memory["pool_bytes"]
    assert min(memory["rss"], memory["rss_shmem"], memory["non_pool_rss"], memory["threads"]) > 0
    assert memory["rss_minus_pool"] == memory["rss"] - memory["pool_bytes"]
    assert idle["clients"] == 2 and idle["seconds"] > 0 and idle["server_core_pct"] >= 0


def test_inline_bytes_against_a_plain_socket(small_settings):
    meta = ObjectMeta(namespace="bench", n_tokens=4, tokens_digest=bytes(16))
    keys = [fresh_key() for _ in range(3)]
    with private_cache_server(small_settings) as server:
        with bench_client(server) as writer, bench_client(server, use_shm=False) as reader:
            for i, key in enumerate(keys):
                assert writer.store(key, bytes([i]) * (OBJECT + i), meta)[0]
            result = bench_inline_vs_socket(reader, keys, "bench", repeats=2)
            assert reader.counters["shm_retrieves"] == 0 and reader.counters["inline_retrieves"] > 0
    assert result["objects"] == 3 and result["bytes"] == 3 * OBJECT + 3
    assert min(result["inline_ms"], result["socket_ms"], result["inline_vs_socket"], result["whole_ms"],
               result["many_ms"], result["many_vs_socket"]) > 0
    assert result["frame_bytes"] == protocol.INLINE_FRAME_BYTES and reader.frame_bytes == protocol.INLINE_FRAME_BYTES
    # pyzmq's wheel carries the libsodium its libzmq uses: the cipher row is measured, not left out
    assert result["cipher_ms"] > 0 and result["cipher_vs_socket"] > 0
    assert set(result["cpu_ms"]) == {"plain_socket", "whole", "framed", "many", "cipher"}


def test_the_cipher_bench_seals_and_opens_with_libsodium():
    box = SodiumBox.load()
    assert box is not None
    data = np.arange(3 * 70_000, dtype=np.uint64).view(np.uint8)[:200_003]
    box.seal_and_open(data, 65_536)   # raises when what was sealed does not open
    plain, sealed, opened = box._frame_buffers(200_003 - 3 * 65_536)
    assert bytes(opened[SodiumBox.ZEROBYTES:]) == bytes(data[3 * 65_536:]) and bytes(sealed) != bytes(plain)


@needs_model
def test_restore_through_the_server_next_to_the_embedded_store(small_settings, tmp_path):
    settings = small_settings.replace(chunk_size=32, l1_bytes=32 << 20)
    with private_cache_server(settings) as server:
        with CachedEngine(settings, make_backend("llamacpp", settings)) as engine, \
                closing(RemoteStore.from_settings(server.engine_settings)) as remote:
            r = bench_restore_through_server(engine, remote, prompt_tokens=80, repeats=1)
    assert r["first_record_error"] == ""
    assert r["restored_tokens"] == r["server_restored_tokens"] == 80 and r["server_tier"] == "L1"
    assert r["objects"] == len(r["keys"]) == 80 // 32 + 1   # two chunks and the tail
    assert r["shm_retrieves"] > 0 and r["state_bytes"] > 0
    assert min(r["embedded_ms"], r["server_shm_ms"], r["memcpy_ms"], r["server_vs_embedded"]) > 0


def test_cli_bench_cache_server_prints_every_figure(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVB_")}, "KVB_L1_BYTES": "8MiB",
           "KVB_CACHE_SERVER_PAGE_BYTES": "64KiB", "KVB_L2_DIR": str(tmp_path / "l2")}
    out = subprocess.run([sys.executable, "-m", "kvbridge", "bench-cache-server", "--object-mb", "0.2",
                          "--repeats", "2", "--fill", "0.3", "--idle-s", "0.5"],
                         cwd=WORK_DIR, env=env, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    for words in ("pool pages new to this client", "pool pages this client mapped before", "RSS - pool",
                  "idle with 2 clients"):
        assert words in out.stdout
    assert not list((tmp_path / "l2").glob("*")), "the bench's server keeps its L2 in its own temp dir"
