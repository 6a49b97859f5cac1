"""`python -m kvbridge bench-serve` end to end at a tiny size: the shape of its report, no timing thresholds.

The real `serve` process and the real llama-server (built by scripts/build_llama_server.sh) on the
embedded model, one after the other, asked through the openai SDK as a user runs it. What is
checked is what a user reads off the report: every request answered on both sides, positive TTFTs,
both servers reporting cached_tokens when warm, ours restoring from L2 after its restart, every
stop clean and no llama-server left running.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from conftest import needs_model
from kvbridge.__main__ import main
from kvbridge.settings import WORK_DIR
from test_llama_server import BINARY as LLAMA_SERVER
from test_llama_server import BUILDABLE, our_llama_servers

pytest.importorskip("openai", reason="the openai SDK is not installed (requirements.txt)")
pytestmark = [needs_model, pytest.mark.timeout(180)]

needs_llama_server = pytest.mark.skipif(
    not LLAMA_SERVER.is_file() and not BUILDABLE,
    reason=f"llama-server is not built ({LLAMA_SERVER}) and cmake/g++ are missing to build it")

# ~15 s on 2 idle cores: a ~400-token prompt, two starts of each server
TINY = ["--questions", "2", "--repeats", "1", "--max-tokens", "4", "--document-chars", "1500"]


@pytest.fixture(scope="module")
def llama_server_binary():
    """The built llama-server (test.sh builds it first; this covers a plain `pytest`); none may outlive the tests."""
    if not LLAMA_SERVER.is_file():
        subprocess.run([str(WORK_DIR / "scripts" / "build_llama_server.sh")], check=True)
    yield LLAMA_SERVER
    assert our_llama_servers() == [], "a llama-server child outlived its tests"


def test_bad_sizes_are_refused_before_anything_runs():
    with pytest.raises(SystemExit, match="--questions must be at least 1, got 0"):
        main(["bench-serve", "--questions", "0"])


def test_a_missing_llama_server_is_said_before_our_serve_starts(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KVB_LLAMA_SERVER_BIN", str(tmp_path / "no-llama-server"))
    monkeypatch.setenv("KVB_OUTPUT_DIR", str(tmp_path / "output"))
    assert main(["bench-serve", *TINY]) == 2
    captured = capsys.readouterr()
    assert "no-llama-server does not exist" in captured.err and "build_llama_server.sh" in captured.err
    assert "ours: warm-up" not in captured.err and not (tmp_path / "output").exists()


@needs_llama_server
@pytest.mark.live
@pytest.mark.slow
def test_one_run_times_both_servers_warm_and_after_a_restart(llama_server_binary, capsys, monkeypatch, tmp_path):
    # one thread each: on a shared 2-core machine two spinning threads slow llama.cpp down tenfold
    monkeypatch.setenv("KVB_THREADS", "1")
    monkeypatch.setenv("KVB_CHUNK_SIZE", "32")
    monkeypatch.setenv("KVB_OUTPUT_DIR", str(tmp_path / "output"))
    assert main(["bench-serve", *TINY]) == 0
    out = capsys.readouterr().out
    [written] = (tmp_path / "output").glob("kvbridge-bench-serve-*.json")
    result = json.loads(written.read_text())
    assert (result["questions"], result["repeats"], result["max_tokens"]) == (2, 1, 4)
    assert result["setup"]["threads"] == 1 and result["setup"]["document_chars"] <= 1500
    assert "-t" in result["setup"]["llama_server_args"] and result["setup"]["llama_server_slots"] >= 1

    for name in ("ours", "llama-server"):
        run = result["runs"][name]
        answers = [run["warmup"], *run["warm"], *run["restarts"]]
        assert len(answers) == 4 and [a["error"] for a in answers] == [""] * 4
        assert all(a["ttft_ms"] > 0 and a["total_ms"] >= a["ttft_ms"] and a["completion_tokens"] > 0
                   for a in answers)
        figures = result["figures"][name]
        assert figures["completed"] == figures["requests"] == 4
        assert 0 < figures["warm_median_ttft_ms"] and 0 < figures["warm_mean_ttft_ms"]
        assert 0 < figures["restart_median_ttft_ms"]
        # both report cached_tokens: the document is reused when warm
        assert all(c > 0 for c in figures["warm_cached_tokens"]), (name, figures["warm_cached_tokens"])
        assert len(run["start_s"]) == len(run["exit_codes"]) == 2
    assert result["runs"]["ours"]["exit_codes"] == [0, 0]

    [restart] = result["runs"]["ours"]["restarts"]
    assert restart["tier"] == "L2" and restart["cached_tokens"] > 0   # restored from L2, the new process's L1 empty
    assert result["ratios"]["warm_mean_ttft_ours_vs_theirs"] > 0 and result["ratios"]["restart_speedup"] > 0
    assert isinstance(result["answers"]["ours"]["warm"], bool)

    for line in ("KVBridge serve against llama-server's own endpoint", "warm: mean TTFT ms", "ours / llama-server",
                 "after a restart: TTFT ms (median)", "llama-server / ours", "greedy answer to question 1, ours",
                 "L2 in a private temp dir", f"wrote {written}"):
        assert line in out
    assert "error," not in out
