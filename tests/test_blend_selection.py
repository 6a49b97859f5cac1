"""Blend's deviation rule and its gate (kvbridge.blend.selection, kvbridge.blend.deviation) on the real model.

What a user relies on: the selection pass stops the graph early and still reads the prompt's own K and V
(layer 0 of a shifted passage, rotated as llama.cpp's K shift rotates it, equals the fresh one); the tokens
it recomputes are the ones whose stored KV deviates most, measured independently from a full cold prefill
(a selection that ignored deviation, such as each passage's first or last tokens, finds far fewer of them);
the ratio sets how many; the gate falls back to prefix reuse above its threshold and says so in the record,
and never below it; a bad setting is refused naming it."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import as_fresh
from kvbridge.backends.llamacpp import LlamaCppBackend
from kvbridge.bench.probes.blend_deviation_probe import cold_and_blend_states, deviations, edge_rule
from kvbridge.bench.rag import build_prompts, load_corpus
from kvbridge.blend.result import BlendResult
from kvbridge.blend.runner import ANSWER
from kvbridge.blend.selection import GgmlTensor, Rope, _layer_of, runs_of
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.engine.segments import segment_spans
from kvbridge.settings import Settings


def test_runs_of_groups_consecutive_positions():
    assert runs_of(np.array([3, 4, 5, 9, 11, 12])) == [(3, 6), (9, 10), (11, 13)]
    assert runs_of(np.array([], dtype=int)) == []


def test_layer_names_as_llama_cpp_gives_them():
    assert _layer_of(b"Kcur-12") == 12 and _layer_of(b"attn_norm-0") == 0
    assert _layer_of(b"inp_embd") is None and _layer_of(b"node_7") is None and _layer_of(b"-3") is None


def test_ggml_tensor_layout_matches_the_pinned_header():
    # struct ggml_tensor: 4 ne, 4 nb, 16 op params, 10 srcs, a 64-byte name (include/ggml.h); 336 bytes on 64-bit
    assert GgmlTensor.name.offset == GgmlTensor.data.offset + 8
    assert GgmlTensor.data.offset == 248 and GgmlTensor.name.size == 64


def test_rope_rotation_composes_and_keeps_norms():
    rope = Rope(neox=False, n_rot=8, head_dim=8, freq_base=10000.0, freq_scale=1.0)
    k = np.random.default_rng(1).standard_normal((5, 16)).astype(np.float32)
    twice = rope.rotate(rope.rotate(k, 3), 4)
    assert np.allclose(twice, rope.rotate(k, 7), atol=1e-5)
    assert np.allclose(np.linalg.norm(rope.rotate(k, 11), axis=1), np.linalg.norm(k, axis=1), atol=1e-5)
    assert np.allclose(rope.rotate(rope.rotate(k, 5), -5), k, atol=1e-5)


@pytest.mark.parametrize("field, value, words", [
    ("blend_recompute_ratio", 1.5, "KVB_BLEND_RECOMPUTE_RATIO"),
    ("blend_select_layers", 0, "KVB_BLEND_SELECT_LAYERS"),
    ("blend_gate", -0.1, "KVB_BLEND_GATE"),
    ("blend_recompute_at", "middle", "deviation"),
])
def test_bad_blend_settings_are_refused_by_name(field, value, words):
    problems = Settings().replace(**{field: value}).validate()
    assert any(words in p for p in problems), problems


@pytest.fixture(scope="module")
def engine(make_module_settings):
    settings = make_module_settings(ctx_size=4096, n_predict=8, blend_select_layers=3)
    with CachedEngine(settings, LlamaCppBackend(settings)) as e:
        as_fresh(e)
        yield e


@pytest.fixture(scope="module")
def prompt(engine):
    """One RAG prompt of 4 passages with every segment stored (each computed after the instruction)."""
    runner = engine._blend_runner()
    rag = build_prompts(load_corpus(), engine.settings.blend_separator, n_prompts=1, n_passages=4)[0]
    p = engine.prepare(rag.messages)
    runner.run(p.tokens, p.segments, recompute=0, n_predict=1)
    return [int(t) for t in p.tokens], list(p.segments)


def test_selection_picks_the_tokens_a_cold_prefill_says_deviate_most(engine, prompt):
    runner = engine._blend_runner()
    tokens, starts = prompt
    spans = segment_spans(starts, len(tokens))
    shifted = spans[2:-1]
    rows = np.concatenate([np.arange(a, b) for a, b in shifted])
    count = round(0.15 * len(rows))
    result = BlendResult()
    placed = []
    runner._place_fixed(tokens, starts, 0, result, answer=ANSWER, scratch=1, reuse=True, recompute_at="end",
                        run_seqs=(), shifted=placed)
    runner.ctx.seq_rm(ANSWER)
    prefix = [p for p in placed if p.start == p.computed_at]
    placed = [p for p in placed if p.start != p.computed_at]
    assert [(p.start, p.end) for p in prefix] == spans[:2]      # the instruction and first passage, unshifted
    assert [(p.start, p.end) for p in placed] == shifted
    selection = runner._selector().select(tokens, placed, count, prefix)
    assert selection.with_k, "layer 0's K, rotated by the shift, must equal the fresh K (our RoPE is llama.cpp's)"
    assert len(selection.positions) == count and selection.pass_ms > 0
    # the same deviation measured the slow way: a full cold prefill against the blended, shifted cells
    cold, blend, _ = cold_and_blend_states(runner, tokens, starts)
    dk, dv = deviations(cold, blend, rows)
    layer = runner._selector().layer
    truth = dk[layer] + dv[layer]
    truth_top = set(rows[np.argsort(-truth)[:count]].tolist())
    chosen = set(selection.positions.tolist())
    overlap = len(chosen & truth_top) / count
    assert overlap >= 0.8, f"the selection found {overlap:.0%} of the most deviant tokens"
    # what a selection that ignores deviation would find: each passage's first or last 15 %
    lens = [b - a for a, b in shifted]
    for at_end in (True, False):
        fixed = {int(rows[i]) for i in edge_rule(lens, 0.15, at_end)}
        assert len(fixed & truth_top) / count < overlap - 0.2
    # and the deviation the kept tokens carry is what the gate reads: the top ones taken out
    assert 0 < selection.drift < truth.mean()
    # the instruction and first passage restored in the pass rather than decoded: the same choice
    decoded = runner._selector().select(tokens, placed, count)
    assert len(set(decoded.positions.tolist()) & chosen) >= 0.9 * count


def test_deviation_rule_recomputes_the_ratio_and_answers(engine, prompt):
    runner = engine._blend_runner()
    tokens, starts = prompt
    spans = segment_spans(starts, len(tokens))
    n_shifted = sum(b - a for a, b in spans[2:-1])
    shift = runner.run(tokens, starts, recompute=0, n_predict=8, store=False)
    for ratio in (0.15, 0.3):
        b = runner.run(tokens, starts, recompute=0, n_predict=8, store=False, recompute_at="deviation", ratio=ratio)
        assert shift.reused_tokens - b.reused_tokens == round(ratio * n_shifted)
        assert b.recomputed_tokens == len(tokens) - b.reused_tokens
        assert b.recomputed_runs >= 1 and b.selection_ms > 0 and b.drift is not None
        assert not b.fell_back and b.tokens


def test_every_shifted_token_recomputed_holds_the_prompts_own_kv(engine, prompt):
    """Ratio 1: every shifted passage recomputed in context after the reused instruction and first passage. The
    recomputed cells must replace the stored ones where they stand: the answer's KV is then the prompt's own
    (cold's, up to the rounding of another batch shape), where the shift alone leaves it far off."""
    runner = engine._blend_runner()
    tokens, starts = prompt
    spans = segment_spans(starts, len(tokens))
    rows = np.concatenate([np.arange(a, b) for a, b in spans[2:-1]])
    cold, shifted, _ = cold_and_blend_states(runner, tokens, starts)
    _, full, result = cold_and_blend_states(runner, tokens, starts, recompute_at="deviation", ratio=1.0,
                                            run_seqs=range(2, 10))
    assert result.recomputed_runs == 1 and full.n_cells == len(tokens)
    last = cold.geometry.n_layer - 1
    dk_full, dv_full = deviations(cold, full, rows)
    dk_shift, dv_shift = deviations(cold, shifted, rows)
    assert dv_full[last].mean() < dv_shift[last].mean() / 5
    assert dk_full[last].mean() < dk_shift[last].mean() / 5
    prefix = runner.run(tokens, starts, recompute=0, n_predict=2, store=False, prefix_only=True)
    again = runner.run(tokens, starts, recompute=0, n_predict=2, store=False, recompute_at="deviation", ratio=1.0)
    assert again.reused_tokens == prefix.reused_tokens and again.tokens[:1] == prefix.tokens[:1]


def test_gate_falls_back_to_prefix_reuse_above_its_threshold_only(engine, prompt):
    runner = engine._blend_runner()
    tokens, starts = prompt
    prefix = runner.run(tokens, starts, recompute=0, n_predict=8, store=False, prefix_only=True)
    low = runner.run(tokens, starts, recompute=0, n_predict=8, store=False, recompute_at="deviation", ratio=0.15,
                     gate=1e-6)
    assert low.fell_back and low.drift > 1e-6
    assert low.reused_tokens == prefix.reused_tokens and low.tokens == prefix.tokens
    high = runner.run(tokens, starts, recompute=0, n_predict=8, store=False, recompute_at="deviation", ratio=0.15,
                      gate=10.0)
    assert not high.fell_back and high.reused_tokens > prefix.reused_tokens


def test_the_record_says_the_gate_fell_back(engine, tmp_path):
    rag = build_prompts(load_corpus(), engine.settings.blend_separator, n_prompts=1, n_passages=4)[0]
    gated = engine.settings.replace(blend_recompute_at="deviation", blend_recompute_ratio=0.15, blend_gate=1e-6,
                                    l2_dir=str(tmp_path / "l2"))
    with CachedEngine(gated, LlamaCppBackend(gated)) as e:
        first = e.infer(rag.messages, "blend", 4)      # stores the passages: nothing to place yet
        record = e.infer(rag.messages, "blend", 4)
    assert not first.error and not first.blend_fallback and first.blend_drift is None
    assert not record.error, record.error
    assert record.blend_fallback and record.blend_drift > 1e-6
    assert record.miss_reason == ""               # a fallback is not a miss
    assert "gate fell back" in record.notes
