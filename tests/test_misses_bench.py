"""bench-misses at small sizes (issue 35): all five scenarios on the zoo's llama (a real GGUF, SmolLM2's tokenizer),
a real redis-server and the real scheduler; every miss attributed to the cause its scenario built, the table and
the JSON written, explaining on and off side by side, and the command's error for a person."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvbridge.bench.misses_bench import SCENARIOS, format_bench_misses, run_bench_misses, write_outputs
from kvbridge.cli.common import make_engine
from kvbridge.models import zoo_model
from kvbridge.settings import Settings
from tests.redis_helpers import needs_redis

pytestmark = [needs_redis, pytest.mark.live, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-misses")
    settings = dataclasses.replace(Settings(), model_path=str(zoo_model("llama")), chunk_size=32, ctx_size=1024,
                                   l2_dir=str(tmp / "l2"), output_dir=str(tmp / "out"), input_dir=str(tmp / "in"),
                                   sched_kv_cells=2048)
    said: list[str] = []
    found = run_bench_misses(settings, make_engine, SCENARIOS, n_requests=3, doc_chars=500, lengths=(128, 192),
                             repeats=2, n_predict=2, say=said.append)
    found["said"], found["output_dir"] = said, settings.output_dir
    return found


def test_every_miss_is_attributed_to_the_cause_its_scenario_built(result):
    summary = result["summary"]
    assert summary["unexplained_misses"] == 0, summary["unexplained"]
    assert summary["unexpected_hits"] == []
    causes = {name: row["causes"] for name, row in summary["by_scenario"].items()}
    assert causes == {"long-context": {"none_stored": 1, "diverged": 3},
                      "doc-qa": {"none_stored": 2, "evicted": 1},
                      "model-file": {"other_namespace": 3},
                      "tenant-salt": {"other_namespace": 3},
                      "redis-stop": {"tier_down": 3}}
    details = {(r["scenario"], r["reason"]): r["detail"] for r in result["rows"]}
    assert "evicted from L1 by LRU" in details["doc-qa", "evicted"]
    assert "model_sha256" in details["model-file", "other_namespace"]
    assert "cache_salt" in details["tenant-salt", "other_namespace"]
    assert "L3" in details["redis-stop", "tier_down"]
    # the operator's record names the salt; the tenant sees none_stored (serve's redaction)
    assert summary["client_views"] == ["none_stored"]
    assert [line for line in result["said"] if "long-context" in line]


def test_warm_hits_explained_and_not_side_by_side(result):
    t = result["ttft"]
    assert len(t["on_all"]) == len(t["off_all"]) == 2
    assert t["on_ms"] > 0 and t["off_ms"] > 0
    assert t["store_calls_on"] == t["store_calls_off"]      # a hit makes no extra store call
    assert t["explain_ms_max"] == 0
    assert result["summary"]["explain_ms_on_a_miss"]["median"] > 0


def test_the_json_and_the_markdown_table_are_written(result):
    path = write_outputs(result, result["output_dir"])
    data = json.loads(Path(path).read_text())
    assert data["summary"]["unexplained_misses"] == 0 and len(data["rows"]) == data["summary"]["requests"] == 16
    table = path.with_suffix(".md").read_text()
    assert "| redis-stop | 3 | 3 | tier_down 3 | 0 |" in table and "KVB_EXPLAIN_MISSES=true" in table
    text = format_bench_misses(result)
    assert "unexplained misses: 0 of 16 (target 0)" in text and "BAD" not in text


def test_an_unknown_scenario_is_an_error_naming_the_known_ones():
    from kvbridge.cli.commands import BY_NAME, build_parser

    args = build_parser().parse_args(["bench-misses", "--scenarios", "doc-qa,nope"])
    with pytest.raises(SystemExit, match="nope.*doc-qa, long-context, model-file, tenant-salt, redis-stop"):
        BY_NAME["bench-misses"].run(args)
