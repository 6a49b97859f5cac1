"""Blend mode on the real model (kvbridge.blend): segments, the position shift, reuse, and refusals.

The position shift is checked against llama.cpp itself: a passage prefilled after its instruction
and then moved by delta positions (llama_memory_seq_add, which re-rotates K) is compared with the
same tokens prefilled at positions delta.. from the start. V is never touched by a shift: the moved
V bytes are the stored ones exactly, in every layer. In layer 0, where K and V depend only on the
token and its position, the moved K equals the prefill's within two f16 steps and V byte for byte.
Deeper layers of the prefill at delta also carry the float rounding of attention computed at other
absolute positions (a prefill at delta = 1 differs as much as one at 300), so there the comparison
is a relative rms bound, stated below with what was measured.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import as_fresh, needs_model
from kvbridge.blend.passages import PASSAGE_KIND, blend_namespace, passage_key
from kvbridge.blend.runner import ANSWER, SCRATCH
from kvbridge.engine.segments import segment_spans, tokenize_segments
from kvbridge.bench.rag import build_prompts, load_corpus, rag_messages, wants_completion
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.formats.llama_state import parse_state
from kvbridge.backends.llamacpp import LlamaCppBackend

SEP = "[KVB_SEP]"
K0_TOLERANCE = 1.6e-2   # layer 0, |K shifted - K prefilled at delta|: two f16 steps at |K| of 8-16
K_REL_RMS = 0.03        # every layer, rms(K shifted - K prefilled at delta) / rms(K): measured 0.02 % - 1.5 %
V_REL_RMS = 0.08        # every layer, the same for V (V itself is never touched by a shift): measured up to 4.2 %


def fake_tokenize(text: str) -> list[int]:
    return [1] + [ord(c) for c in text]   # a BOS, then one id per character


def test_segments_keep_one_bos_and_drop_the_separator():
    seg = tokenize_segments(f"ab{SEP}cd{SEP}{SEP}e", SEP, fake_tokenize)
    assert seg.tokens == (1, ord("a"), ord("b"), ord("c"), ord("d"), ord("e"))
    assert seg.starts == (0, 3, 5)        # the empty segment between two separators is dropped
    assert seg.text == "abcde" and seg.n_passages == 1
    assert tokenize_segments("no separator here", SEP, fake_tokenize) is None


@pytest.fixture(scope="module")
def shared_engine(make_module_settings):
    """One engine for the module (one model load): each test gets it through `engine`, as a fresh one."""
    settings = make_module_settings(ctx_size=4096, n_predict=8, blend_recompute_tokens=8, blend_recompute_ratio=0.0)
    with CachedEngine(settings, LlamaCppBackend(settings)) as e:
        yield e


@pytest.fixture
def engine(shared_engine):
    """The module's engine as a new one would be (conftest.as_fresh). Its blend runner (a second context, made by
    the first test that needs it) is kept: every run, placement and store empties the sequences it uses first,
    and the passages it finds come from the store, emptied here."""
    as_fresh(shared_engine)
    return shared_engine


@pytest.fixture
def engine_without_runner(engine):
    """The engine with no blend runner yet: a new runner's context starts at CELL_STEP cells and grows with the prompts."""
    runner = engine._mode_runners.pop("blend", None)
    if runner is not None:
        runner.close()
    return engine


def rag(engine, passage_ids, question="What is the steepest gradient on the line?"):
    return rag_messages(load_corpus(), passage_ids, question, engine.settings.blend_separator)


pytestmark = [needs_model, pytest.mark.timeout(600)]


def test_every_mode_runs_the_same_tokens_and_the_model_never_sees_the_separator(engine):
    prompt = engine.prepare(rag(engine, ["p01", "p02"]))
    assert SEP not in prompt.text and len(prompt.segments) == 4   # instruction, 2 passages, question
    whole = engine.backend.tokenize(prompt.text)
    # each segment tokenized alone: a passage has the same ids wherever it stands
    other = engine.prepare(rag(engine, ["p02", "p01"]))
    p01 = prompt.tokens[prompt.segments[1]:prompt.segments[2]]
    assert other.tokens[other.segments[2]:other.segments[3]] == p01
    assert abs(len(whole) - len(prompt.tokens)) <= 4


def test_a_shifted_passage_matches_a_prefill_at_the_new_position(engine):
    runner = engine._blend_runner()
    ctx = runner.ctx
    seg = engine.prepare(rag(engine, ["p03"]))
    instruction = list(seg.tokens[: seg.segments[1]])
    passage = list(seg.tokens[seg.segments[1]: seg.segments[2]])
    n_i, n_p, delta = len(instruction), len(passage), 300

    ctx.seq_rm(ANSWER)
    ctx.seq_rm(SCRATCH)
    runner._decode(SCRATCH, instruction + passage, 0, want_logits=False)
    stored = parse_state(ctx.save_seq(SCRATCH))
    ctx.seq_rm(SCRATCH)
    # the same tokens prefilled from position delta on
    runner._decode(SCRATCH, instruction + passage, delta, want_logits=False)
    at_delta = parse_state(_rebased(ctx.save_seq(SCRATCH), delta))
    ctx.seq_rm(SCRATCH)
    # the stored cells moved by delta; one decode elsewhere makes llama.cpp apply the K shift
    ctx.load_seq(SCRATCH, _state_of(stored))
    ctx.seq_add(SCRATCH, 0, n_i + n_p, delta)
    runner._decode(ANSWER, instruction[:1], 0, want_logits=False)
    moved_bytes = ctx.save_seq(SCRATCH)
    ctx.seq_rm(SCRATCH)
    ctx.seq_rm(ANSWER)
    moved = parse_state(_rebased(moved_bytes, delta))

    g = stored.geometry
    assert g.v_trans and all(t == 1 for t in g.k_types)   # f16 K and V, V transposed (the default)

    def f32(rows):
        return rows.view(np.float16).astype(np.float32)

    def rel_rms(a, b):
        return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))

    # layer 0: K and V depend on the token and its position only, so the shift must reproduce the
    # prefill at delta up to f16 rounding of the rotation, and V exactly
    assert np.max(np.abs(f32(moved.k[0]) - f32(at_delta.k[0]))) <= K0_TOLERANCE
    assert np.array_equal(moved.v[0], at_delta.v[0])
    for layer in range(g.n_layer):
        assert np.array_equal(moved.v[layer], stored.v[layer]), f"layer {layer}: a shift changed V"
        k_moved, k_prefill, k_stored = f32(moved.k[layer]), f32(at_delta.k[layer]), f32(stored.k[layer])
        assert rel_rms(k_stored, k_prefill) > 0.5, f"layer {layer}: K did not move"   # rotated by 300 positions
        # deeper layers also carry the rounding of attention computed at other absolute positions
        assert rel_rms(k_moved, k_prefill) < K_REL_RMS, layer
        assert rel_rms(f32(moved.v[layer]), f32(at_delta.v[layer])) < V_REL_RMS, layer


def _state_of(parsed):
    from kvbridge.formats.llama_chunks import assemble_state, decode_chunk, encode_chunk

    payload = encode_chunk(parsed, 0, parsed.n_cells, [0] * parsed.n_cells)
    view = decode_chunk(payload, parsed.geometry)
    return assemble_state(parsed.geometry, [(view, view.n_cells)], seq_id=SCRATCH)


def _rebased(data, delta):
    """The moved state with positions from 0 again (parse_state wants a prefix state)."""
    buf = bytearray(bytes(data))
    n_cells = int.from_bytes(buf[12:16], "little")
    meta = np.frombuffer(buf, dtype="<i4", count=3 * n_cells, offset=16).reshape(n_cells, 3).copy()
    meta[:, 0] -= delta
    buf[16: 16 + 12 * n_cells] = meta.tobytes()
    return bytes(buf)


def test_blend_reuses_passages_anywhere_and_stores_them_apart_from_exact_chunks(engine):
    first = engine.infer(rag(engine, ["p02", "p05"]), "blend")
    assert not first.error and first.mode == "blend"
    assert "0 of 3 segments reused" in first.notes and first.stored_objects == 3   # instruction + 2 passages
    assert first.matched_tokens == 0 and first.text

    shuffled = engine.infer(rag(engine, ["p05", "p02"]), "blend")   # each passage where the other stood
    assert "3 of 3 segments reused" in shuffled.notes and shuffled.tier == "L1"
    assert shuffled.matched_tokens > 0.8 * shuffled.prompt_tokens and shuffled.stored_objects == 0
    assert shuffled.prefill_tokens == shuffled.prompt_tokens - shuffled.matched_tokens

    # the blend objects sit in their own namespace, as passages: an exact lookup never reaches them
    instruction = first_prompt = engine.prepare(rag(engine, ["p02", "p05"]))
    p05 = list(first_prompt.tokens[first_prompt.segments[2]:first_prompt.segments[3]])
    key = passage_key(blend_namespace(engine.namespace), list(instruction.tokens[: instruction.segments[1]]), p05)
    stored = engine.store.get(key, namespace=blend_namespace(engine.namespace))
    assert stored is not None and stored.meta.kind == PASSAGE_KIND
    assert engine.store.get(key, namespace=engine.namespace) is None
    exact = engine.infer(rag(engine, ["p05", "p02"]), "lmcache")
    assert exact.matched_tokens == 0 and exact.tier == "none"


def test_a_new_passage_between_stored_ones_is_prefilled_in_place_and_the_first_passage_is_not_recomputed(engine):
    """The first passage stands where it was computed (its KV is cold's): nothing of it is recomputed. A passage
    not stored yet is prefilled where it stands, between stored ones, and stored after the answer; the
    passage after it has its last tokens recomputed (KVB_BLEND_RECOMPUTE_TOKENS)."""
    recompute = engine.settings.blend_recompute_tokens
    engine.infer(rag(engine, ["p05", "p09"]), "blend")   # stores the instruction, p05 and p09
    messages = rag(engine, ["p05", "p13", "p09"])
    record = engine.infer(messages, "blend")
    assert not record.error and "3 of 4 segments reused" in record.notes and record.stored_objects == 1
    p = engine.prepare(messages)
    p13, question = p.segments[3] - p.segments[2], len(p.tokens) - p.segments[4]
    assert record.prefill_tokens == p13 + recompute + question
    again = engine.infer(messages, "blend")
    assert "4 of 4 segments reused" in again.notes and again.prefill_tokens == 2 * recompute + question
    assert again.text


def test_one_passage_where_it_was_computed_answers_exactly_as_cold(engine):
    """Instruction + passage at the position it was stored at, nothing recomputed: the placed KV is the
    cold prefill's, so the greedy answer equals the cold answer in the same context token for token."""
    runner = engine._blend_runner()
    prompt = engine.prepare(rag(engine, ["p04"], "Who is the chief engineer?"))
    cold = runner.run(prompt.tokens, prompt.segments, recompute=0, n_predict=10, reuse=False, store=True)
    warm = runner.run(prompt.tokens, prompt.segments, recompute=0, n_predict=10, store=False)
    assert warm.reused_segments == 2 and warm.recomputed_tokens == len(prompt.tokens) - prompt.segments[2]
    assert warm.tokens == cold.tokens
    assert int(np.argmax(warm.first_logits)) == int(np.argmax(cold.first_logits))


def test_blends_placement_of_exact_kv_answers_as_cold_token_for_token(engine):
    """Cold's own cells of two passages, put back through blend's placement (scratch sequence, seq_cp into
    the answer) where they were computed: the placement itself loses nothing, so what blend loses against
    cold is the passages' stale context alone (Docs/Research.md section 16)."""
    from kvbridge.bench.probes.blend_bench import place_exact

    runner = engine._blend_runner()
    prompt = engine.prepare(rag(engine, ["p07", "p03"], "What is the longest tunnel on the route?"))
    tokens, starts = [int(t) for t in prompt.tokens], list(prompt.segments)
    cold = runner.run(tokens, starts, recompute=0, n_predict=12, reuse=False, store=False)
    cells = parse_state(runner.ctx.save_seq(ANSWER))
    placed = place_exact(runner, tokens, starts, cells, 12)
    assert placed.reused_tokens == 0 and placed.tokens == cold.tokens
    assert np.array_equal(placed.first_logits, cold.first_logits)


def test_the_answering_passage_is_the_one_sharing_the_questions_rare_tokens(engine):
    from kvbridge.bench.probes.blend_bench import relevant_passage

    corpus = load_corpus()
    for prompt in build_prompts(corpus, SEP, n_prompts=6, n_passages=4, seed=9):
        p = engine.prepare(prompt.messages)
        tokens, starts = list(p.tokens), list(p.segments)
        spans = segment_spans(starts, len(tokens))
        gold = next(q["passage"] for q in corpus["questions"] if q["id"] == prompt.question_id)
        assert relevant_passage(tokens, spans[1:-1], tokens[spans[-1][0]:]) == prompt.passage_ids.index(gold)


def test_an_answer_holds_the_expected_fact_with_case_and_spacing_ignored():
    from kvbridge.bench.common.report import holds_fact

    assert holds_fact("The longest tunnel on the route is the Kessel  Tunnel, 640 m.", "the Kessel Tunnel")
    assert holds_fact("It seats 96\npassengers.", "96 passengers")
    assert not holds_fact("The gradient is 23%.", "23 percent")
    assert not holds_fact("anything", "  ")


def test_a_prompt_without_passages_runs_as_lmcache_and_says_so(engine):
    record = engine.infer([{"role": "user", "content": "What is a rack railway?"}], "blend")
    assert record.mode == "lmcache" and "ran as lmcache" in record.notes and not record.error


def test_rag_prompts_are_seeded_and_hold_the_answering_passage():
    corpus = load_corpus()
    a = build_prompts(corpus, SEP, n_prompts=6, n_passages=4, seed=5)
    b = build_prompts(corpus, SEP, n_prompts=6, n_passages=4, seed=5)
    assert a == b
    gold = {q["id"]: q["passage"] for q in corpus["questions"]}
    for prompt in a:
        assert len(set(prompt.passage_ids)) == 4 and gold[prompt.question_id] in prompt.passage_ids
        assert prompt.messages[1]["content"].count(SEP) == 5
        assert prompt.request == prompt.messages and not prompt.completion


def test_a_model_without_a_chat_template_is_asked_in_completion_form(engine):
    """SmolLM2-Instruct carries a chat template (chat messages); a base model's GGUF (Gemma 3 270M's here, whose
    engine test_blend_gemma checks) does not, and a ChatML prompt only gets continued: plain text ending in
    "Answer:", cut by the separator exactly where the chat form is."""
    assert not wants_completion(engine)
    corpus = load_corpus()
    prompt = build_prompts(corpus, SEP, n_prompts=1, n_passages=4, seed=5, completion=True)[0]
    assert prompt.request == prompt.completion and prompt.completion.endswith("\nAnswer:")
    assert prompt.completion.count(SEP) == 5 and prompt.completion.startswith(corpus["instruction"])
    assert prompt.messages == build_prompts(corpus, SEP, n_prompts=1, n_passages=4, seed=5)[0].messages


def test_the_rag_scenario_compares_blend_with_cold_on_shuffled_passages(engine):
    from kvbridge.bench.common.report import format_summary, summarize
    from kvbridge.bench.common.runner import run_scenario

    records = list(run_scenario(engine, "rag", ["cold", "blend"], n_requests=1, n_predict=6))
    assert [r.mode for r in records] == ["cold", "blend"] and not any(r.error for r in records)
    blended = [r for r in records if r.mode == "blend"]
    # the warm-up stored every passage once: the measured prompt reuses all four and the instruction
    assert all("5 of 5 segments reused" in r.notes for r in blended)
    assert all(r.matched_tokens > 0.8 * r.prompt_tokens and r.scenario == "rag" for r in blended)
    summary = summarize(records)
    assert summary["blend"]["answers_equal_cold"]["compared"] == 1
    assert "answers = cold" in format_summary(summary)
    # the task's own quality: the measured answer judged against the corpus's answer, cold's as well
    assert all(r.expected for r in records)
    assert summary["cold"]["answers_with_fact"]["judged"] == summary["blend"]["answers_with_fact"]["judged"] == 1
    assert "answers stating the expected fact" in format_summary(summary)


def test_the_blend_bench_prints_the_curve_and_llama_servers_cache_reuse_beside_it(monkeypatch, tmp_path, capsys):
    import json

    from kvbridge.backends.llama_server.process import built_binary, pinned_llama_cpp_version
    from kvbridge.bench.probes import blend_bench

    if not built_binary(pinned_llama_cpp_version()).is_file():
        pytest.skip("llama-server is not built: run ./scripts/build_llama_server.sh")
    monkeypatch.setenv("KVB_OUTPUT_DIR", str(tmp_path))
    # the smallest run that reaches every part: one prompt, warmed up by the warm-up prompts holding its passages
    assert blend_bench.main(["--passages", "2", "--recompute", "0,4", "--at", "end", "--prompts", "1",
                             "--n-predict", "4", "--no-restore-cost", "--cache-reuse", "16", "--ceiling",
                             "--warm-up", "measured", "--cache-reuse-passages", "2"]) == 0
    out = capsys.readouterr().out
    assert "recompute" in out and "llama-server --cache-reuse 16, 2 passages, 1 prompts" in out
    result = json.loads(next(tmp_path.glob("kvbridge-blend-*.json")).read_text())
    assert [(r["passages"], r["recompute"], r["at"]) for r in result["curve"]] == [(2, 0, "-"), (2, 4, "end")]
    assert all(0 <= r["mean_kl"] and r["blend_ttft_ms"] > 0 for r in result["curve"])
    assert result["llama_server_cache_reuse"]["prompts"] == 1
    assert all(0 <= r["cold_fact"] <= 1 and 0 <= r["fact"] <= 1 for r in result["curve"])
    # how far recompute goes: half of every passage recomputed in context comes closer to cold than a pure
    # shift, and cold's own KV placed by blend answers as cold, token for token
    shift, default, half, answering, exact = result["ceiling"]["rows"]
    assert "how far recomputing tokens can go" in out and exact["variant"].startswith("cold's own KV")
    assert half["mean_kl"] < shift["mean_kl"], result["ceiling"]
    assert exact["identical"] == 1.0 and exact["mean_kl"] < 1e-9, result["ceiling"]


def test_the_blend_context_grows_with_the_prompts_up_to_kvb_ctx_size(engine_without_runner):
    """llama.cpp's K shift rotates every cell of the context, so the blend context is sized to the prompts it
    has answered (steps of CELL_STEP), not to KVB_CTX_SIZE; the answer is the same either way."""
    from kvbridge.blend.runner import CELL_STEP

    engine = engine_without_runner
    runner = engine._blend_runner()
    assert runner.ctx.n_cells == CELL_STEP and runner.max_cells == 4096
    messages = rag(engine, ["p01", "p02"])   # ~600 tokens: past the first CELL_STEP
    prompt = engine.prepare(messages)
    cold = engine.infer(messages, mode="cold", n_predict=8, temperature=0.0)
    blended = engine.infer(messages, mode="blend", n_predict=8, temperature=0.0)   # nothing stored yet: prefilled
    cells = engine._blend_runner().ctx.n_cells
    assert cells % CELL_STEP == 0 and len(prompt.tokens) + 8 <= cells < 4096, cells
    assert blended.text == cold.text
    engine.infer(rag(engine, ["p05"]), mode="blend", n_predict=8, temperature=0.0)
    assert engine._blend_runner().ctx.n_cells == cells    # a shorter prompt keeps it
