"""Every request's record carries the time of each stage on its way to the first token, and the
stages add up to its TTFT (within max(5 ms, 5 %)): work added to the path without a stage of its
own would break this. Real model, real store, a real cache server process.
"""
from __future__ import annotations

import pytest

from conftest import needs_model
from kvbridge.backends import make_backend
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.engine.records import RECORD_FIELDS
from kvbridge.engine.stages import STAGE_FIELDS, STAGES, stages_gap_ms, stages_of
from kvbridge.store import TieredStore

pytestmark = [needs_model, pytest.mark.timeout(300)]

DOCUMENT = " ".join(f"Note {i}: shelf {i} holds {i * 3} boxes of blue paper." for i in range(40))
QUESTIONS = ["Which shelf holds 30 boxes?", "How many boxes are on shelf 7?"]


def ask(question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer from the notes."},
            {"role": "user", "content": f"{DOCUMENT}\n\n{question}"}]


def assert_stages_add_up(record) -> None:
    assert not record.error, record.error
    tolerance = max(5.0, 0.05 * record.ttft_ms)
    gap = stages_gap_ms(record)
    assert abs(gap) <= tolerance, (f"{record.mode}: stages {stages_of(record)} sum to "
                                   f"{record.ttft_ms - gap:.1f} ms, TTFT {record.ttft_ms:.1f} ms")


def run_modes(engine: CachedEngine) -> dict[str, object]:
    records = {"cold": engine.infer(ask(QUESTIONS[0]), mode="cold"),
               "native": engine.infer(ask(QUESTIONS[0]), mode="native"),
               "miss": engine.infer(ask(QUESTIONS[0]), mode="lmcache")}
    engine.store.flush()
    records["hit"] = engine.infer(ask(QUESTIONS[1]), mode="lmcache")
    return records


def check_records(records: dict) -> None:
    for record in records.values():
        assert_stages_add_up(record)
    cold, hit = records["cold"], records["hit"]
    assert cold.prefill_ms > 0 and cold.lookup_ms == 0 and cold.fetch_ms == 0 and cold.reset_ms > 0
    assert hit.matched_tokens > 0 and hit.restore_ok
    for stage in ("tokenize", "hash", "lookup", "fetch", "assemble", "handoff", "prefill", "first_token"):
        assert getattr(hit, f"{stage}_ms") > 0, f"the warm hit has no {stage} time"
    assert hit.restore_ms == pytest.approx(hit.assemble_ms + hit.handoff_ms)
    assert hit.prefill_tokens < cold.prefill_tokens / 3    # only the suffix was prefilled
    assert hit.fetch_bytes > 0 and hit.fetch_tiers.startswith("L1=") and hit.store_calls >= 2
    assert records["miss"].fetch_bytes == 0


def test_in_process_stages_add_up_to_ttft(make_settings):
    settings = make_settings(chunk_size=64, n_predict=4)
    with CachedEngine(settings, make_backend("llama.cpp", settings), TieredStore.from_settings(settings)) as engine:
        check_records(run_modes(engine))


def test_stages_through_a_cache_server_add_up_to_ttft(make_settings, tmp_path):
    from tests.cache_server_helpers import ServerProcess, local_url, server_env

    settings = make_settings(chunk_size=64, n_predict=4, l1_bytes=64 << 20, cache_server_page_bytes=256 << 10)
    url = local_url()
    server = ServerProcess(server_env(settings), url, log_path=tmp_path / "cache-server.log")
    try:
        import dataclasses

        remote = dataclasses.replace(settings, store_url=url)
        with CachedEngine(remote, make_backend("llama.cpp", remote)) as engine:
            records = run_modes(engine)
        check_records(records)
    finally:
        assert server.terminate() == 0, server.tail()
        server.close()


def test_the_stage_fields_are_in_every_export():
    """The CSV and JSON exports write RECORD_FIELDS: every stage is one of them."""
    assert set(STAGE_FIELDS) <= set(RECORD_FIELDS)
    assert {"fetch_bytes", "fetch_tiers", "store_calls"} <= set(RECORD_FIELDS)
    assert len(STAGES) == len(STAGE_FIELDS)


def test_a_hot_prefix_is_restored_from_the_state_already_assembled(make_settings):
    """Two questions on one document: the second restore finds the same prefix's state still assembled
    in the scratch buffer and hands it to the engine without assembling again (one copy, not two); the
    answers equal cold. Another document is assembled afresh."""
    settings = make_settings(chunk_size=64, n_predict=6)
    with CachedEngine(settings, make_backend("llama.cpp", settings), TieredStore.from_settings(settings)) as engine:
        engine.infer(ask(QUESTIONS[0]), mode="lmcache")                 # a miss: stores the document
        first = engine.infer(ask(QUESTIONS[1]), mode="lmcache")         # assembled from the chunks
        second = engine.infer(ask(QUESTIONS[0]), mode="lmcache")        # the same document prefix: hot
        cold = engine.infer(ask(QUESTIONS[0]), mode="cold")
        assert engine._kv.hot_hits == 1 and engine.metrics.count("hot_restores") == 1
        assert first.matched_tokens == second.matched_tokens and second.restore_ok
        assert second.text == cold.text and second.fetch_bytes < first.fetch_bytes / 2   # the tail only, no chunk
        repeat = engine.infer(ask(QUESTIONS[0]), mode="lmcache")   # the store now reaches further than the hot state
        assert repeat.matched_tokens == engine.cut_rule.restorable(repeat.prompt_tokens) > second.matched_tokens
        assert repeat.prefill_tokens == repeat.prompt_tokens - repeat.matched_tokens
        assert engine._kv.hot_hits == 1 and repeat.text == cold.text
        for tier in engine.store.tier_names:     # the user empties the store: a miss, whatever is in memory
            engine.store.clear(tier)
        emptied = engine.infer(ask(QUESTIONS[0]), mode="lmcache")
        assert emptied.matched_tokens == 0 and emptied.tier == "none" and engine._kv.hot_hits == 1
        other = [{"role": "user", "content": DOCUMENT.replace("blue", "red") + "\n\nWhich shelf holds 30 boxes?"}]
        engine.infer(other, mode="lmcache")
        again = engine.infer(other, mode="lmcache")
        assert again.matched_tokens > 0 and engine._kv.hot_hits == 1   # not the hot state of the first document
        assert again.text == engine.infer(other, mode="cold").text
