"""Shared fixtures: every test isolated from the user's environment, .env, cache directory and
from engines other tests registered; settings with a private L2; the embedded model.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import pytest

# The user's cache directory (~/.cache/kvbridge: L2, the model-hash cache) is never touched: HOME and
# XDG_CACHE_HOME point into a private folder before kvbridge is imported, since Settings' default
# l2_dir is resolved at import. Child processes the tests start inherit it.
_PRIVATE_HOME = Path(tempfile.mkdtemp(prefix="kvb-test-home-"))
os.environ["HOME"] = str(_PRIVATE_HOME)
os.environ["XDG_CACHE_HOME"] = str(_PRIVATE_HOME / ".cache")

from kvbridge.backends import registry as engine_registry  # noqa: E402  (after HOME is private)
from kvbridge.settings import engines as engine_table  # noqa: E402
from kvbridge.settings import EMBEDDED_MODEL_PATH, Settings  # noqa: E402
from kvbridge.settings import core as settings_core  # noqa: E402

needs_model = pytest.mark.skipif(not EMBEDDED_MODEL_PATH.is_file(),
                                 reason=f"embedded model {EMBEDDED_MODEL_PATH} missing: run ./scripts/setup.sh")


def needs_llama_server_and_model() -> list:
    """Marks for live tests against the llama-server scripts/build_llama_server.sh builds, on the embedded model."""
    from kvbridge.backends.llama_server.process import built_binary, pinned_llama_cpp_version

    binary = built_binary(pinned_llama_cpp_version())
    return [pytest.mark.live,
            pytest.mark.skipif(not binary.is_file(), reason=f"llama-server is not built ({binary}): "
                                                            "run ./scripts/build_llama_server.sh"),
            needs_model]

# a short slice of the built-in handbook keeps prefills fast on 2 cores
SHORT_DOC_CHARS = 1200


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """Every test: no KVB_ variable from the developer's shell, no project .env, and the engine
    registry as it was (a fake engine a test registers is gone after it). Live tests that look for a
    developer's own server (Ollama) read the settings at collection time, before this runs."""
    for name in [n for n in os.environ if n.startswith("KVB_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(settings_core, "DEFAULT_ENV_FILE", tmp_path / "no-project.env")
    engine_registry.engine_specs()   # the built-in adapters register now, so they are part of the snapshot
    engines = dict(engine_table._ENGINES)
    yield
    engine_table._ENGINES.clear()
    engine_table._ENGINES.update(engines)


@pytest.fixture
def make_settings(tmp_path):
    """Settings with defaults only (no .env, no environment), a private L2 and small chunks; the scheduler's
    exact mode off (its own default is on): a test of exact mode, or of a default, asks for it."""

    def make(**changes) -> Settings:
        base = dict(chunk_size=32, ctx_size=2048, n_predict=12, l2_dir=str(tmp_path / "l2"), sched_exact=False,
                    output_dir=str(tmp_path / "output"), input_dir=str(tmp_path / "input"))
        base.update(changes)
        return dataclasses.replace(Settings(), **base)

    return make


@pytest.fixture(scope="session")
def short_doc() -> str:
    from kvbridge.bench.common.scenarios import builtin_document

    return builtin_document()[:SHORT_DOC_CHARS]


@pytest.fixture(scope="module")
def make_module_settings(tmp_path_factory):
    """make_settings for an engine a whole test module shares (one model load, not one a test): the same
    defaults, a private L2 under the module's own temporary folder. Tests that share the engine empty its
    store between them where they need a fresh one (store.clear per tier is far cheaper than a new engine)."""
    root = tmp_path_factory.mktemp("module")

    def make(**changes) -> Settings:
        base = dict(chunk_size=32, ctx_size=2048, n_predict=12, l2_dir=str(root / "l2"), sched_exact=False,
                    output_dir=str(root / "output"), input_dir=str(root / "input"))
        base.update(changes)
        return dataclasses.replace(Settings(), **base)

    return make


@pytest.fixture
def generated_tokens(monkeypatch) -> dict[int, list[int]]:
    """Every token the scheduler streams, by request id, as it streams it (a spy on Streamer.on_token, undone after
    the test). Ids start again with each Scheduler: clear the dict between two runs in one test."""
    from kvbridge.scheduler.streaming import Streamer

    generated: dict[int, list[int]] = {}
    on_token = Streamer.on_token

    def spying_on_token(self, request, token):
        generated.setdefault(request.id, []).append(token)
        on_token(self, request, token)

    monkeypatch.setattr(Streamer, "on_token", spying_on_token)
    return generated


def as_fresh(engine) -> None:
    """A shared engine put back to what a new one would hold: every tier of its store emptied (queued L2
    writes first), its counters at zero and no restored state still held hot in the assembly buffer."""
    engine.store.flush()
    for tier in engine.store.tier_names:
        engine.store.clear(tier)
    engine.metrics.reset()
    if engine._kv is not None:
        engine._kv._buffer.forget()
        engine._kv.hot_hits = 0
