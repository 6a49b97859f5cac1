"""`python -m kvbridge bench-scheduler` end to end with tiny sizes: the shape of its report, no timing thresholds.

The comparison runs our scheduler and a real llama-server (built by scripts/build_llama_server.sh)
on the embedded model, one after the other, as a user runs it; what is checked is what a user reads
off the report: every request answered, the urgent TTFTs there, the shared prompt prefilled once on
our side, positive figures, no llama-server left running.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from conftest import needs_model
from kvbridge.__main__ import main
from kvbridge.bench.scheduler_bench import bench_swap_vs_recompute
from kvbridge.settings import WORK_DIR
from test_llama_server import BINARY as LLAMA_SERVER
from test_llama_server import BUILDABLE, our_llama_servers

pytestmark = [needs_model, pytest.mark.timeout(180)]

needs_llama_server = pytest.mark.skipif(
    not LLAMA_SERVER.is_file() and not BUILDABLE,
    reason=f"llama-server is not built ({LLAMA_SERVER}) and cmake/g++ are missing to build it")

# small enough for ~1 minute on 2 busy cores: the low chats are ~500-token prompts (whole manual sections;
# 300 gives the budget room for both, which 120 would not) and the shared system prompt ~600 tokens
TINY = ["--document-tokens", "300", "--low", "2", "--urgent", "1", "--low-predict", "8", "--urgent-predict", "4",
        "--urgent-at", "0.5", "--users", "3", "--user-predict", "4"]


def test_swap_and_recompute_are_both_timed_and_the_whole_sequence_comes_back(make_settings):
    result = bench_swap_vs_recompute(make_settings(), prompt_tokens=96, repeats=1)
    assert result["tokens"] == 96 and result["bytes"] > 96 * 1000
    assert result["swap_out_ms"] > 0 and result["swap_in_ms"] > 0 and result["recompute_ms"] > 0
    assert result["recompute_vs_swap"] == pytest.approx(result["recompute_ms"] / result["swap_ms"])


def test_the_command_prints_the_ratio(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KVB_CHUNK_SIZE", "32")
    monkeypatch.setenv("KVB_L2_DIR", str(tmp_path / "l2"))
    monkeypatch.setenv("KVB_OUTPUT_DIR", str(tmp_path / "output"))
    assert main(["bench-scheduler", "--parts", "swap", "--tokens", "64", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "recompute / swap:" in out and "64-token sequence" in out
    assert "llama-server" not in out   # only the part asked for ran


def test_an_unknown_part_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit, match="Unknown part.*burs"):
        main(["bench-scheduler", "--parts", "swap,burs"])


def test_a_missing_llama_server_is_said_before_our_scheduler_runs(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KVB_LLAMA_SERVER_BIN", str(tmp_path / "no-llama-server"))
    monkeypatch.setenv("KVB_OUTPUT_DIR", str(tmp_path / "output"))
    assert main(["bench-scheduler", "--parts", "burst"]) == 2
    err = capsys.readouterr().err
    assert "no-llama-server does not exist" in err and "build_llama_server.sh" in err
    assert not (tmp_path / "output").exists()


@pytest.fixture(scope="module")
def llama_server_binary():
    """The built llama-server (test.sh builds it first; this covers a plain `pytest`); none may outlive the tests."""
    if not LLAMA_SERVER.is_file():
        subprocess.run([str(WORK_DIR / "scripts" / "build_llama_server.sh")], check=True)
    yield LLAMA_SERVER
    assert our_llama_servers() == [], "a llama-server child outlived its tests"


@needs_llama_server
@pytest.mark.live
@pytest.mark.slow
def test_one_run_compares_the_scheduler_with_llama_server_on_both_workloads(llama_server_binary, capsys, monkeypatch,
                                                                           tmp_path):
    # one thread each: on a shared 2-core machine two spinning threads slow llama.cpp down tenfold
    monkeypatch.setenv("KVB_THREADS", "1")
    monkeypatch.setenv("KVB_CHUNK_SIZE", "32")
    monkeypatch.setenv("KVB_OUTPUT_DIR", str(tmp_path / "output"))
    assert main(["bench-scheduler", "--tokens", "64", "--repeats", "1", *TINY, "--exact"]) == 0
    out = capsys.readouterr().out
    [written] = (tmp_path / "output").glob("kvbridge-bench-scheduler-*.json")
    result = json.loads(written.read_text())
    assert result["parts"] == ["swap", "burst", "shared"] and result["swap"]["tokens"] == 64

    burst = result["burst"]
    assert burst["workload"]["threads"] == 1
    for engine in ("ours", "llama-server"):
        requests = burst["runs"][engine]["requests"]
        assert [(r["label"], r["error"]) for r in requests] == [(r["label"], "") for r in requests]
        assert all(r["ttft_ms"] > 0 and r["gen_tokens"] > 0 and r["prompt_tokens"] > 0 for r in requests)
        figures = burst["figures"][engine]
        assert figures["completed"] == figures["requests"] == 3
        assert 0 < figures["urgent_ttft_median_ms"] <= figures["urgent_ttft_p95_ms"]
        assert figures["throughput_tok_s"] > 0 and figures["wall_s"] > 0
        assert 0 < figures["peak_cells"] <= figures["kv_cells"]
    assert burst["ratios"]["urgent_ttft_median_ms"] > 0 and burst["ratios"]["throughput_tok_s"] > 0
    # --exact: the scheduler again with KVB_SCHED_EXACT=1, every answer held to the same request run alone
    for part in ("burst", "shared"):
        exact = result[part]["exact"]
        assert exact["solo_equal"]["ours, exact"] == [3, 3], exact["solo_equal"]
        assert exact["exact_vs_off"]["throughput_tok_s"] > 0 and exact["exact_vs_llama_server"]["wall_s"] > 0
        for name in ("ours, exact", "ours, flash attention off"):
            assert [r["error"] for r in result[part]["runs"][name]["requests"]] == [""] * 3
        assert exact["exact_vs_off_flash_attention_off"]["wall_s"] > 0

    shared = result["shared"]
    ours = shared["runs"]["ours"]["requests"]
    assert [r["error"] for r in ours] == [""] * 3
    shared_tokens = shared["figures"]["ours"]["shared_tokens"]
    assert shared_tokens > 500   # the system prompt as rendered and tokenized, common to every user
    assert sum(r["computed_tokens"] >= shared_tokens for r in ours) <= 1, "the shared prompt was prefilled twice"
    assert shared["figures"]["ours"]["shared_tokens_computed"] <= shared_tokens + 32
    assert 0 < shared["figures"]["ours"]["peak_cells"] <= shared["figures"]["ours"]["kv_cells"]
    # llama-server's side is reported as it happened: an answer, or its own error (its cells may run out)
    theirs = shared["runs"]["llama-server"]["requests"]
    assert len(theirs) == 3 and all(r["gen_tokens"] > 0 or r["error"] for r in theirs)

    for line in ("Priority burst: 3 requests", "urgent TTFT median (ms)", "ours / llama-server",
                 "Shared system prompt, many users: 3 requests", f"reused all {shared_tokens} shared tokens",
                 "recompute / swap:", f"wrote {written}", "KVB_SCHED_EXACT=1 (flash attention off) against the mode off",
                 "ours, exact: 3 of 3 answers equal the same request run alone"):
        assert line in out
