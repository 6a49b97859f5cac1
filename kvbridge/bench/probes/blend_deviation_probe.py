"""How far blend's reused KV deviates from cold's, per token and layer: where in a passage, and whether an
early layer ranks the tokens that deviate most at the last layer (CacheBlend's premise).

    python -m kvbridge.bench.probes.blend_deviation_probe                  # 6 prompts of 4 passages
    python -m kvbridge.bench.probes.blend_deviation_probe --prompts 12 --passages 6

Place in the flow: the RAG corpus (kvbridge.bench.rag) -> per prompt: its segments stored when not stored
yet (each computed after the instruction alone, as blend stores it) -> in the blend runner's context:
**cold** (every token decoded; its
sequence state read with kvbridge.formats.llama_state) and **blended** (BlendRunner.place with nothing
recomputed, the question decoded after it so llama.cpp applies the K shift, the state read the same
way) -> per reused token (passages after the first; the instruction and the first passage stand where
they were computed), per layer: |KV_blend - KV_cold| / |KV_cold| over the token's whole K (and V) row.

Reported: the mean deviation by relative position within a passage (fifths, and its first and last 8
tokens), where the top 15 % tokens of the last layer stand, and how well each early layer's K deviation
finds those tokens (recall of its own top 15 %, Spearman rank correlation) beside the fixed rules
(each passage's last or first 15 %, what KVB_BLEND_RECOMPUTE_AT=end|start recompute).

Left out: no cb_eval selection pass (the early layers' deviation is read from a full cold prefill,
which a real selection could not afford; this only asks whether such a pass would pick the right tokens).
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvbridge.bench.common.report import write_result_json
from kvbridge.bench.rag import DEFAULT_SEED, build_prompts, load_corpus, wants_completion
from kvbridge.blend.result import BlendResult
from kvbridge.blend.runner import ANSWER, PIN, BlendRunner
from kvbridge.blend.selection import FLOAT_TYPES as _FLOATS, relative_deviation
from kvbridge.engine.segments import segment_spans
from kvbridge.formats.llama_state import ParsedState, parse_state
from kvbridge.settings import Settings
from kvbridge.settings.cmdline import Parser

SHARE = 0.15          # CacheBlend recomputes ~15 % of the reused tokens
EDGE = 8              # "first/last tokens" of a passage
FIFTHS = 5



def layer_rows(state: ParsedState, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(K, V) of one layer as float32 (n_cells, row), V untransposed; f32/f16 caches only."""
    g = state.geometry
    k_type, v_type = g.k_types[layer], g.v_types[layer]
    if k_type not in _FLOATS or v_type not in _FLOATS:
        raise SystemExit("the deviation probe reads f16 or f32 KV only (KVB_CACHE_TYPE_K/V)")
    k = state.k[layer].view(_FLOATS[k_type]).astype(np.float32)
    v = state.v[layer]
    if g.v_trans:    # (n_embd, n_cells, el) -> (n_cells, n_embd)
        v = np.ascontiguousarray(v.transpose(1, 0, 2)).reshape(state.n_cells, -1)
    v = v.view(_FLOATS[v_type]).astype(np.float32)
    return k, v


def deviations(cold: ParsedState, blend: ParsedState, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(K, V) deviation per layer and row: arrays (n_layer, len(rows))."""
    n_layer = cold.geometry.n_layer
    dk = np.empty((n_layer, len(rows)), np.float64)
    dv = np.empty_like(dk)
    for layer in range(n_layer):
        kc, vc = layer_rows(cold, layer)
        kb, vb = layer_rows(blend, layer)
        dk[layer] = relative_deviation(kb[rows], kc[rows])
        dv[layer] = relative_deviation(vb[rows], vc[rows])
    return dk, dv


def top(values: np.ndarray, share: float = SHARE) -> set[int]:
    n = max(1, round(share * len(values)))
    return set(np.argsort(-values, kind="stable")[:n].tolist())


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def edge_rule(passage_lens: Sequence[int], share: float, at_end: bool) -> set[int]:
    """Indices (into the reused tokens, passages in order) a fixed rule recomputes: each passage's last/first share."""
    chosen, base = set(), 0
    for n in passage_lens:
        r = max(1, round(share * n))
        chosen.update(range(base + n - r, base + n) if at_end else range(base, base + r))
        base += n
    return chosen


@dataclass
class PromptDeviation:
    passage_lens: list[int]
    dk: np.ndarray     # (n_layer, reused tokens)
    dv: np.ndarray
    outside_max: float   # largest deviation where none may be (instruction, first passage): a placement check
    fields: dict = field(default_factory=dict)


def cold_and_blend_states(runner: BlendRunner, tokens: list[int], starts: Sequence[int],
                          **place) -> tuple[ParsedState, ParsedState, BlendResult]:
    """The answer sequence's state after a cold prefill, and after blend's placement (`place`: its keywords,
    default nothing recomputed) with the question decoded, which applies llama.cpp's pending K shift."""
    ctx = runner.ctx
    runner.run(tokens, starts, recompute=0, n_predict=1, reuse=False, store=False)
    cold = parse_state(ctx.save_seq(ANSWER))
    ctx.seq_rm(ANSWER)
    result = BlendResult()
    placement = runner.place(tokens, starts, 0, result, **{"pin": PIN, **place})
    runner._flush(placement.pending, placement.kv_tokens, result, ANSWER)
    blend = parse_state(ctx.save_seq(ANSWER))
    ctx.seq_rm(ANSWER)
    return cold, blend, result


def measure_prompt(runner: BlendRunner, tokens: list[int], starts: Sequence[int]) -> PromptDeviation:
    cold, blend, result = cold_and_blend_states(runner, tokens, starts)
    spans = segment_spans(starts, len(tokens))
    if blend.n_cells != len(tokens) or cold.n_cells != len(tokens):
        raise RuntimeError(f"expected {len(tokens)} cells, cold {cold.n_cells}, blended {blend.n_cells}")
    if result.reused_segments < len(spans) - 1:
        raise RuntimeError(f"only {result.reused_segments} of {len(spans) - 1} segments were found stored")
    reused = spans[2:-1]
    rows = np.concatenate([np.arange(a, b) for a, b in reused])
    dk, dv = deviations(cold, blend, rows)
    fixed = np.arange(0, spans[1][1])
    fk, fv = deviations(cold, blend, fixed)
    return PromptDeviation([b - a for a, b in reused], dk, dv, float(max(fk.max(), fv.max())))


def summarise(prompts: list[PromptDeviation], early_layers: Sequence[int]) -> dict:
    n_layer = prompts[0].dk.shape[0]
    last = n_layer - 1
    # where in a passage: fifths, first/last EDGE tokens, at layer 1 and at the last layer (K and V)
    where: dict[str, dict[str, list[float]]] = {}
    top_share = {"first fifth": [], "last fifth": []}
    recall: dict[str, list[float]] = {}
    rho: dict[str, list[float]] = {}
    for p in prompts:
        truth = p.dk[last] + p.dv[last]
        truth_top = top(truth)
        rel = np.concatenate([np.arange(n) / n for n in p.passage_lens])
        pos = np.concatenate([np.arange(n) for n in p.passage_lens])
        from_end = np.concatenate([n - 1 - np.arange(n) for n in p.passage_lens])
        bins = {f"fifth {i + 1}": (rel >= i / FIFTHS) & (rel < (i + 1) / FIFTHS) for i in range(FIFTHS)}
        bins[f"first {EDGE}"] = pos < EDGE
        bins[f"last {EDGE}"] = from_end < EDGE
        for name, mask in bins.items():
            row = where.setdefault(name, {})
            for label, values in (("k1", p.dk[1]), ("v1", p.dv[1]), ("k_last", p.dk[last]), ("v_last", p.dv[last])):
                row.setdefault(label, []).append(float(values[mask].mean()))
        idx = np.array(sorted(truth_top))
        top_share["first fifth"].append(float((rel[idx] < 0.2).mean()))
        top_share["last fifth"].append(float((rel[idx] >= 0.8).mean()))
        picks = {f"layer {l} K": top(p.dk[l]) for l in early_layers}
        picks.update({f"layer {l} K+V": top(p.dk[l] + p.dv[l]) for l in early_layers})
        picks["end rule (last 15 %)"] = edge_rule(p.passage_lens, SHARE, True)
        picks["start rule (first 15 %)"] = edge_rule(p.passage_lens, SHARE, False)
        for name, chosen in picks.items():
            recall.setdefault(name, []).append(len(chosen & truth_top) / len(truth_top))
        for l in early_layers:
            rho.setdefault(f"layer {l} K", []).append(spearman(p.dk[l], truth))
    by_layer = [{"layer": l, "k": statistics.fmean(float(p.dk[l].mean()) for p in prompts),
                 "v": statistics.fmean(float(p.dv[l].mean()) for p in prompts)} for l in range(n_layer)]
    mean = lambda xs: statistics.fmean(xs)   # noqa: E731
    return {"prompts": len(prompts), "reused_tokens": statistics.fmean(sum(p.passage_lens) for p in prompts),
            "outside_max": max(p.outside_max for p in prompts),
            "by_layer": by_layer,
            "by_position": {name: {k: mean(v) for k, v in row.items()} for name, row in where.items()},
            "last_layer_top15_in": {k: mean(v) for k, v in top_share.items()},
            "recall_of_last_layer_top15": {k: mean(v) for k, v in recall.items()},
            "spearman_with_last_layer": {k: mean(v) for k, v in rho.items()}}


def format_summary(s: dict) -> str:
    lines = [f"{s['prompts']} prompts, {s['reused_tokens']:.0f} reused (shifted) tokens each; largest deviation "
             f"where the KV must be cold's (instruction, first passage): {s['outside_max']:.2e}",
             "mean relative deviation by layer (K, V):"]
    lines.append("  " + "  ".join(f"L{r['layer']} {r['k']:.3f}/{r['v']:.3f}" for r in s["by_layer"]))
    lines.append("by position within a passage:     K L1    V L1   K last  V last")
    for name, row in s["by_position"].items():
        lines.append(f"  {name:<28} {row['k1']:7.3f} {row['v1']:7.3f} {row['k_last']:7.3f} {row['v_last']:7.3f}")
    t = s["last_layer_top15_in"]
    lines.append(f"the last layer's top 15 % (K+V): {t['first fifth']:.0%} in passages' first fifth, "
                 f"{t['last fifth']:.0%} in their last fifth")
    lines.append("recall of the last layer's top 15 % by each selection (15 % of reused tokens; random = 15 %):")
    for name, value in s["recall_of_last_layer_top15"].items():
        lines.append(f"  {name:<28} {value:.0%}")
    lines.append("Spearman rank correlation with the last layer's deviation:")
    for name, value in s["spearman_with_last_layer"].items():
        lines.append(f"  {name:<28} {value:+.2f}")
    return "\n".join(lines)


def measure(engine, n_prompts: int, n_passages: int, seed: int = DEFAULT_SEED,
            early_layers: Sequence[int] = (1, 2, 3), progress=print) -> dict:
    runner = engine._blend_runner()
    corpus = load_corpus()
    prompts = build_prompts(corpus, engine.settings.blend_separator, n_prompts=n_prompts, n_passages=n_passages,
                            seed=seed, completion=wants_completion(engine))
    measured = []
    for i, prompt in enumerate(prompts):
        p = engine.prepare(prompt.request)
        # store what is not stored yet: each segment from its own prefill after the instruction, as blend stores
        # it, so which prompt stores a passage does not change its stored KV
        runner.run(p.tokens, p.segments, recompute=0, n_predict=1)
        measured.append(measure_prompt(runner, list(p.tokens), p.segments))
        progress(f"  prompt {i + 1}/{n_prompts}")
    return summarise(measured, early_layers)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m kvbridge.bench.probes.blend_deviation_probe", description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=6, help="measured RAG prompts")
    parser.add_argument("--passages", type=int, default=4, help="passages per prompt (at least 3: two are not shifted)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    if args.passages < 3:
        raise SystemExit(f"--passages needs at least 3 (the first passage is not shifted), got {args.passages}")
    from kvbridge.backends.llamacpp import LlamaCppBackend
    from kvbridge.engine.cached_engine import CachedEngine

    base = Settings.from_env()
    problems = base.validate()
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvb-blend-deviation-") as l2:
        settings = base.replace(ctx_size=max(base.ctx_size, 4096), l2_dir=l2)
        with CachedEngine(settings, LlamaCppBackend(settings)) as engine:
            print(f"blend deviation probe: {engine.backend.describe()}", flush=True)
            summary = measure(engine, args.prompts, args.passages, args.seed)
    print(format_summary(summary))
    path = write_result_json({"command": "blend-deviation-probe", "settings": vars(args), **summary},
                             base.output_dir, "blend_deviation")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
