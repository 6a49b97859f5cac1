"""Exact mode and CachedEngine share one namespace (issue 47) because they store the same bytes.

A cold CachedEngine run (in-process llama.cpp, lmcache mode) and an exact scheduler each store the same chat
into an L2 of their own: every object both hold under one key is byte for byte the same (KV computed as a
cold run computes it: pieces of BATCH_TOKENS from position 0, a fresh sequence's cells). Then each restores
from the other's L2, and the answer equals its own cold one. The scheduler with the mode off keeps a namespace
of its own (KV computed beside other sequences in a unified cache is not a cold run's): nothing it stores is
found by the other two.
"""
from __future__ import annotations

from pathlib import Path

from conftest import needs_model
from kvbridge.scheduler import Scheduler
from kvbridge.store import open_store

pytestmark = [needs_model]


def chat(doc: str, question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": f"Document:\n{doc}\n\nQuestion: {question}"}]


def stored_keys(l2_dir: Path) -> set[str]:
    return {path.stem for path in l2_dir.rglob("*.kvb")}


def blobs(settings, l2_dir: Path, keys: set[str]) -> dict[str, bytes]:
    store = open_store(settings.replace(l2_dir=str(l2_dir)))
    try:
        found = {key: store.get(bytes.fromhex(key)) for key in keys}
        return {key: bytes(obj.blob) for key, obj in found.items() if obj is not None}
    finally:
        store.close()


def test_exact_mode_stores_what_cachedengine_stores_and_each_restores_the_others(make_settings, short_doc, tmp_path):
    from kvbridge import CachedEngine, make_backend

    settings = make_settings(sched_exact=True, sched_kv_cells=1024, sched_max_running=2, sched_cached_prefixes=0,
                             ctx_size=1024, n_predict=12)
    engine_l2, exact_l2, off_l2 = tmp_path / "engine-l2", tmp_path / "exact-l2", tmp_path / "off-l2"
    messages = chat(short_doc, "Who leads the operations team?")

    def engine_on(l2_dir: Path):
        return CachedEngine(settings.replace(l2_dir=str(l2_dir)), make_backend("llamacpp", settings))

    with engine_on(engine_l2) as engine:
        cold = engine.infer(messages, mode="lmcache")
    assert not cold.error and cold.matched_tokens == 0
    with Scheduler(settings.replace(l2_dir=str(exact_l2))) as scheduler:
        ours = scheduler.submit(messages).result(timeout=600)
        assert scheduler.drain(120)
    with Scheduler(settings.replace(l2_dir=str(off_l2), sched_exact=False)) as scheduler:
        scheduler.submit(messages).result(timeout=600)
        assert scheduler.drain(120)

    whole_chunks = cold.prompt_tokens // settings.chunk_size
    common = stored_keys(engine_l2) & stored_keys(exact_l2)
    assert len(common) >= whole_chunks, (len(common), whole_chunks)
    engine_blobs, exact_blobs = blobs(settings, engine_l2, common), blobs(settings, exact_l2, common)
    assert len(engine_blobs) == len(common) and engine_blobs == exact_blobs, "the same key holds other bytes"
    assert stored_keys(off_l2) and not stored_keys(off_l2) & (stored_keys(engine_l2) | stored_keys(exact_l2))

    with engine_on(exact_l2) as engine:                       # CachedEngine restores what exact mode stored
        warm = engine.infer(messages, mode="lmcache")
    assert warm.matched_tokens >= whole_chunks * settings.chunk_size - settings.chunk_size
    assert warm.text == cold.text
    with Scheduler(settings.replace(l2_dir=str(engine_l2))) as scheduler:   # and exact mode what CachedEngine did
        again = scheduler.submit(messages).result(timeout=600)
    assert again.matched_tokens >= whole_chunks * settings.chunk_size - 64   # exact mode's cut: up to 63 short
    assert again.text == ours.text == cold.text
