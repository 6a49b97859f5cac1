"""The correctness oracle on the real embedded model: greedy output after a restore equals cold output.

Every restore test first fills the context with an unrelated prompt, so a restore that silently
did nothing (and left stale KV) could not pass.
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
from kvbridge.config import PROJECT_ROOT
from kvbridge.engine import CachedEngine
from kvbridge.errors import EngineUnavailable

pytestmark = [needs_model, pytest.mark.live]

UNRELATED = [{"role": "user", "content": "Write a haiku about autumn leaves falling on a quiet pond at dusk."}]
N_PREDICT = 12


def doc_prompt(doc: str, question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": f"Document:\n{doc}\n\nQuestion: {question}"}]


def engine_for(settings) -> CachedEngine:
    return CachedEngine(settings, make_backend("llamacpp", settings)).start()


def cold_then_restore(engine, prompt):
    """(cold record, lmcache record) for one prompt, the context first filled with something else."""
    engine.infer(UNRELATED, mode="native", n_predict=4)
    cold = engine.infer(prompt, mode="cold", n_predict=N_PREDICT)
    engine.infer(UNRELATED, mode="native", n_predict=4)
    warm = engine.infer(prompt, mode="lmcache", n_predict=N_PREDICT)
    return cold, warm


def test_restore_from_l1_and_l2_equals_cold(make_settings, short_doc):
    with engine_for(make_settings()) as engine:
        prompt = doc_prompt(short_doc, "Who leads the operations team?")
        first = engine.infer(prompt, mode="lmcache", n_predict=N_PREDICT)   # miss: stores chunks and tail
        assert first.error == "" and first.matched_tokens == 0 and first.stored_objects > 0
        cold, warm = cold_then_restore(engine, prompt)
        assert warm.tier == "L1" and warm.restore_ok is True
        assert warm.matched_tokens == warm.prompt_tokens - 1       # token-granular: all but the last token
        assert warm.prefill_tokens == 1
        assert warm.text == cold.text and cold.text.strip()

        engine.store.clear("L1")
        engine.infer(UNRELATED, mode="native", n_predict=4)
        from_l2 = engine.infer(prompt, mode="lmcache", n_predict=N_PREDICT)
        assert from_l2.tier == "L2" and from_l2.matched_tokens == warm.matched_tokens
        assert from_l2.text == cold.text


def test_restore_in_a_fresh_process_from_l2(make_settings, short_doc):
    settings = make_settings()
    prompt = doc_prompt(short_doc, "How many households does the cooperative supply?")
    with engine_for(settings) as engine:
        engine.infer(prompt, mode="lmcache", n_predict=N_PREDICT)
        engine.infer(UNRELATED, mode="native", n_predict=4)
        cold = engine.infer(prompt, mode="cold", n_predict=N_PREDICT)
    script = textwrap.dedent(f"""
        import dataclasses, json
        from kvbridge.config import Settings
        from kvbridge.backends import make_backend
        from kvbridge.engine import CachedEngine
        s = dataclasses.replace(Settings(), chunk_size=32, ctx_size=2048, l2_dir={settings.l2_dir!r})
        with CachedEngine(s, make_backend("llamacpp", s)) as e:
            e.infer({UNRELATED!r}, mode="native", n_predict=4)
            r = e.infer({prompt!r}, mode="lmcache", n_predict={N_PREDICT})
            print(json.dumps(r.to_dict()))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record["tier"] == "L2" and record["matched_tokens"] == record["prompt_tokens"] - 1
    assert record["text"] == cold.text


def test_partial_share_restores_only_the_common_prefix(make_settings, short_doc):
    with engine_for(make_settings()) as engine:
        engine.infer(doc_prompt(short_doc, "Who founded the cooperative?"), mode="lmcache", n_predict=N_PREDICT)
        other = doc_prompt(short_doc, "When is the annual meeting held and where?")
        cold, warm = cold_then_restore(engine, other)
        assert 0 < warm.matched_tokens < warm.prompt_tokens - 1
        # the tail makes reuse token-granular: more than the last full chunk boundary
        assert warm.matched_tokens > warm.chunks_hit * 32
        assert warm.text == cold.text


def test_prompts_sharing_only_the_system_prompt(make_settings, short_doc):
    system = {"role": "system", "content": "You are a careful assistant. " + short_doc[:600]}
    with engine_for(make_settings()) as engine:
        engine.infer([system, {"role": "user", "content": "Summarise section one."}], mode="lmcache", n_predict=N_PREDICT)
        other = [system, {"role": "user", "content": "List every number you see, please."}]
        cold, warm = cold_then_restore(engine, other)
        assert warm.matched_tokens > 0 and warm.text == cold.text


def test_shared_prefix_is_stored_once(make_settings, short_doc):
    """Two documents behind one long shared system prompt: shared chunks stored once."""
    settings = make_settings(l2_enabled=False)
    system = {"role": "system", "content": short_doc}
    with engine_for(settings) as engine:
        a = engine.infer([system, {"role": "user", "content": "Document A: the moon orbits the earth."}], mode="lmcache", n_predict=2)
        chunk_objects_after_a = engine.store.stats()["tiers"]["L1"]["objects"]
        b = engine.infer([system, {"role": "user", "content": "Document B: bees make honey from nectar."}], mode="lmcache", n_predict=2)
        assert b.chunks_hit >= a.prompt_tokens // 32 - 1
        # only the chunks after the shared part are new (plus tails), not a second copy of the system prompt
        new_objects = engine.store.stats()["tiers"]["L1"]["objects"] - chunk_objects_after_a
        assert new_objects <= (b.prompt_tokens - b.chunks_hit * 32) // 32 + 2
        per_token = engine.geometry.bytes_per_cell
        stored = engine.store.stats()["tiers"]["L1"]["bytes"]
        unique_chunk_tokens = (a.prompt_tokens // 32) * 32 + (b.prompt_tokens // 32 - b.chunks_hit) * 32
        tails = 2 * 2 * 64 * per_token   # at most two tails per prompt, each under two chunks long
        assert unique_chunk_tokens * per_token <= stored <= unique_chunk_tokens * per_token * 1.05 + tails


def test_corrupt_l2_object_is_a_counted_miss_not_wrong_output(make_settings, short_doc):
    settings = make_settings()
    prompt = doc_prompt(short_doc, "What is the pH of the spring water?")
    with engine_for(settings) as engine:
        engine.infer(prompt, mode="lmcache", n_predict=N_PREDICT)
        cold = engine.infer(prompt, mode="cold", n_predict=N_PREDICT)
        engine.store.clear("L1")
        files = sorted(p for p in __import__("pathlib").Path(settings.l2_dir).rglob("*") if p.is_file())
        assert files
        for path in files:   # flip one payload byte in every stored object
            data = bytearray(path.read_bytes())
            data[-10] ^= 0xFF
            path.write_bytes(bytes(data))
        warm = engine.infer(prompt, mode="lmcache", n_predict=N_PREDICT)
        assert warm.matched_tokens == 0 and warm.text == cold.text
        assert engine.store.stats()["corrupt"] >= 1


def test_foreign_namespace_is_never_restored(make_settings, short_doc):
    prompt = doc_prompt(short_doc, "Who is the general manager?")
    with engine_for(make_settings(chunk_size=32)) as engine:
        engine.infer(prompt, mode="lmcache", n_predict=4)
        ns32 = engine.namespace
    with engine_for(make_settings(chunk_size=48)) as engine:   # another chunk size -> another namespace
        assert engine.namespace != ns32
        warm = engine.infer(prompt, mode="lmcache", n_predict=4)
        assert warm.matched_tokens == 0


def test_native_mode_reuses_the_engines_own_cache(make_settings, short_doc):
    with engine_for(make_settings()) as engine:
        engine.infer(doc_prompt(short_doc, "Question one?"), mode="native", n_predict=4)
        second = engine.infer(doc_prompt(short_doc, "Question two?"), mode="native", n_predict=4)
        assert second.engine_cached_tokens > 0 and second.prefill_tokens < second.prompt_tokens
        cold = engine.infer(doc_prompt(short_doc, "Question two?"), mode="cold", n_predict=4)
        assert cold.prefill_tokens == cold.prompt_tokens and cold.matched_tokens == 0


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


def test_prompt_too_long_for_context_is_a_record_error(make_settings, short_doc):
    with engine_for(make_settings(ctx_size=256)) as engine:
        record = engine.infer(doc_prompt(short_doc, "Too long?"), mode="cold", n_predict=4)
        assert "KVB_CTX_SIZE" in record.error
