"""Scenarios, the runner and the CLI, end to end on the embedded model where it matters."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import needs_model
from kvbridge.backends import make_backend
from kvbridge.backends.llamacpp import LlamaCppBackend
from kvbridge.backends.registry import EngineSpec, register_engine
from kvbridge.settings import WORK_DIR
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.errors import BadSettings, StateTransferError
from kvbridge.bench.common.runner import parse_modes, run_scenario
from kvbridge.bench.common.scenarios import build_requests, list_documents, scenario_specs


def test_registry_has_the_four_demo_scenarios():
    keys = [s.key for s in scenario_specs()]
    assert keys[:4] == ["doc-qa", "system-prompt", "multi-turn", "engine-restart"]
    assert len(build_requests("doc-qa")) == 12


def test_multi_turn_history_grows():
    turns = build_requests("multi-turn", 3)
    assert [len(t.messages) for t in turns] == [2, 4, 6]
    assert turns[1].messages[:2] == turns[0].messages


def test_engine_restart_scenario_restarts_in_the_middle():
    actions = [r.action for r in build_requests("engine-restart", 4)]
    assert actions == ["infer", "infer", "restart", "infer", "infer"]


def test_documents_include_files_dropped_in_input(make_settings, tmp_path):
    settings = make_settings()
    os.makedirs(settings.input_dir)
    with open(os.path.join(settings.input_dir, "notes.txt"), "w") as f:
        f.write("My own notes.")
    docs = list_documents(settings)
    assert docs["input/notes.txt"] == "My own notes."
    assert any("built-in" in name for name in docs)
    request = build_requests("doc-qa", 1, document=docs["input/notes.txt"])[0]
    assert "My own notes." in request.messages[-1]["content"]


def test_bad_scenario_inputs_are_clear():
    with pytest.raises(BadSettings, match="known scenarios"):
        build_requests("nope")
    with pytest.raises(BadSettings, match="at least 1"):
        build_requests("doc-qa", 0)
    with pytest.raises(BadSettings, match="cold, native, lmcache"):
        parse_modes("cold,warp")


class FailingRestoreBackend(LlamaCppBackend):
    """The real in-process engine whose restore always fails (as a damaged engine would)."""

    key = "test-failing-restore"

    def restore_state(self, state, tokens):
        raise StateTransferError("simulated restore failure")


@needs_model
@pytest.mark.live
def test_failed_restore_is_counted_and_the_request_recomputes(make_settings, short_doc):
    # registered for this test only: the autouse registry fixture in conftest removes it afterwards
    register_engine(EngineSpec(key="test-failing-restore", label="test only", cls=FailingRestoreBackend, blurb="test"))
    settings = make_settings()
    prompt = [{"role": "user", "content": short_doc + "\n\nQuestion: where is Well One?"}]
    with CachedEngine(settings, make_backend("test-failing-restore", settings)) as engine:
        engine.infer(prompt, mode="lmcache", n_predict=8)
        cold = engine.infer(prompt, mode="cold", n_predict=8)
        warm = engine.infer(prompt, mode="lmcache", n_predict=8)
        assert warm.error == "" and warm.restore_ok is False and "restore failed" in warm.notes
        assert warm.text == cold.text and warm.prefill_tokens == warm.prompt_tokens
        assert engine.metrics.count("restore_failed") == 1


@needs_model
@pytest.mark.live
def test_engine_restart_scenario_restores_from_l2(make_settings, short_doc):
    settings = make_settings()
    with CachedEngine(settings, make_backend("llamacpp", settings)) as engine:
        records = list(run_scenario(engine, "engine-restart", ["lmcache"], n_requests=2, document=short_doc, n_predict=4))
    assert [r.tier for r in records] == ["none", "L2"]
    assert records[1].matched_tokens > 0


def test_cli_help_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "kvbridge", "--help"], cwd=WORK_DIR, capture_output=True, text=True)
    assert out.returncode == 0
    for command in ("gui", "bench", "bench-store", "bench-restore", "namespace", "engines"):
        assert command in out.stdout


@needs_model
@pytest.mark.live
@pytest.mark.slow
def test_cli_bench_writes_csv_json_and_html(tmp_path):
    env = {**os.environ, "KVB_OUTPUT_DIR": str(tmp_path), "KVB_L2_DIR": str(tmp_path / "l2"), "KVB_CTX_SIZE": "2048"}
    out = subprocess.run([sys.executable, "-m", "kvbridge", "bench", "--scenario", "system-prompt", "--requests", "2",
                          "--modes", "cold,lmcache", "--chunk-size", "64", "--n-predict", "4"],
                         cwd=WORK_DIR, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "speedup vs cold" in out.stdout
    written = sorted(p.suffix for p in tmp_path.iterdir() if p.is_file())
    assert written == [".csv", ".html", ".json"]
    data = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert len(data["records"]) == 4
    assert data["records"][3]["matched_tokens"] > 0


@needs_model
@pytest.mark.live
@pytest.mark.slow
def test_cli_bench_interleave_runs_the_modes_in_turn_each_on_its_own_engine(tmp_path):
    env = {**os.environ, "KVB_OUTPUT_DIR": str(tmp_path), "KVB_L2_DIR": str(tmp_path / "l2"), "KVB_CTX_SIZE": "2048"}
    out = subprocess.run([sys.executable, "-m", "kvbridge", "bench", "--scenario", "system-prompt", "--requests", "2",
                          "--modes", "cold,lmcache", "--chunk-size", "64", "--n-predict", "4", "--interleave"],
                         cwd=WORK_DIR, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 engines, the modes taking turns" in out.stdout
    records = json.loads(next(tmp_path.glob("*.json")).read_text())["records"]
    assert [r["mode"] for r in records] == ["cold", "lmcache", "cold", "lmcache"]
    assert records[3]["matched_tokens"] > 0 and records[3]["text"] == records[2]["text"]


def test_cli_bad_engine_is_a_readable_error():
    env = {**os.environ, "KVB_ENGINE": "warp-drive"}
    out = subprocess.run([sys.executable, "-m", "kvbridge", "namespace"], cwd=WORK_DIR, capture_output=True,
                         text=True, env=env)
    assert out.returncode != 0
    assert "warp-drive" in (out.stdout + out.stderr) and "Traceback" not in out.stderr


def test_summary_reports_speedups_and_shadow_agreement():
    from kvbridge.bench.common.report import format_summary, summarize
    from kvbridge.engine.records import RequestRecord

    def rec(mode, i, ttft, matched=0, cached=None, predicted=None):
        return RequestRecord(mode=mode, request_index=i, prompt_tokens=1000, ttft_ms=ttft, matched_tokens=matched,
                             engine_cached_tokens=cached, predicted_reuse_tokens=predicted)

    records = [rec("cold", 1, 4000, cached=3), rec("cold", 2, 4000, cached=3),
               rec("native", 1, 4000, cached=3), rec("native", 2, 40, cached=990),
               rec("lmcache", 1, 4000, matched=0, cached=990, predicted=0),
               rec("lmcache", 2, 50, matched=990, cached=990, predicted=990)]
    summary = summarize(records)
    assert summary["native"]["warm_requests"] == 1          # 3 template tokens are not a hit
    assert summary["lmcache"]["median_warm_speedup_vs_cold"] == 80
    assert summary["lmcache"]["warm_vs_native"] == 50 / 40
    assert summary["lmcache"]["prediction_agreement"]["agreeing"] == 1
    assert "agrees with the engine's cached-token count on 1/2" in format_summary(summary)
