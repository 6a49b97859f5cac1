"""The scheduler as a fleet worker sees it (issue 34), on the real model: min_tokens and ignore_eos as vLLM
means them; store_before_answer (a prefill instance's answer comes only once its prompt is in the shared
store, where a decode instance restores every chunk and the tail); the kv listeners a KV-event publisher
registers (resident runs, stored prompts, never a cache_salt's); stored_media by tier; tokens_of.
Short prompts and small budgets keep it to a minute or so.
"""
from __future__ import annotations

import random
import threading

import pytest
from blake3 import blake3

from conftest import needs_model
from kvbridge.engine.hashing import tokens_digest
from kvbridge.scheduler import RequestRefused, Scheduler
from kvbridge.scheduler.sequence_store import SequenceStore
from kvbridge.store import DiskTier, MemoryTier, ObjectMeta, TieredStore

pytestmark = [pytest.mark.timeout(300)]

# SmolLM2 answers this in one word, then its end token: well before n_predict
SHORT_ANSWER = [{"role": "user", "content": "Reply with one word: yes or no. Is the sky blue?"}]
N_PREDICT = 16


def chat(doc: str, question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": f"Document:\n{doc}\n\nQuestion: {question}"}]


@pytest.fixture
def settings(make_settings):
    return make_settings(sched_kv_cells=2048, sched_max_running=3, sched_cached_prefixes=2, n_predict=8, ctx_size=1024)


class Recorder:
    """A kv listener that keeps every call (both methods return at once, as the contract asks)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._lock = threading.Lock()

    def resident(self, runs) -> None:
        with self._lock:
            self.calls.append(("resident", [tuple(run) for run in runs]))

    def stored(self, tokens, n_chunks) -> None:
        with self._lock:
            self.calls.append(("stored", tuple(tokens), n_chunks))

    def of(self, kind: str) -> list[tuple]:
        with self._lock:
            return [call[1:] for call in self.calls if call[0] == kind]


@needs_model
def test_ignore_eos_runs_to_n_predict_and_min_tokens_holds_the_end_and_the_stop_strings_back(settings):
    with Scheduler(settings) as scheduler:
        def run(**options):
            return scheduler.submit(SHORT_ANSWER, n_predict=N_PREDICT, **options).result(timeout=120)

        plain = run()
        ignored = run(ignore_eos=True)
        held = run(min_tokens=5)
        capped = run(min_tokens=10 * N_PREDICT)                  # capped by n_predict: runs to it, no error
        stopped = run(ignore_eos=True, stop=["."])               # ignore_eos: a stop string still stops
        stopped_later = run(ignore_eos=True, stop=["."], min_tokens=4)
        tokens = scheduler.tokens_of(SHORT_ANSWER)
        bad = scheduler.submit(SHORT_ANSWER, min_tokens=-1)
        with pytest.raises(RequestRefused, match="min_tokens"):
            bad.result(timeout=5)
    assert plain.gen_tokens < 5, plain.text                      # the plain run ends early on its own end token
    assert ignored.gen_tokens == N_PREDICT and ignored.text.startswith(plain.text)
    assert 5 <= held.gen_tokens < N_PREDICT and held.text.startswith(plain.text) and len(held.text) > len(plain.text)
    assert capped.gen_tokens == N_PREDICT
    assert "." in ignored.text and stopped.text == ignored.text[:ignored.text.index(".")]
    # the first "." came before 4 tokens: not honoured; the answer stops at the next one
    assert stopped.gen_tokens < 4 and "." in stopped_later.text
    assert ignored.text.startswith(stopped_later.text) and ignored.text[len(stopped_later.text)] == "."
    assert len(tokens) == plain.prompt_tokens


@needs_model
def test_a_prefill_answers_after_its_prompt_is_in_the_cache_server_and_a_decode_scheduler_restores_all_of_it(
        make_settings, short_doc, tmp_path):
    """PD through the shared cache: the prefill scheduler's Future resolves once every whole chunk and the tail
    are on the server (no drain), a second scheduler on the same server (the decode instance) restores all
    but the token it feeds, and stored_media says where the chunks are: the server's L1, then its L2."""
    from cache_server_helpers import running_server

    server_settings = make_settings(l2_dir=str(tmp_path / "server-l2"), l1_bytes=64 << 20,
                                    cache_server_page_bytes=64 << 10)
    prompt = chat(short_doc, "When are reports due?")
    with running_server(server_settings) as server:
        settings = make_settings(store_url=server.url, l2_dir=str(tmp_path / "engine-l2-unused"),
                                 sched_kv_cells=2048, sched_cached_prefixes=1, n_predict=8, ctx_size=1024)
        listener = Recorder()
        with Scheduler(settings) as prefill:
            prefill.add_kv_listener(listener)
            tokens = prefill.tokens_of(prompt)
            record = prefill.submit(prompt, n_predict=1, store_before_answer=True).result(timeout=120)
            stored_calls = listener.of("stored")     # before any drain: the answer came after the write
            hashes = prefill.unsalted_hashes(tokens)
            held = prefill.store.lookup(hashes).n_hit
            unknown = blake3(b"no prompt hashes to this").digest()[:len(hashes[0])]
            media = prefill.stored_media([hashes[0], unknown, *hashes[1:]])
        whole = len(tokens) // prefill.chunk_size
        assert record.prompt_tokens == len(tokens) and len(hashes) == whole and whole * 32 < len(tokens)
        assert record.stored_tokens == len(tokens) and held == whole
        assert stored_calls == [(tuple(tokens), whole)]
        assert media == ["CPU", None] + ["CPU"] * (whole - 1)
        with Scheduler(settings) as decode:
            answer = decode.submit(prompt).result(timeout=120)
            decode.store.clear("L1")   # the server's L1 waits for its L2 copies, then lets go: they are on disk only
            on_disk = decode.stored_media(hashes)
    assert answer.tier == "L1" and answer.matched_tokens == len(tokens) - 1 and answer.gen_tokens > 0
    assert on_disk == ["DISK"] * whole


@needs_model
def test_store_before_answer_is_never_skipped_for_a_full_write_queue(settings, short_doc):
    """Three store_before_answer requests while the writer is held (it starts nothing) behind a queue of
    one: the loop meets a full queue and waits it out (drained) instead of skipping the write, and each
    request is stored whole before its Future resolves."""
    prompts = [chat(short_doc[:400 + 200 * i], f"Question {i}: who leads the team?") for i in range(3)]
    with Scheduler(settings) as scheduler:
        shared = scheduler._store_shared
        shared.writer.capacity = 1   # the writer's bound, set low: the second write meets a full queue
        with shared.writer.hold():
            futures = [scheduler.submit(p, n_predict=2, store_before_answer=True) for p in prompts]
            waited = threading.Event()
            while not waited.wait(0.05) and shared.waited_writes == 0 and not all(f.done() for f in futures):
                pass
        records = [f.result(timeout=120) for f in futures]
        held = [scheduler.store.lookup(scheduler.unsalted_hashes(scheduler.tokens_of(p))).n_hit for p in prompts]
    assert shared.waited_writes >= 1 and shared.skipped_writes == 0
    for record, prompt_held in zip(records, held):
        assert record.stored_tokens == record.prompt_tokens
        assert prompt_held == record.prompt_tokens // 32


@needs_model
def test_the_listener_sees_resident_and_stored_unsalted_runs_only_and_nothing_resident_at_close(settings,
                                                                                             short_doc):
    listener = Recorder()
    open_prompt = chat(short_doc, "Who leads the operations team?")
    salted_prompt = chat(short_doc[200:], "What is the first section about?")
    with Scheduler(settings) as scheduler:
        scheduler.add_kv_listener(listener)
        open_tokens, salted_tokens = scheduler.tokens_of(open_prompt), scheduler.tokens_of(salted_prompt)
        scheduler.submit(salted_prompt, cache_salt="tenant-a").result(timeout=120)
        record = scheduler.submit(open_prompt).result(timeout=120)
        assert scheduler.drain(60)
        hashes = scheduler.unsalted_hashes(open_tokens)
        media = scheduler.stored_media(hashes)
        scheduler.store.clear("L1")   # the embedded store's L2 has its copies (written through)
        on_disk = scheduler.stored_media(hashes)
        before_close = listener.of("resident")
    c = scheduler.chunk_size
    whole, salted_whole = len(open_tokens) // c * c, len(salted_tokens) // c * c
    assert record.prompt_tokens == len(open_tokens)
    assert listener.of("stored") == [(tuple(open_tokens), whole // c)]   # the salted prompt: never told
    runs = [run for (call,) in before_close for run in call]
    assert any(run[:whole] == tuple(open_tokens[:whole]) for run in runs)   # its running context
    # after it finished: its prompt kept as a cached prefix (all but its last token), nothing running
    assert before_close[-1] == ([tuple(open_tokens[:-1])],)
    assert not any(run[:salted_whole] == tuple(salted_tokens[:salted_whole]) for run in runs)
    assert all(a != b for a, b in zip(before_close, before_close[1:]))   # told on a change only
    assert listener.of("resident")[-1] == ([],)                            # closed: nothing resident
    assert media == ["CPU"] * (whole // c) and on_disk == ["DISK"] * (whole // c)


def test_stored_media_answers_for_every_hash_on_its_own_across_lookup_windows(make_settings, tmp_path):
    """Hashes held in L1, on disk only, or not at all, in a random order longer than several lookup windows:
    each answer equals a lookup of that hash alone (a lookup answers for a leading run only)."""
    settings = make_settings()
    namespace = "fleet-test"
    store = TieredStore([MemoryTier(1 << 20), DiskTier(tmp_path / "l2", 1 << 24)])
    sequences = SequenceStore(store, settings, namespace, geometry=None)
    try:
        rng = random.Random(34)
        hashes = [rng.randbytes(32) for _ in range(300)]
        meta = ObjectMeta(namespace=namespace, n_tokens=1, tokens_digest=tokens_digest([1]))
        where = [rng.choice(["CPU", "DISK", None, None]) for _ in hashes]
        for key, medium in zip(hashes, where):
            if medium is not None:
                assert store.put(key, b"kv" * 100, meta)
        store.clear("L1")
        for key, medium in zip(hashes, where):
            if medium == "CPU":
                assert store.get(key) is not None   # read back: promoted into L1 again
        media = sequences.media(hashes, deadline_s=60)
        alone = [store.lookup([key], namespace=namespace).tiers for key in hashes]
    finally:
        sequences.close()
        store.close()
    assert media == where
    assert media == [None if not tiers else "CPU" if tiers == ["L1"] else "DISK" for tiers in alone]
    assert media.count("CPU") and media.count("DISK")
