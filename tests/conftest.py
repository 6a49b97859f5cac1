"""Shared fixtures: settings isolated from the user's .env and L2, and the embedded model."""
from __future__ import annotations

import dataclasses

import pytest

from kvbridge.config import EMBEDDED_MODEL_PATH, Settings

needs_model = pytest.mark.skipif(not EMBEDDED_MODEL_PATH.is_file(),
                                 reason=f"embedded model {EMBEDDED_MODEL_PATH} missing: run ./scripts/setup.sh")

# a short slice of the built-in handbook keeps prefills fast on 2 cores
SHORT_DOC_CHARS = 1200


@pytest.fixture
def make_settings(tmp_path):
    """Settings with defaults only (no .env, no environment), a private L2 and small chunks."""

    def make(**changes) -> Settings:
        base = dict(chunk_size=32, ctx_size=2048, n_predict=12, l2_dir=str(tmp_path / "l2"),
                    output_dir=str(tmp_path / "output"), input_dir=str(tmp_path / "input"))
        base.update(changes)
        return dataclasses.replace(Settings(), **base)

    return make


@pytest.fixture(scope="session")
def short_doc() -> str:
    from kvbridge.scenarios import builtin_document

    return builtin_document()[:SHORT_DOC_CHARS]
