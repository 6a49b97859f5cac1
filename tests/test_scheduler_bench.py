"""`python -m kvbridge bench-scheduler` end to end with tiny sizes: the shape of its report, no timing thresholds."""
from __future__ import annotations

import pytest

from conftest import needs_model
from kvbridge.__main__ import main
from kvbridge.bench.scheduler_bench import bench_swap_vs_recompute

pytestmark = [needs_model, pytest.mark.timeout(180)]


def test_swap_and_recompute_are_both_timed_and_the_whole_sequence_comes_back(make_settings):
    result = bench_swap_vs_recompute(make_settings(), prompt_tokens=96, repeats=1)
    assert result["tokens"] == 96 and result["bytes"] > 96 * 1000
    assert result["swap_out_ms"] > 0 and result["swap_in_ms"] > 0 and result["recompute_ms"] > 0
    assert result["recompute_vs_swap"] == pytest.approx(result["recompute_ms"] / result["swap_ms"])


def test_the_command_prints_the_ratio(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KVB_CHUNK_SIZE", "32")
    monkeypatch.setenv("KVB_L2_DIR", str(tmp_path / "l2"))
    assert main(["bench-scheduler", "--tokens", "64", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "recompute / swap:" in out and "64-token sequence" in out
