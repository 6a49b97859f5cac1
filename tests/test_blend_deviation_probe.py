"""The blend deviation probe (kvbridge.bench.probes.blend_deviation_probe): its arithmetic on hand-made rows,
and on the real model the facts its Research §39 figures rest on: layer 0 of a shifted passage is cold's
(V byte for byte: it depends on the token alone), deeper layers are not, and the deviation sits at a
passage's first tokens, not its last (so a selection by the end rule finds fewer of the most deviant
tokens than the start rule does)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import as_fresh
from kvbridge.backends.llamacpp import LlamaCppBackend
from kvbridge.bench.probes.blend_deviation_probe import (edge_rule, layer_rows, measure_prompt, relative_deviation,
                                                         summarise, top)
from kvbridge.bench.rag import build_prompts, load_corpus
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.formats.llama_state import KVGeometry, ParsedState


def test_relative_deviation_golden():
    cold = np.array([[3.0, 4.0], [1.0, 0.0]], np.float32)
    blend = np.array([[3.0, 4.0], [1.0, 1.0]], np.float32)
    assert relative_deviation(blend, cold).tolist() == [0.0, 1.0]


def test_edge_rules_pick_each_passages_last_or_first_share():
    assert edge_rule([10, 20], 0.1, at_end=True) == {9, 28, 29}
    assert edge_rule([10, 20], 0.1, at_end=False) == {0, 10, 11}
    assert top(np.array([0.1, 0.9, 0.5, 0.8]), 0.5) == {1, 3}


def test_layer_rows_untransposes_v():
    n_cells, n_embd = 3, 2
    v = np.arange(n_cells * n_embd, dtype=np.float16).reshape(n_embd, n_cells)   # llama.cpp's transposed V
    geometry = KVGeometry(v_trans=1, n_layer=1, k_types=(1,), k_rows=(4,), v_types=(1,), v_rows=(4,), v_els=(2,),
                          v_embds=(n_embd,))
    k = np.ones((n_cells, n_embd), np.float16).view(np.uint8)
    state = ParsedState(geometry, 0, n_cells, [k], [v.view(np.uint8).reshape(n_embd, n_cells, 2)])
    k_rows, v_rows = layer_rows(state, 0)
    assert k_rows.shape == (3, 2) and (k_rows == 1).all()
    assert v_rows.tolist() == v.T.astype(np.float32).tolist()


@pytest.fixture(scope="module")
def engine(make_module_settings):
    settings = make_module_settings(ctx_size=4096, n_predict=8)
    with CachedEngine(settings, LlamaCppBackend(settings)) as e:
        as_fresh(e)
        yield e


def test_shifted_passages_deviate_at_their_first_tokens(engine):
    runner = engine._blend_runner()
    prompt = build_prompts(load_corpus(), engine.settings.blend_separator, n_prompts=1, n_passages=4)[0]
    p = engine.prepare(prompt.messages)
    runner.run(p.tokens, p.segments, recompute=0, n_predict=1)   # stores every segment, each after the instruction
    measured = measure_prompt(runner, list(p.tokens), p.segments)
    assert measured.dv[0].max() == 0.0                 # layer 0's V: the token alone, moved untouched
    assert measured.dk[0].max() < 5e-3                 # layer 0's K: re-rotated, within f16 rounding
    assert measured.dk[1].mean() > 20 * max(measured.dk[0].mean(), 1e-5)   # layer 1 sees the stale context
    # the instruction and the first passage stand where they were computed: only batch-shape rounding there
    assert measured.outside_max < 0.25
    s = summarise([measured], early_layers=(1, 2))
    assert s["by_position"]["first 8"]["v_last"] > s["by_position"]["last 8"]["v_last"]
    recall = s["recall_of_last_layer_top15"]
    assert recall["start rule (first 15 %)"] > recall["end rule (last 15 %)"]
    assert recall["layer 2 K"] > 0.15                 # better than a random 15 % pick
