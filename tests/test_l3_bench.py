"""bench-l3 runs end to end on a private redis-server with tiny sizes: the report's shape and the oracle.

Contracts only (counts, tiers, answers equal to cold), never a timing threshold: the figures are
reported in Docs/Research.md with their command.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import needs_model
from kvbridge.backends import make_backend
from kvbridge.bench.l3_bench import format_bench_l3, run_bench_l3
from kvbridge.bench.common.private_redis import RedisServerMissing, find_redis_server, private_redis
from kvbridge.bench.common.runner import empty_faster_tiers, run_scenario
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.errors import BadSettings
from kvbridge.settings import WORK_DIR
from kvbridge.store import MemoryTier, TieredStore

pytestmark = [pytest.mark.live, pytest.mark.timeout(300)]   # ~30 s quiet; far longer on a loaded machine

try:
    REDIS_SERVER = find_redis_server()
    MISSING = ""
except RedisServerMissing as missing:
    REDIS_SERVER, MISSING = None, str(missing)
needs_redis_server = pytest.mark.skipif(REDIS_SERVER is None, reason=f"redis-server binary missing: {MISSING}")


SHORT = 600   # characters of the handbook (~150 tokens, 4 chunks of 32): a prefill is cheap on 2 cores


def make_engine(settings, l2_dir):
    settings = settings.replace(l2_dir=l2_dir)
    return CachedEngine(settings, make_backend("llamacpp", settings))


@needs_model
@needs_redis_server
def test_every_part_runs_on_a_private_server_and_lmcache_answers_equal_cold(make_settings, short_doc):
    settings = make_settings(l3_timeout=0.3, l1_bytes=256 << 20, n_predict=4)
    result = run_bench_l3(settings, make_engine, repeats=1, n_requests=3, quality_questions=1, prompt_tokens=80,
                          document=short_doc[:SHORT], say=lambda line: None)
    assert result["server"].startswith("a private redis-server on redis://127.0.0.1:")

    qa = result["doc_qa"]
    assert qa["errors"] == [] and qa["requests"] == 3
    assert qa["answers_equal"] == 3, "the oracle: every lmcache answer equals the cold one"
    assert qa["warm_requests"] == 2 and qa["warm_tiers"] == {"L3": 2}, "every warm hit came from L3"
    assert qa["store"]["behind_dropped"] == 0 and qa["store"]["remote_errors"] == 0
    assert qa["mean_speedup"] > 0 and qa["warm_median_speedup"] > 0

    restore = result["restore"]
    assert restore["first_record_error"] == "" and restore["tiers"] == {"L3": 1}
    assert restore["restored_tokens"] == 80 and restore["objects"] == 80 // 32 + 1   # two chunks and the tail
    assert restore["value_bytes"] > restore["state_bytes"] > 0    # each value carries its checked header
    assert min(restore["restore_ms"], restore["get_ms"], restore["tier_read_ms"], restore["restore_vs_get"]) > 0

    lookup = result["lookup"]
    assert (lookup["unknown_held"]["round_trips"], lookup["unknown_held"]["n_hit"]) == (1, 12)
    assert lookup["unknown_held"]["replies"] == 24        # STRLEN + GETRANGE per hash, in one pipeline
    assert (lookup["known"]["round_trips"], lookup["known"]["n_hit"]) == (0, 12)
    assert (lookup["not_held"]["round_trips"], lookup["not_held"]["n_hit"]) == (1, 0)
    assert lookup["restore_reads"]["n_hit"] == 13 and lookup["get_many_unknown"]["n_hit"] == 12

    for case in ("killed", "silent"):
        down = result["down"][case]
        assert down["state_after_first"] == down["state_after_later"] == "down"
        assert down["skipped_down"] >= down["later"], "later lookups skip L3 while it is down"
        assert down["first_ms"] > 0 and down["probe_ms"] > 0
    assert result["down"]["silent"]["counts"]["timeouts"] >= 1
    assert result["down"]["killed"]["counts"]["connection_errors"] >= 1

    codecs = result["codecs"]
    rows = codecs["throughput"]["codecs"]
    assert rows["raw"]["ratio"] == 1 and rows["raw"]["round_trip_exact"] and rows["zstd"]["round_trip_exact"]
    assert rows["int8"]["declined"] == 0 and rows["int8"]["ratio"] > 1.5 and not rows["int8"]["round_trip_exact"]
    restores = codecs["restores"]
    for name in ("raw", "zstd", "int8"):
        assert restores["tiers"]["L2"][name] == ["L2"] and restores["tiers"]["L3"][name] == ["L3"]
        assert restores["behind_dropped"][name] == 0
    quality = codecs["quality"]
    assert quality["summary"]["raw"]["identical"] == 1, "the control: raw KV restored gives the cold answer"
    assert quality["cold_equals_bench_cold"] == (1, 1)
    assert all(row["int8"]["lossy"] == ["int8"] and row["int8"]["tier"] == "L2" for row in quality["rows"])
    assert 0 <= quality["summary"]["int8"]["equal_positions_fraction"] <= 1

    text = format_bench_l3(result)
    for words in ("(a) Document Q&A", "(b) 80-token restore", "(c) lookup of 12 hashes", "(d) L3 stopped",
                  "(e) codecs", "target >= 8x", "target <= 3x"):
        assert words in text


@needs_redis_server
def test_private_redis_answers_and_stops():
    import redis

    with private_redis() as server:
        assert redis.Redis.from_url(server.url).ping()
    assert server.proc.returncode == 0


def test_a_missing_redis_server_names_the_setup_script(tmp_path):
    with pytest.raises(RedisServerMissing, match=r"\./scripts/setup\.sh"):
        with private_redis(binary=str(tmp_path / "redis-server")):
            pass


def test_from_tier_needs_that_tier_and_a_request_list(make_settings):
    store = TieredStore([MemoryTier(1 << 20)])
    with pytest.raises(BadSettings, match="KVB_L3_URL"):
        empty_faster_tiers(store, "L3")
    with pytest.raises(BadSettings, match="orders its own requests"):
        next(run_scenario(None, "long-context", ["lmcache"], before_request=lambda mode: None))


@needs_redis_server
def test_cli_bench_l3_prints_the_lookup_part(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVB_")}, "KVB_OUTPUT_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "kvbridge", "bench-l3", "--parts", "lookup"], cwd=WORK_DIR,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "(c) lookup of 12 hashes" in out.stdout and "target: one round trip: met" in out.stdout
    exported = json.loads(next(tmp_path.glob("kvbridge-bench-l3-*.json")).read_text())
    assert exported["lookup"]["unknown_held"]["round_trips"] == 1


@needs_model
@needs_redis_server
def test_cli_bench_from_tier_l3_serves_the_warm_hit_from_a_private_redis(tmp_path, short_doc):
    document = tmp_path / "doc.txt"
    document.write_text(short_doc[:SHORT], encoding="utf-8")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVB_")}, "KVB_OUTPUT_DIR": str(tmp_path / "out")}
    out = subprocess.run([sys.executable, "-m", "kvbridge", "bench", "--scenario", "doc-qa", "--modes", "lmcache",
                          "--requests", "2", "--chunk-size", "32", "--n-predict", "2", "--document", str(document),
                          "--from-tier", "L3"], cwd=WORK_DIR, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "L3 on a private redis-server" in out.stdout
    assert "tiers {'none': 1, 'L3': 1}" in out.stdout, out.stdout[-2000:]
