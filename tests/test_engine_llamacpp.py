"""In-process llama.cpp specifics: a fresh process restores from L2, clear errors for bad model files.

The engine contract shared with llama-server is in tests/test_engine_contract.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import needs_model
from kvbridge.backends import make_backend
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.errors import EngineUnavailable
from kvbridge.settings import WORK_DIR

from test_engine_contract import N_PREDICT, UNRELATED, doc_prompt

pytestmark = [needs_model, pytest.mark.live]


def engine_for(settings) -> CachedEngine:
    return CachedEngine(settings, make_backend("llamacpp", settings)).start()


def test_restore_in_a_fresh_process_from_l2(make_settings, short_doc):
    settings = make_settings()
    prompt = doc_prompt(short_doc, "How many households does the cooperative supply?")
    with engine_for(settings) as engine:
        engine.infer(prompt, mode="lmcache", n_predict=N_PREDICT)
        engine.infer(UNRELATED, mode="native", n_predict=4)
        cold = engine.infer(prompt, mode="cold", n_predict=N_PREDICT)
        rule = engine.cut_rule
    script = textwrap.dedent(f"""
        import dataclasses, json
        from kvbridge.settings import Settings
        from kvbridge.backends import make_backend
        from kvbridge.engine.cached_engine import CachedEngine
        s = dataclasses.replace(Settings(), chunk_size=32, ctx_size=2048, l2_dir={settings.l2_dir!r})
        with CachedEngine(s, make_backend("llamacpp", s)) as e:
            e.infer({UNRELATED!r}, mode="native", n_predict=4)
            r = e.infer({prompt!r}, mode="lmcache", n_predict={N_PREDICT})
            print(json.dumps(r.to_dict()))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=WORK_DIR, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(WORK_DIR)})
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record["tier"] == "L2" and record["matched_tokens"] == rule.restorable(record["prompt_tokens"])
    assert record["text"] == cold.text


def test_missing_model_gives_a_clear_error(make_settings, tmp_path):
    settings = make_settings(model_path=str(tmp_path / "nope.gguf"))
    with pytest.raises(EngineUnavailable) as info:
        CachedEngine(settings, make_backend("llamacpp", settings)).start()
    assert "nope.gguf" in str(info.value) and "KVB_MODEL_PATH" in str(info.value)


def test_not_a_gguf_file_gives_a_clear_error(make_settings, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a model")
    settings = make_settings(model_path=str(bad))
    with pytest.raises(EngineUnavailable, match="not a GGUF"):
        CachedEngine(settings, make_backend("llamacpp", settings)).start()




def test_the_smallest_context_the_settings_allow_starts_and_answers(make_settings):
    """The start-up probe (about 170 tokens) once overflowed a small context with a raw llama_cpp traceback."""
    settings = make_settings(ctx_size=64, chunk_size=16)
    assert settings.validate(environ={}) == []
    with engine_for(settings) as engine:
        record = engine.infer("Say hi.", mode="lmcache", n_predict=4)
        assert record.error == "" and record.prompt_tokens > 0
