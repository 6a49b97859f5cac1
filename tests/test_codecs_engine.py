"""Tier codecs with the real model: lossless codecs are invisible, a lossy one is part of the namespace
and says so in the record (issue 11, §3).
"""
from __future__ import annotations

import pytest

from conftest import needs_model
from kvbridge.backends import make_backend
from kvbridge.engine.cached_engine import CachedEngine

pytestmark = [needs_model, pytest.mark.timeout(300)]


def prompt(doc: str, question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer from the document, briefly."},
            {"role": "user", "content": f"Document:\n{doc}\n\nQuestion: {question}"}]


def engine_for(settings):
    return CachedEngine(settings, make_backend("llamacpp", settings))


def restored_from_l2(engine, doc: str) -> tuple[dict, dict]:
    """Store the document's KV, drop L1 (as a restart would), then answer another question cold and warm."""
    engine.infer(prompt(doc, "Who leads the operations team?"), mode="lmcache")
    engine.store.flush()
    engine.restart_backend(drop_l1=True)
    question = prompt(doc, "What is the first section about?")
    cold = engine.infer(question, mode="cold")
    engine.store.clear("L1")
    warm = engine.infer(question, mode="lmcache")
    return cold.to_dict(), warm.to_dict()


def test_zstd_in_l2_restores_exactly_and_stores_fewer_bytes(make_settings, short_doc):
    with engine_for(make_settings(l2_serde="zstd")) as engine:
        cold, warm = restored_from_l2(engine, short_doc)
        stats = engine.store.stats()
    assert warm["tier"] == "L2" and warm["matched_tokens"] > 0
    assert warm["text"] == cold["text"] and "lossy" not in warm["notes"]
    assert stats["tiers"]["L2"]["codec"] == "zstd"


def test_int8_in_l2_is_its_own_namespace_and_the_record_says_lossy(make_settings, short_doc):
    settings = make_settings(l2_serde="int8")
    with engine_for(settings) as engine:
        cold, warm = restored_from_l2(engine, short_doc)
        lossy_namespace = engine.namespace
        assert engine.store.stats()["tiers"]["L2"]["codec"] == "int8 (lossy)"
    assert warm["tier"] == "L2" and warm["matched_tokens"] > 0 and warm["restore_ok"] is True
    assert "restored from lossy int8 KV" in warm["notes"]
    assert not warm["error"] and warm["gen_tokens"] > 0
    # a reader set to raw computes another namespace, so it never restores the int8 objects
    with engine_for(settings.replace(l2_serde="raw")) as raw_engine:
        assert raw_engine.namespace != lossy_namespace
        record = raw_engine.infer(prompt(short_doc, "What is the first section about?"), mode="lmcache")
    assert record.tier == "none" and record.matched_tokens == 0
