"""The scheduler on recurrent and hybrid models of the zoo (issue 33, Deliver 4): answers equal to a cold
prefill's while five requests share one context and preempt each other (a hybrid, lfm2, and a purely
recurrent one, mamba2); a swapped-out sequence comes back bit for bit, one preempted mid-prefill too; a
repeated prompt restores from chunks that carry the recurrent state captured where each ends (in the same
scheduler and in a fresh one); a resident sequence is shared only whole; blend is refused with its reason.

The oracle is independent of the scheduler: each prompt alone in a fresh llama.cpp context, prefilled in one
batch, then greedy decoding (`cold_answer`). Tiny zoo models and short prompts keep each case to seconds.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvbridge.backends.llama_context import BATCH_TOKENS, LlamaContext
from kvbridge.formats.llama_state import parse_state
from kvbridge.models import zoo_model
from kvbridge.scheduler import RequestRefused, Scheduler
from kvbridge.scheduler.events import Journal
from kvbridge.scheduler.intake import PromptTokens
from kvbridge.scheduler.ledger import BlockLedger
from kvbridge.scheduler.lifecycle import Lifecycle
from kvbridge.scheduler.planner import plan_batch
from kvbridge.scheduler.prefix_cache import PrefixCache
from kvbridge.scheduler.requests import Queues
from kvbridge.scheduler.sequences import SequencePool

pytestmark = pytest.mark.timeout(300)

N_PREDICT = 10
TOPICS = ["the harbour at dawn", "a clockmaker's workshop", "rain over the old library", "the northern railway",
          "a garden of stone lanterns"]


def prompt(i: int) -> str:
    """Distinct prompts of two to four 32-token chunks (the chunk boundaries fall inside each)."""
    return f"Story {i}: {TOPICS[i]}. " + " ".join(f"Line {k} tells of {TOPICS[(i + k) % 5]}." for k in range(4 + 3 * i))


class ColdOracle:
    """Greedy answers of prompts alone, one llama.cpp context per model (emptied between prompts): the prompt in
    batches of BATCH_TOKENS, then one token at a time."""

    def __init__(self) -> None:
        self._contexts: dict[str, LlamaContext] = {}

    def answer(self, settings, prompt: str | list[int], n_predict: int = N_PREDICT) -> str:
        ctx = self._contexts.get(settings.model_path)
        if ctx is None:
            ctx = self._contexts[settings.model_path] = LlamaContext(settings, 1024, 1)
        tokens = ctx.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        ctx.seq_rm(0)
        for start in range(0, len(tokens), BATCH_TOKENS):   # in llama.cpp's batches, as a cold prefill is
            piece = tokens[start:start + BATCH_TOKENS]
            assert ctx.decode([(t, start + i, 0, start + i == len(tokens) - 1) for i, t in enumerate(piece)]) == 0
        out = []
        for step in range(n_predict):
            token = int(ctx.logits(len(piece) - 1 if step == 0 else 0).argmax())
            if ctx.is_end(token):
                break
            out.append(token)
            assert ctx.decode([(token, len(tokens) + step, 0, True)]) == 0
        return b"".join(ctx.piece(t) for t in out).decode("utf-8", "replace")

    def close(self) -> None:
        for ctx in self._contexts.values():
            ctx.close()


@pytest.fixture(scope="module")
def cold():
    oracle = ColdOracle()
    yield oracle
    oracle.close()


def parsed(geometry, data: bytes):
    """A sequence state of this model parsed as the store reads it (the sequence ids in it may differ)."""
    return parse_state(data, window=geometry.window, cell_ext=geometry.cell_ext, recurrent=True,
                       attention=geometry.n_layer > 0)


@pytest.fixture(params=["lfm2", "mamba2"])
def zoo_settings(request, make_settings):
    return make_settings(model_path=str(zoo_model(request.param)), sched_kv_cells=1024, sched_max_running=2,
                         sched_cached_prefixes=2, sched_block_tokens=16, n_predict=N_PREDICT, ctx_size=1024)


def test_five_requests_with_preemption_answer_as_cold(zoo_settings, cold, monkeypatch):
    """Two low-priority requests run, three urgent ones preempt them (swapped out whole, back bit for bit);
    every answer is the cold one's."""
    snapshots_out: dict[int, bytes] = {}
    snapshots_in: dict[int, bytes] = {}
    preempt, start = Lifecycle.preempt, Lifecycle.start

    def spying_preempt(self, request, why):
        snapshots_out[request.id] = bytes(self._ctx.save_seq(request.seq))
        preempt(self, request, why)

    def spying_start(self, request, resumed):
        start(self, request, resumed)
        if resumed:
            snapshots_in[request.id] = bytes(self._ctx.save_seq(request.seq))

    monkeypatch.setattr(Lifecycle, "preempt", spying_preempt)
    monkeypatch.setattr(Lifecycle, "start", spying_start)
    texts = [prompt(i) for i in range(5)]
    started = threading.Event()
    with Scheduler(zoo_settings) as scheduler:
        low = [scheduler.submit(texts[i], priority=1, on_token=lambda piece: started.set()) for i in range(2)]
        assert started.wait(120)
        urgent = [scheduler.submit(texts[i], priority=9) for i in range(2, 5)]
        records = [f.result(timeout=120) for f in low + urgent]
        answers = [r.text for r in records]
        counters = scheduler.snapshot()["counters"]
        events = scheduler.events()
        geometry = scheduler._geometry
    assert geometry.recurrent
    kinds = [e["kind"] for e in events]
    assert counters["preemptions"] >= 1 and counters["swap_ins"] == counters["preemptions"]
    assert "swap-out" in kinds and "swap-in" in kinds and counters["restore_failed"] == 0
    # each swapped-out sequence came back whole: as many tokens restored as it held at swap-out
    swapped_out = [(e["request"], e["detail"].split()[0]) for e in events if e["kind"] == "swap-out"]
    restored = [(e["request"], e["detail"].split()[0]) for e in events
                if e["kind"] == "restore" and "swap snapshot" in e["detail"]]
    assert sorted(restored) == sorted(out for out in swapped_out if out[1] != "0")
    assert snapshots_out and snapshots_out.keys() == snapshots_in.keys()
    for request_id, before in snapshots_out.items():   # every attention row and the recurrent section, bit for bit
        a, b = parsed(geometry, before), parsed(geometry, snapshots_in[request_id])
        assert b.n_cells == a.n_cells and bytes(b.recurrent.data) == bytes(a.recurrent.data)
        for k_a, k_b, v_a, v_b in zip(a.k, b.k, a.v, b.v):
            assert np.array_equal(k_a, k_b) and np.array_equal(v_a, v_b)
    for text, answer in zip(texts, answers):
        assert answer == cold.answer(zoo_settings, text)


def test_a_repeated_prompt_restores_from_chunks_as_cold(zoo_settings, cold):
    """The first answer stores chunks with the recurrent state where each ends and a tail one token before the
    end; the same prompt again (its resident copy cannot be cut back) restores from them, in the same scheduler
    and in a fresh one (from L2)."""
    text = prompt(3)
    settings = zoo_settings.replace(sched_max_running=3)
    with Scheduler(settings) as scheduler:
        first = scheduler.submit(text).result(timeout=120)
        assert scheduler.drain(60)
        again = scheduler.submit(text).result(timeout=120)
        counters = scheduler.snapshot()["counters"]
    with Scheduler(settings) as fresh:
        from_l2 = fresh.submit(text).result(timeout=120)
    assert first.matched_tokens == 0
    for record in (again, from_l2):
        assert record.matched_tokens == record.prompt_tokens - 1 and record.tier != "resident"
    assert from_l2.tier == "L2"
    assert counters["restored_tokens"] >= again.matched_tokens and counters["restore_failed"] == 0
    assert [first.text, again.text, from_l2.text] == [cold.answer(settings, text)] * 3


def test_a_prefill_preempted_midway_keeps_its_captures_and_its_prompt_restores(make_settings, cold):
    """One running slot: an urgent request preempts a long prompt in the middle of its prefill (swapped out whole
    at a chunk end). Resumed, it goes on capturing where its chunks end, so its prompt, stored after the answer,
    restores (all but the last token) and answers as cold again."""
    settings = make_settings(model_path=str(zoo_model("lfm2")), sched_kv_cells=1024, sched_max_running=1,
                             sched_cached_prefixes=0, sched_block_tokens=16, n_predict=N_PREDICT, ctx_size=1024)
    long = " ".join(prompt(i) for i in range(5))
    with Scheduler(settings) as scheduler:
        low = scheduler.submit(long, priority=1)
        while not any(r["kv_tokens"] for r in scheduler.snapshot()["running"]):
            time.sleep(0.002)
        urgent = scheduler.submit(prompt(1), priority=9)
        first, other = low.result(timeout=120), urgent.result(timeout=120)
        assert scheduler.drain(60)
        again = scheduler.submit(long).result(timeout=120)
        swapped_out = [int(e["detail"].split()[0]) for e in scheduler.events()
                       if e["kind"] == "swap-out" and e["request"] == f"req-{first.request_index}"]
    assert first.preemptions == 1 and swapped_out and 0 < swapped_out[0] < first.prompt_tokens - 1
    assert again.matched_tokens == again.prompt_tokens - 1
    assert [first.text, again.text, other.text] == [cold.answer(settings, long)] * 2 + [cold.answer(settings, prompt(1))]


def test_a_resident_sequence_is_shared_only_whole(zoo_settings, cold, monkeypatch):
    """A finished request stays resident whole (prompt and answer). A context that extends all of it (the next
    turn, given as token ids: its text would not tokenize back to the answer's ids) shares it; one that
    shares only part of it (the prompt's first half) cannot, and runs from the store or cold. Both as cold."""
    text = prompt(2)
    by_text: dict[str, list[int]] = {}
    with Scheduler(zoo_settings) as scheduler:
        tokenize = scheduler._prompt_tokens
        monkeypatch.setattr(scheduler, "_prompt_tokens",
                            lambda prompt, cut=False: PromptTokens(by_text[prompt]) if prompt in by_text
                            else tokenize(prompt, cut))
        first = scheduler.submit(text).result(timeout=120)
        assert scheduler.drain(60)
        resident, = scheduler.prefixes.prefixes
        assert len(resident.tokens) >= first.prompt_tokens + first.gen_tokens - 1
        by_text["next turn"] = resident.tokens + scheduler._ctx.tokenize(" And then?")[1:]
        by_text["first half"] = resident.tokens[:first.prompt_tokens // 2] + scheduler._ctx.tokenize(" Why?")[1:]
        second = scheduler.submit("next turn").result(timeout=120)
        third = scheduler.submit("first half").result(timeout=120)
        notes = scheduler.snapshot()["notes"]
    assert second.tier == "resident" and second.matched_tokens == len(resident.tokens)
    assert third.tier != "resident"
    assert any("shared only" in note for note in notes)
    assert [second.text, third.text] == [cold.answer(zoo_settings, by_text[k]) for k in ("next turn", "first half")]


def test_blend_is_refused_with_its_reason_and_the_rest_go_on(zoo_settings, cold):
    """A blend request would place passages at other positions, which a recurrent state cannot take: it fails
    on its own future, saying so; a plain request beside it is answered as cold."""
    sep = zoo_settings.blend_separator
    with Scheduler(zoo_settings) as scheduler:
        blend = scheduler.submit(f"Instruction.{sep}First passage.{sep}Second passage.{sep}Question?", blend=True)
        plain = scheduler.submit(prompt(0))
        with pytest.raises(RequestRefused, match="recurrent state"):
            blend.result(timeout=60)
        assert plain.result(timeout=120).text == cold.answer(zoo_settings, prompt(0))


# -- the parts alone, without a model ---------------------------------------------------------------
def test_a_recurrent_prefill_ends_its_pieces_at_chunk_ends_and_one_token_before_the_prompt_end():
    from test_scheduler_parts import make_request

    def piece_ends(request, step: int) -> list[int]:
        ends = []
        while request.kv_tokens < len(request.prompt):
            (_, entries), = plan_batch([request], step)
            request.kv_tokens += len(entries)
            request.pending = request.pending[len(entries):]
            ends.append(request.kv_tokens)
        return ends

    assert piece_ends(make_request(1, list(range(100))), 32) == [32, 64, 96, 99, 100]
    assert piece_ends(make_request(2, list(range(100))), 0) == [100]   # not a recurrent model
    stored = make_request(3, list(range(100)))
    stored.prompt_stored = True   # resumed after its prompt was stored: nothing more to capture
    assert piece_ends(stored, 32) == [100]


def test_a_recurrent_model_shares_a_resident_sequence_only_whole():
    from test_scheduler_parts import FakeContext, holding, make_request

    ctx = FakeContext()
    pool = SequencePool(ctx, BlockLedger(1024, 16, 0.25, 0.1, 0.05))
    queues = Queues()
    cache = PrefixCache(ctx, pool, queues.running, 2, iter(range(100, 200)), Journal(), whole_only=True)
    source = make_request(1, list(range(40)))
    holding(pool, source, 40)
    queues.running.append(source)
    assert cache.best_source(list(range(45)), "") == (source, 40)       # extends all of it
    assert cache.best_source(list(range(20)) + [7, 7], "") == (None, 0)  # would cut its recurrent state
    assert cache.best_source(list(range(40)), "") == (None, 0)         # its last token is always fed
