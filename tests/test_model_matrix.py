"""The model matrix: the oracle over every embedded model and both full-KV engines.

Greedy text after every kind of restore (L1, L2 after an engine restart, a fresh process, a cache
server) equals the cold text token for token. On Gemma 3, llama.cpp's own prefix reuse (native)
sometimes answers differently from cold: a reused prefill splits the prompt into other batches than
a cold one, and this model's CPU kernels round differently then. Where native differs from cold on
a question, the test shows it and holds the restore to native instead (what the engine's own cache
would answer); the KV bytes a restore hands llama.cpp are checked against a cold prefill's in
tests/test_architectures.py. Prompts are longer than Gemma's sliding window plus a chunk, so a
restore needs window rows captured before the last window.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cache_server_helpers import running_server
from kvbridge.backends import make_backend
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.settings import WORK_DIR
from kvbridge.settings.models import EMBEDDED_MODELS

from test_engine_contract import llama_server_binary  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.live]

CHUNK = 64
N_PREDICT = 10
UNRELATED = [{"role": "user", "content": "Write a haiku about autumn leaves falling on a quiet pond at dusk."}]
QUESTIONS = ("Who leads the operations team?", "What is the rotor diameter?", "When is the annual meeting held?")


def _model_param(name: str, *marks):
    model = EMBEDDED_MODELS[name]
    missing = pytest.mark.skipif(not model.path.is_file(),
                                 reason=f"{model.path} missing: run ./scripts/setup.sh --model {name}")
    return pytest.param(name, marks=(missing, *marks), id=name)


MODELS = (_model_param("smollm2-135m"), _model_param("gemma3-270m", pytest.mark.slow))


@pytest.fixture(params=MODELS)
def model(request) -> str:
    return request.param


@pytest.fixture(params=("llamacpp", "llama-server"))
def kind(request) -> str:
    if request.param == "llama-server":
        request.getfixturevalue("llama_server_binary")
    return request.param


def long_doc(engine: CachedEngine) -> str:
    """The built-in handbook cut to ~640 tokens: past Gemma 3's 512-token window plus a chunk."""
    from kvbridge.bench.common.scenarios import builtin_document

    tokens = engine.backend.tokenize(builtin_document())
    return engine.backend.detokenize(tokens[1:640])


def doc_prompt(doc: str, question: str) -> list[dict]:
    return [{"role": "user", "content": f"Answer from the document.\n\n{doc}\n\nQuestion: {question}"}]


def oracle(engine: CachedEngine, prompt: list[dict], restored) -> str:
    """Assert `restored` answers as cold, or, where llama.cpp's own reuse differs from cold, as that
    reuse does; returns which held ("cold" or "native"). llama.cpp's own reuse is run only when the
    restore differs from cold (it is the reference only then: two prefills saved per oracle)."""
    cold = engine.infer(prompt, mode="cold", n_predict=N_PREDICT)
    assert restored.error == "" and cold.text.strip()
    if restored.text == cold.text:
        return "cold"
    engine.infer(doc_prompt(engine.doc, "Say nothing."), mode="native", n_predict=1)   # the document in context
    native = engine.infer(prompt, mode="native", n_predict=N_PREDICT)
    assert native.engine_cached_tokens and native.engine_cached_tokens > 512 + CHUNK
    assert native.text != cold.text, (f"restore answered {restored.text!r}, cold and llama.cpp's own reuse "
                                      f"both {cold.text!r}")
    assert restored.text == native.text, f"restore {restored.text!r}, native {native.text!r}, cold {cold.text!r}"
    return "native"


def lmcache_after_unrelated(engine: CachedEngine, prompt):
    engine.infer(UNRELATED, mode="native", n_predict=2)   # a restore that did nothing could not pass
    return engine.infer(prompt, mode="lmcache", n_predict=N_PREDICT)


def open_engine(settings, kind: str) -> CachedEngine:
    if kind == "llama-server":
        settings = settings.replace(threads=1)   # two spinning server threads on 2 shared cores crawl
    engine = CachedEngine(settings, make_backend(kind, settings)).start()
    engine.doc = long_doc(engine)
    return engine


def test_restores_from_l1_and_l2_answer_as_cold(make_settings, model, kind):
    settings = make_settings(model=model, chunk_size=CHUNK, ctx_size=2048, n_predict=N_PREDICT)
    with open_engine(settings, kind) as engine:
        assert engine.kv_refusal == "" and engine.geometry is not None
        first = engine.infer(doc_prompt(engine.doc, QUESTIONS[0]), mode="lmcache", n_predict=N_PREDICT)
        assert first.matched_tokens == 0 and first.stored_objects > first.prompt_tokens // CHUNK
        held = {}
        for question in QUESTIONS[1:]:
            prompt = doc_prompt(engine.doc, question)
            warm = lmcache_after_unrelated(engine, prompt)
            assert warm.tier == "L1" and warm.restore_ok
            assert warm.matched_tokens > 512 + CHUNK     # past the window: captured window rows were used
            held[question] = oracle(engine, prompt, warm)
        engine.restart_backend(drop_l1=True)
        prompt = doc_prompt(engine.doc, QUESTIONS[1])
        from_l2 = engine.infer(prompt, mode="lmcache", n_predict=N_PREDICT)
        assert from_l2.tier == "L2" and from_l2.matched_tokens > 512 + CHUNK
        held["L2"] = oracle(engine, prompt, from_l2)
        assert engine.metrics.snapshot().get("counters", {}).get("store_window_incomplete", 0) == 0
        print(f"{model} on {kind}: restores held to {held}")


def test_a_fresh_process_restores_from_l2(make_settings, model):
    """Another process with the same settings finds the chunks a first one stored, and answers as cold."""
    settings = make_settings(model=model, chunk_size=CHUNK, ctx_size=2048, n_predict=N_PREDICT)
    # the first engine stays open for the oracle (its cold answer; an L2 directory takes several embedded stores)
    with open_engine(settings, "llamacpp") as engine:
        prompt = doc_prompt(engine.doc, QUESTIONS[1])
        engine.infer(doc_prompt(engine.doc, QUESTIONS[0]), mode="lmcache", n_predict=N_PREDICT)
        engine.store.flush()   # the queued L2 writes on disk before the other process looks
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(dict(model=model, l2_dir=settings.l2_dir, chunk_size=CHUNK,
                                                           ctx_size=2048, prompt=prompt))],
            capture_output=True, text=True, timeout=300, cwd=WORK_DIR)
        assert child.returncode == 0, child.stderr[-2000:]
        record = json.loads(child.stdout.strip().splitlines()[-1])
        assert record["tier"] == "L2" and record["matched_tokens"] > 512 + CHUNK
        restored = type("R", (), {"text": record["text"], "error": record["error"]})()
        oracle(engine, prompt, restored)


_CHILD = """
import json, sys
from kvbridge.backends import make_backend
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.settings import Settings
args = json.loads(sys.argv[1])
prompt = args.pop("prompt")
settings = Settings().replace(**args)
with CachedEngine(settings, make_backend("llamacpp", settings)) as engine:
    r = engine.infer(prompt, mode="lmcache", n_predict=%d)
print(json.dumps({"tier": r.tier, "matched_tokens": r.matched_tokens, "text": r.text, "error": r.error}))
""" % N_PREDICT


def test_restores_through_a_cache_server(make_settings, model):
    settings = make_settings(model=model, chunk_size=CHUNK, ctx_size=2048, n_predict=N_PREDICT, l2_enabled=False)
    with running_server(settings) as server:
        with open_engine(settings.replace(store_url=server.url), "llamacpp") as engine:
            engine.infer(doc_prompt(engine.doc, QUESTIONS[0]), mode="lmcache", n_predict=N_PREDICT)
            prompt = doc_prompt(engine.doc, QUESTIONS[2])
            warm = lmcache_after_unrelated(engine, prompt)
            assert warm.restore_ok and warm.matched_tokens > 512 + CHUNK
            oracle(engine, prompt, warm)


@pytest.mark.slow
def test_the_scheduler_shares_and_restores_on_every_model(make_settings, model):
    """The scheduler's own llama.cpp context on each model: a shared document is prefilled once
    (seq_cp on both of Gemma 3's caches) and a new scheduler restores the stored prompt from the store,
    all of it: the window rows before Gemma's last window were captured through a scratch sequence."""
    from kvbridge.bench.common.scenarios import builtin_document
    from kvbridge.scheduler import Scheduler

    settings = make_settings(model=model, sched_kv_cells=2048, sched_max_running=2, sched_cached_prefixes=2,
                             n_predict=8, ctx_size=1024, chunk_size=CHUNK)
    doc = builtin_document()[:2800]
    prompt = [{"role": "user", "content": f"Answer from the document.\n\n{doc}\n\nQuestion: {QUESTIONS[0]}"}]
    other = [{"role": "user", "content": f"Answer from the document.\n\n{doc}\n\nQuestion: {QUESTIONS[1]}"}]
    with Scheduler(settings) as scheduler:
        first = scheduler.submit(prompt).result(timeout=300)
        shared = scheduler.submit(other).result(timeout=300)
        assert scheduler.drain(60)
    assert first.matched_tokens == 0 and first.gen_tokens > 0 and first.prompt_tokens > 512 + CHUNK
    assert shared.tier == "resident" and shared.matched_tokens >= shared.prompt_tokens - 32
    with Scheduler(settings) as scheduler:          # a restart: nothing resident, the store has it
        again = scheduler.submit(prompt).result(timeout=300)
    assert again.tier in ("L1", "L2") and again.matched_tokens >= again.prompt_tokens - CHUNK
    assert again.gen_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("kv_type", ("f16", "f32"))
def test_a_repeated_prompt_shares_resident_cells_and_answers_as_cold(make_settings, model, kv_type):
    """The same prompt asked again shares the finished prompt's resident cells (all but its last token)
    and answers as the first time, token for token, with either K/V type. On an AVX2 machine Gemma 3's
    repeated answer differed from the first when the prompt's last token was decoded into the cell after
    the one it had cold: llama.cpp sums attention over cells in SIMD lanes by cell index."""
    from kvbridge.scheduler import Scheduler

    settings = make_settings(model=model, sched_kv_cells=2048, sched_max_running=2, sched_cached_prefixes=2,
                             n_predict=16, ctx_size=1024, chunk_size=CHUNK, cache_type_k=kv_type,
                             cache_type_v=kv_type)
    document = "# Orchard rota\n\n" + " ".join(
        f"Rule {i}: the {['north', 'south', 'east', 'west'][i % 4]} orchard is pruned in week {i % 9} by crew {i % 5}."
        for i in range(40))
    prompt = [{"role": "user", "content": f"Document:\n{document}\n\nQuestion: Which orchard is pruned in week 3?"}]
    with Scheduler(settings) as scheduler:
        cold = scheduler.submit(prompt).result(timeout=300)
        warm = scheduler.submit(prompt).result(timeout=300)
        again = scheduler.submit(prompt).result(timeout=300)
    assert cold.matched_tokens == 0 and cold.prompt_tokens > 512 + CHUNK
    assert warm.tier == "resident" and warm.matched_tokens == warm.prompt_tokens - 1
    assert warm.text == cold.text and again.text == cold.text


def test_whole_snapshots_on_an_attached_server_without_its_slot_files(make_settings, model, llama_server_binary):  # noqa: F811
    """KV kept on the server by name (its slot files are not readable here): SmolLM2 restores whole
    snapshots and answers as cold; Gemma 3 refuses (a snapshot trimmed to a shorter prefix would lack
    window rows), runs uncached and says so."""
    from kvbridge.backends.llama_server import LlamaServerBackend

    settings = make_settings(model=model, chunk_size=CHUNK, ctx_size=2048, n_predict=N_PREDICT, threads=1)
    own = LlamaServerBackend(settings)
    own.start()
    try:
        attached = settings.replace(llama_server_url=own.base_url)
        with open_engine(attached, "llama-server") as engine:
            assert engine.backend.kv_by_reference
            engine.infer(doc_prompt(engine.doc, QUESTIONS[0]), mode="lmcache", n_predict=N_PREDICT)
            prompt = doc_prompt(engine.doc, QUESTIONS[1])
            warm = lmcache_after_unrelated(engine, prompt)
            if model == "gemma3-270m":
                assert "sliding-window" in engine.kv_refusal and "KVB_LLAMA_SERVER_SLOT_DIR" in engine.kv_refusal
                assert warm.matched_tokens == 0 and warm.stored_objects == 0 and "KV caching refused" in warm.notes
            else:
                assert engine.geometry is None and engine.kv_refusal == ""
                assert warm.matched_tokens > 512 + CHUNK and warm.restore_ok
            oracle(engine, prompt, warm)
    finally:
        own.stop()


@pytest.mark.slow
def test_the_scheduler_swaps_out_and_back_in_whole_on_every_model(make_settings, model, monkeypatch):
    """A preempted request on a prompt longer than Gemma 3's window plus a chunk: swap-out stores all of
    it (window rows captured through a scratch sequence) and the KV after swap-in equals the KV at
    swap-out, both caches, byte for byte."""
    import threading

    import numpy as np

    from kvbridge.bench.common.scenarios import builtin_document
    from kvbridge.formats.llama_state import parse_state
    from kvbridge.scheduler import Scheduler
    from kvbridge.scheduler.lifecycle import Lifecycle

    settings = make_settings(model=model, sched_kv_cells=2048, sched_max_running=1, sched_cached_prefixes=0,
                             n_predict=24, ctx_size=1024, chunk_size=CHUNK)
    saved: dict[str, bytes] = {}
    preempt, start = Lifecycle.preempt, Lifecycle.start

    def spying_preempt(self, request, why):
        saved["out"] = bytes(self._ctx.save_seq(request.seq))
        preempt(self, request, why)

    def spying_start(self, request, resumed):
        start(self, request, resumed)
        if resumed:
            saved["in"] = bytes(self._ctx.save_seq(request.seq))

    monkeypatch.setattr(Lifecycle, "preempt", spying_preempt)
    monkeypatch.setattr(Lifecycle, "start", spying_start)
    doc = builtin_document()[:2800]
    started = threading.Event()
    with Scheduler(settings) as scheduler:
        window = scheduler._geometry.window
        low = scheduler.submit(doc_prompt(doc, QUESTIONS[0]), priority=1, on_token=lambda piece: started.set())
        assert started.wait(300)
        urgent = scheduler.submit([{"role": "user", "content": "Say hello in one short sentence."}], priority=9, n_predict=4)
        urgent.result(timeout=300)
        low_record = low.result(timeout=300)
        swap_outs = [e["detail"] for e in scheduler.events() if e["kind"] == "swap-out"]
    assert low_record.preemptions == 1 and low_record.prompt_tokens > 512 + CHUNK
    assert swap_outs and "recompute" not in swap_outs[0]          # every chunk and the tail were stored
    before, after = parse_state(saved["out"], window=window), parse_state(saved["in"], window=window)
    assert (after.n_cells, after.window_start) == (before.n_cells, before.window_start)
    for k_a, k_b, v_a, v_b in zip(before.k, after.k, before.v, after.v):
        assert np.array_equal(k_a, k_b) and np.array_equal(v_a, v_b)


def test_both_engines_share_one_namespace_and_its_chunks(make_settings, model, llama_server_binary):  # noqa: F811
    """The in-process engine and llama-server fingerprint the model, its layout and (Gemma 3) the
    sliding-window mode identically, so chunks one stores the other restores, answering as cold."""
    settings = make_settings(model=model, chunk_size=CHUNK, ctx_size=2048, n_predict=N_PREDICT)
    with open_engine(settings, "llamacpp") as in_process:
        in_process.infer(doc_prompt(in_process.doc, QUESTIONS[0]), mode="lmcache", n_predict=N_PREDICT)
        namespace, doc = in_process.namespace, in_process.doc
    assert ("swa=full" in namespace) == (model == "gemma3-270m")
    with open_engine(settings, "llama-server") as server:
        assert server.namespace == namespace
        server.doc = doc
        prompt = doc_prompt(doc, QUESTIONS[2])
        warm = lmcache_after_unrelated(server, prompt)
        assert warm.tier == "L2" and warm.matched_tokens > 512 + CHUNK
        oracle(server, prompt, warm)
