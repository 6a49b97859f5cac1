"""Why a scheduler request did not reuse its whole prompt (issue 35), on the real model and the real store:
every first admission's record carries miss_reason / miss_detail / hit_tiers. A fresh store is none_stored,
the same prompt again a hit from L1, another question on the same document diverged (where, with the text
either side), a prompt that merely extends a stored one none_stored, a prompt whose KV still waits in the
scheduler's own store writer lease_busy; cells shared from a resident prompt count as the tier "context".
"""
from __future__ import annotations

import dataclasses
import threading

import pytest

from conftest import needs_model
from kvbridge.engine.chunks import common_prefix_length
from kvbridge.engine.misses import parse_hit_tiers
from kvbridge.scheduler import Scheduler
from kvbridge.settings import Settings

pytestmark = [needs_model, pytest.mark.timeout(300)]

CHUNK = 32
QUESTION = "\n\nQuestion: who leads the operations team?"
OTHER_QUESTION = "\n\nQuestion: when are the reports due, and who sends them to the board each month?"


def settings_for(tmp_path, **changes) -> Settings:
    base = dict(chunk_size=CHUNK, ctx_size=1024, n_predict=4, l2_dir=str(tmp_path / "l2"),
                output_dir=str(tmp_path / "output"), input_dir=str(tmp_path / "input"), sched_kv_cells=2048,
                sched_max_running=2, sched_block_tokens=16,
                sched_exact=False)   # the mode off's reuse (all but the last token); exact mode's: test_serve_misses
    base.update(changes)
    return dataclasses.replace(Settings(), **base)


@pytest.fixture(scope="module")
def stored_only(tmp_path_factory):
    """A scheduler that keeps no prompt resident: whatever is reused comes from the store."""
    with Scheduler(settings_for(tmp_path_factory.mktemp("stored"), sched_cached_prefixes=0)) as scheduler:
        yield scheduler


def ask(scheduler: Scheduler, prompt: str):
    record = scheduler.submit(prompt, n_predict=4).result(timeout=120)
    assert scheduler.drain(60)   # its prompt is in the store before the next request looks
    return record


def test_a_fresh_store_is_none_stored_and_the_same_prompt_then_hits_l1(stored_only, short_doc):
    first = ask(stored_only, short_doc + QUESTION)
    assert first.miss_reason == "none_stored" and first.matched_tokens == 0
    assert "nothing is stored under this prompt's first chunk" in first.miss_detail
    assert first.hit_tiers == ""

    again = ask(stored_only, short_doc + QUESTION)
    assert again.miss_reason == "" and again.miss_detail == ""
    assert again.matched_tokens == again.prompt_tokens - 1   # all but the last token, which is always computed
    assert parse_hit_tiers(again.hit_tiers) == {"L1": again.matched_tokens}
    assert again.explain_ms == 0.0                         # a hit costs the explainer nothing


def test_another_question_on_a_stored_document_diverges_where_it_differs(stored_only, short_doc):
    ask(stored_only, short_doc + QUESTION)
    record = ask(stored_only, short_doc + OTHER_QUESTION)
    ours, theirs = (stored_only.tokens_of(short_doc + q) for q in (OTHER_QUESTION, QUESTION))
    at = common_prefix_length(ours, theirs)
    assert record.miss_reason == "diverged", record.miss_detail
    assert f"diverges from a stored prompt at token {at}" in record.miss_detail
    assert "when" in record.miss_detail and "who" in record.miss_detail   # the text either side: ours, then stored
    assert record.matched_tokens == at and parse_hit_tiers(record.hit_tiers) == {"L1": at}


def test_a_prompt_that_merely_extends_a_stored_one_is_none_stored(stored_only, short_doc):
    stored = short_doc[:600] + QUESTION
    ask(stored_only, stored)
    longer = stored + "\n\nAnswer in one short sentence, naming the team."
    record = ask(stored_only, longer)
    held = common_prefix_length(stored_only.tokens_of(longer), stored_only.tokens_of(stored))
    assert held == len(stored_only.tokens_of(stored))     # the stored prompt is all of the new one's start
    assert record.miss_reason == "none_stored", record.miss_detail
    assert f"the store holds the first {held} tokens of this prompt" in record.miss_detail


def test_a_prompt_still_in_the_schedulers_store_queue_is_lease_busy(stored_only, short_doc):
    prompt = short_doc[300:] + QUESTION   # a document the store has not seen
    gate = threading.Event()
    assert stored_only._store_shared.writer.submit(lambda: gate.wait(60))   # the writer is busy until the gate opens
    try:
        first = stored_only.submit(prompt).result(timeout=120)     # its store is queued behind the gate
        second = stored_only.submit(prompt).result(timeout=120)
    finally:
        gate.set()
    assert stored_only.drain(60)
    assert first.miss_reason == "none_stored"
    assert second.miss_reason == "lease_busy", second.miss_detail
    assert f"the first {second.prompt_tokens - 1} tokens of this prompt are queued" in second.miss_detail
    third = ask(stored_only, prompt)                               # written now: a hit
    assert third.miss_reason == "" and third.matched_tokens == third.prompt_tokens - 1


def test_resident_cells_count_as_context_and_a_short_rest_is_below_chunk(tmp_path, short_doc):
    with Scheduler(settings_for(tmp_path, sched_cached_prefixes=2)) as scheduler:
        ask(scheduler, short_doc + QUESTION)
        again = ask(scheduler, short_doc + QUESTION)       # its prompt is resident: shared, not restored
        other = ask(scheduler, short_doc + OTHER_QUESTION)
        tiny = ask(scheduler, "Hi there")
        ours, theirs = (scheduler.tokens_of(short_doc + q) for q in (OTHER_QUESTION, QUESTION))
    assert again.tier == "resident" and again.miss_reason == ""
    assert parse_hit_tiers(again.hit_tiers) == {"context": again.prompt_tokens - 1}
    at = common_prefix_length(ours, theirs)
    assert parse_hit_tiers(other.hit_tiers) == {"context": at}   # the document's cells, shared
    assert other.miss_reason == "diverged" and f"at token {at}" in other.miss_detail
    assert other.miss_detail.startswith(f"{at} tokens shared from resident cells")
    assert tiny.miss_reason == "below_chunk" and "under half a block (8)" in tiny.miss_detail
