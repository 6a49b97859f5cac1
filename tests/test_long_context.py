"""Long-context bench: the context it raises, the table from one run's records, the curve, the oracle, the CLI.

Speed is never asserted here (benchmarks measure it); these check the plumbing and the answers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import needs_model
from kvbridge.backends import make_backend
from kvbridge.bench.long_context import (DEFAULT_LENGTHS, QUESTIONS, LengthRow, LongContextRecord, build_prompts,
                                         length_rows, long_context_document, parse_lengths, settings_for)
from kvbridge.bench.common.runner import run_scenario
from kvbridge.bench.common.scenarios import build_requests, get_scenario
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.engine.records import RequestRecord
from kvbridge.errors import BadSettings
from kvbridge.gui import charts
from kvbridge.gui.export import export_run
from kvbridge.settings import WORK_DIR, Settings

SERIES = [name for name, *_ in charts.CURVE_SERIES]


def test_the_context_is_raised_to_what_the_run_needs_and_never_lowered():
    assert settings_for(Settings(ctx_size=4096), None, n_predict=32).ctx_size == 8192   # 8k: capped at SmolLM2's 8,192
    assert settings_for(Settings(ctx_size=128), (64, 128), n_predict=8).ctx_size == 256  # llama.cpp's 256 granularity
    assert settings_for(Settings(ctx_size=4096), (512, 1024), n_predict=32).ctx_size == 4096
    settings = Settings(ctx_size=2048, chunk_size=64)
    assert settings_for(settings, (4096,), n_predict=16).chunk_size == 64   # the user's other settings stay


def test_lengths_parse_and_bad_ones_are_clear():
    assert parse_lengths(None) == DEFAULT_LENGTHS == (512, 1024, 2048, 4096, 8192)
    assert parse_lengths("1024, 512,512") == (512, 1024)
    with pytest.raises(BadSettings, match="whole numbers"):
        parse_lengths("512,1k")
    with pytest.raises(BadSettings, match="at least 48"):
        parse_lengths("16,512")


def test_the_scenario_is_registered_as_a_measurement():
    scenario = get_scenario("long-context")
    assert scenario.run is not None and scenario.default_requests == 3
    with pytest.raises(BadSettings, match="own runner"):
        build_requests("long-context")


def test_the_document_is_long_enough_for_8k_prompts():
    # ~4.4 characters per token in this kind of English prose: ~9k tokens
    assert len(long_context_document()) > 4.2 * 8192
    assert all(8 <= len(q.split()) <= 16 for q in QUESTIONS)


def _rec(target, phase, mode, ttft, question=1, **extra) -> LongContextRecord:
    return LongContextRecord(mode=mode, target_tokens=target, phase=phase, question=question, ttft_ms=ttft,
                             prompt_tokens=target - 2, **extra)


def test_rows_are_computed_from_the_same_run():
    records = [
        _rec(512, "fill", "lmcache", 900.0, question=0),
        _rec(512, "warm", "native", 40.0, engine_cached_tokens=490),
        _rec(512, "warm", "lmcache", 50.0, matched_tokens=490, lookup_ms=1.0, restore_ms=4.0,
             restored_bytes=11_000_000, plain_copy_ms=2.0, text="same"),
        _rec(512, "warm", "native", 60.0, question=2, engine_cached_tokens=490),
        _rec(512, "warm", "lmcache", 70.0, question=2, matched_tokens=490, lookup_ms=1.0, restore_ms=6.0,
             restored_bytes=11_000_000, plain_copy_ms=3.0),
        _rec(512, "cold", "cold", 1000.0, text="same"),
        _rec(1024, "warm", "lmcache", 80.0, error="engine gone"),   # failed requests are left out
    ]
    rows = length_rows(records)
    assert [r.target_tokens for r in rows] == [512]
    row = rows[0]
    assert (row.cold_ttft_ms, row.native_warm_ttft_ms, row.lmcache_warm_ttft_ms) == (1000.0, 50.0, 60.0)
    assert row.lmcache_vs_native == pytest.approx(60 / 50)
    assert row.lmcache_speedup == pytest.approx(1000 / 60) and row.native_speedup == pytest.approx(20.0)
    assert (row.restore_ms, row.plain_copy_ms, row.restore_vs_copy) == (6.0, 2.5, pytest.approx(2.4))
    assert (row.lmcache_hits, row.warm_requests, row.restored_bytes) == (2, 2, 11_000_000)
    assert row.lmcache_matches_cold is True
    assert set(row.to_dict()) >= {"cold_ttft_ms", "lmcache_vs_native", "restore_vs_copy", "restored_bytes"}


def test_the_curve_has_every_series_on_log_axes():
    row = LengthRow(target_tokens=512, prompt_tokens=510, cold_ttft_ms=1000.0, native_warm_ttft_ms=50.0,
                    lmcache_warm_ttft_ms=60.0, warm_requests=2, lmcache_hits=2, restored_tokens=490,
                    restored_bytes=11_000_000, restore_ms=6.0, plain_copy_ms=2.5, lmcache_matches_cold=True)
    fig = charts.long_context_figure([row])
    assert [t.name for t in fig.data] == SERIES
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    assert "long-context" in charts.long_context_figure([]).layout.annotations[0].text


@needs_model
@pytest.mark.live
def test_a_small_run_measures_every_length_and_restores_the_cold_answer(make_settings, tmp_path):
    settings = make_settings(chunk_size=32, ctx_size=256, n_predict=6)
    with CachedEngine(settings, make_backend("llamacpp", settings)) as engine:
        prompts = build_prompts(engine, (64, 128), 2, n_predict=6)
        lengths = {t: len(engine.prepare(p[1]).tokens) for t, p in prompts.items()}
        records = list(run_scenario(engine, "long-context", ["cold", "native", "lmcache"], n_requests=1,
                                    lengths=(64, 128), n_predict=6))
    assert all(abs(lengths[t] - t) <= 3 for t in lengths), lengths
    assert [(r.target_tokens, r.phase, r.mode) for r in records] == [
        (t, phase, mode) for t in (64, 128)
        for phase, mode in (("fill", "lmcache"), ("warm", "native"), ("warm", "lmcache"), ("cold", "cold"))]
    assert not any(r.error for r in records)
    rows = length_rows(records)
    assert [r.target_tokens for r in rows] == [64, 128]
    for row in rows:
        values = row.to_dict()
        assert None not in values.values(), values          # every field of the report, from this run
        assert row.lmcache_matches_cold is True             # the oracle: restored == cold, token for token
        warm = [r for r in records if r.target_tokens == row.target_tokens and r.phase == "warm"]
        cold = next(r for r in records if r.target_tokens == row.target_tokens and r.phase == "cold")
        lm = next(r for r in warm if r.mode == "lmcache")
        assert lm.matched_tokens > 0 and lm.prefill_tokens < 30   # only the question is prefilled
        assert row.lmcache_speedup == pytest.approx(cold.ttft_ms / lm.ttft_ms)
        assert row.restore_vs_copy == pytest.approx((lm.lookup_ms + lm.fetch_ms + lm.restore_ms) / lm.plain_copy_ms)
    figures = charts.run_figures(records)
    assert list(figures)[0] == "long_context"
    assert [t.name for t in figures["long_context"].data] == SERIES
    paths = export_run(records, tmp_path, figures=figures, meta={"scenario": "long-context"})
    doc = json.loads(paths["json"].read_text())
    assert [row["target_tokens"] for row in doc["long_context"]] == [64, 128]
    assert doc["records"][0]["phase"] == "fill"
    assert "target_tokens" in paths["csv"].read_text().splitlines()[0]
    assert 'id="chart-long_context"' in paths["html"].read_text() and "Per prompt length" in paths["html"].read_text()


@needs_model
@pytest.mark.live
@pytest.mark.slow
def test_cli_runs_long_context_without_settings(tmp_path):
    env = {**os.environ, "KVB_OUTPUT_DIR": str(tmp_path), "KVB_L2_DIR": str(tmp_path / "l2"), "KVB_CTX_SIZE": "128"}
    out = subprocess.run([sys.executable, "-m", "kvbridge", "bench", "--scenario", "long-context", "--lengths",
                          "64,128", "--repeats", "1", "--chunk-size", "32", "--n-predict", "4"],
                         cwd=WORK_DIR, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "context raised from 128 to 256 tokens" in out.stdout
    assert "long context: per prompt length" in out.stdout and "lmcache == cold" in out.stdout
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert doc["meta"]["ctx_size"] == 256 and len(doc["long_context"]) == 2
    assert sorted(p.suffix for p in tmp_path.iterdir() if p.is_file()) == [".csv", ".html", ".json"]


def test_the_gui_results_show_the_curve_for_a_long_context_run(tmp_path):
    from kvbridge.gui.handlers import AppState
    from kvbridge.gui.results import results_view

    state = AppState(Settings(output_dir=str(tmp_path)), env_path=tmp_path / ".env")
    state.records = [_rec(512, "warm", "native", 40.0, engine_cached_tokens=490), _rec(512, "cold", "cold", 900.0)]
    view = results_view(state)
    assert view.figures["ttft_per_request"] is view.figures["long_context"]   # the plot the page shows
    state.records = [RequestRecord(mode="cold", ttft_ms=900.0)]
    assert "long_context" not in results_view(state).figures
