"""A llama.cpp build that crashes on this CPU must not take the GUI, a script or the CLI down with it.

This machine's CPU runs every instruction it claims, so the crash is made on purpose: the smoke
decode's test hook (KVB_SMOKE_CRASH_VARIANTS, see kvbridge/backends/smoke_decode.py) kills the child
process with a real SIGILL, as an AMX instruction refused by a hypervisor would.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import needs_model
from kvbridge.backends import make_backend
from kvbridge.backends import build_check
from kvbridge.backends.build_check import installed_variant
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.errors import EngineUnavailable
from kvbridge.gui import handlers
from kvbridge.settings import WORK_DIR

pytestmark = [needs_model, pytest.mark.live]


@pytest.fixture
def crashing_build(monkeypatch):
    monkeypatch.setenv("KVB_SMOKE_CRASH_VARIANTS", installed_variant())


def test_engine_start_reports_the_crash_instead_of_dying(make_settings, crashing_build):
    settings = make_settings()
    engine = CachedEngine(settings, make_backend("llamacpp", settings))
    with pytest.raises(EngineUnavailable) as info:
        engine.start()
    message = str(info.value)
    assert "SIGILL" in message and "./scripts/setup.sh" in message and "KVB_LLAMA_CMAKE_ARGS" in message
    assert engine.backend.llm is None    # llama.cpp was never loaded into this process
    engine.close()


def test_gui_connect_shows_the_crash_and_keeps_serving(make_settings, crashing_build):
    state = handlers.AppState(settings=make_settings())
    outcome = handlers.connect_engine(state, "llamacpp", {})
    assert not outcome.ok and "SIGILL" in outcome.message and "./scripts/setup.sh" in outcome.message
    assert state.engine is None


def test_cli_says_what_failed_and_what_to_run(tmp_path):
    env = {**os.environ, "KVB_SMOKE_CRASH_VARIANTS": installed_variant(), "KVB_L2_DIR": str(tmp_path / "l2")}
    run = subprocess.run([sys.executable, "-m", "kvbridge", "demo"], cwd=WORK_DIR, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode > 0, "the CLI died by a signal instead of reporting the crash"
    assert "SIGILL" in run.stderr + run.stdout and "./scripts/setup.sh" in run.stderr + run.stdout


def test_a_build_that_runs_is_checked_once(make_settings, tmp_path, monkeypatch):
    monkeypatch.setattr(build_check, "CHECKED_DIR", tmp_path / "checked")
    children = []
    real_run = build_check.subprocess.run

    def counting_run(argv, **kwargs):
        children.append(argv)
        return real_run(argv, **kwargs)

    monkeypatch.setattr(build_check.subprocess, "run", counting_run)
    settings = make_settings()
    for _ in range(2):
        with CachedEngine(settings, make_backend("llamacpp", settings)) as engine:
            assert engine.started
    assert len(children) == 1 and "smoke_decode.py" in children[0][1]
    assert len(list((tmp_path / "checked").iterdir())) == 1
