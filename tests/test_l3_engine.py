"""Cross-host sharing through L3, with real processes, the real model and real Redis (issue 11, §2).

Two engine processes stand for two hosts: each its own L1 and L2 directory, one L3. Host A answers
a document question (a miss, stored); host B's first request for another question on the same
document restores the document's KV from L3, and its greedy answer equals its own cold answer
token for token. The same through a Redis Cluster of three masters with a replica each. With the
server killed between requests, both hosts keep answering correctly (misses, not errors).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.cache_server_helpers import PROJECT, server_env
from conftest import needs_model
from tests.redis_helpers import RedisCluster, RedisServer, needs_redis

pytestmark = [needs_model, needs_redis, pytest.mark.live, pytest.mark.slow, pytest.mark.timeout(420)]
CHILD = PROJECT / "tests" / "l3_engine_child.py"


def host(settings, name: str, url: str, *steps: str) -> subprocess.Popen:
    """One host's engine process: its own L2 directory, the shared L3."""
    env = server_env(settings.replace(l2_dir=str(settings.l2_dir) + f"-{name}", l3_url=url, l3_timeout=1.0))
    return subprocess.Popen([sys.executable, str(CHILD), *steps], env=env, cwd=PROJECT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def records(child: subprocess.Popen, count: int, timeout: float = 300) -> list[dict]:
    found: list[dict] = []
    deadline = time.monotonic() + timeout
    while len(found) < count and time.monotonic() < deadline:
        line = child.stdout.readline()
        if line.startswith("{"):
            found.append(json.loads(line))
        elif not line and child.poll() is not None:
            break
    if len(found) < count:
        child.kill()
        pytest.fail(f"host printed {len(found)} of {count} records; stderr:\n{child.stderr.read()[-3000:]}")
    return found


def finish(child: subprocess.Popen) -> None:
    if child.stdin:
        child.stdin.close()
    assert child.wait(timeout=120) == 0, child.stderr.read()[-3000:]


@pytest.fixture
def settings(make_settings):
    return make_settings(n_predict=12)


@pytest.fixture(scope="module")
def cluster():
    with RedisCluster() as c:
        yield c


def _host_b_restores_from_l3(settings, url: str) -> dict:
    a = host(settings, "a", url, "lmcache:0")
    stored = records(a, 1)[0]
    finish(a)                                   # closing waits for the L3 writes
    assert stored["tier"] == "none" and stored["stored_objects"] > 0 and not stored["error"]
    b = host(settings, "b", url, "cold:1", "lmcache:1")
    cold, warm = records(b, 2)
    finish(b)
    assert warm["tier"] == "L3", warm
    assert warm["matched_tokens"] >= warm["prompt_tokens"] // 2 and warm["restore_ok"] is True
    assert warm["text"] == cold["text"] and warm["gen_tokens"] == cold["gen_tokens"]
    assert not warm["error"] and not cold["error"]
    return warm


def test_host_b_restores_from_standalone_l3_what_host_a_stored(settings):
    with RedisServer() as server:
        _host_b_restores_from_l3(settings, server.url)
        with server.client() as client:
            assert client.keys("kvb:obj:*")          # KVBridge's keys, under the default prefix


def test_host_b_restores_from_a_cluster_what_host_a_stored(settings, cluster):
    _host_b_restores_from_l3(settings, cluster.url)
    masters_with_objects = 0
    for port in cluster.masters():
        with cluster.node(port).client() as node:
            masters_with_objects += bool(node.keys("kvb:obj:*"))
    assert masters_with_objects >= 2            # the objects spread over the masters


def test_both_hosts_answer_correctly_when_l3_dies_between_requests(settings):
    with RedisServer() as server:
        a = host(settings, "a", server.url, "lmcache:0", "wait", "cold:2", "lmcache:2")
        first = records(a, 1)[0]
        assert first["stored_objects"] > 0
        with server.client() as client:          # the write-behind reaches L3, every stored object, then the kill
            deadline = time.monotonic() + 60
            while len(client.keys("kvb:obj:*")) < first["stored_objects"]:
                assert time.monotonic() < deadline, f"L3 holds {len(client.keys('kvb:obj:*'))} of " \
                                                    f"{first['stored_objects']} stored objects after 60 s"
                time.sleep(0.05)
        server.kill()
        a.stdin.write("go\n")
        a.stdin.flush()
        cold_a, warm_a = records(a, 2)
        finish(a)
        b = host(settings, "b", server.url, "cold:1", "lmcache:1")
        cold_b, warm_b = records(b, 2)
        finish(b)
    assert warm_a["text"] == cold_a["text"] and warm_a["tier"] in ("L1", "L2")  # its own tiers still serve
    assert warm_b["text"] == cold_b["text"] and warm_b["tier"] == "none"        # L3 down: a miss
    assert not any(r["error"] for r in (cold_a, warm_a, cold_b, warm_b))


def test_two_cache_servers_share_kv_through_their_common_l3(settings, tmp_path):
    """L3 works under the cache server too: server 1's engine stores, server 2 (its own L1 and L2) restores."""
    from tests.cache_server_helpers import ServerProcess, local_url

    with RedisServer() as redis_server:
        for name, steps in (("one", ("lmcache:0",)), ("two", ("cold:1", "lmcache:1"))):
            server_settings = settings.replace(l2_dir=str(tmp_path / f"server-{name}-l2"), l1_bytes=64 << 20,
                                               l3_url=redis_server.url, l3_timeout=1.0, cache_server_timeout=5.0)
            url = local_url()
            server = ServerProcess(server_env(server_settings), url, log_path=tmp_path / f"server-{name}.log")
            try:
                engine_env = server_env(server_settings.replace(store_url=url, l2_dir=str(tmp_path / "unused")))
                child = subprocess.Popen([sys.executable, str(CHILD), *steps], env=engine_env, cwd=PROJECT,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True)
                got = records(child, len(steps))
                finish(child)
            finally:
                assert server.terminate() == 0, server.tail()   # a clean stop drains the writes to L2 and L3
                server.close()
            if name == "one":
                assert got[0]["stored_objects"] > 0 and not got[0]["error"]
            else:
                cold, warm = got
                assert warm["tier"] == "L3", warm
                assert warm["text"] == cold["text"] and not warm["error"]
