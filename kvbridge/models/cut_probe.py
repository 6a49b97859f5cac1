"""The smallest exact cut for this model, llama.cpp build, K/V type, batch size, thread count and CPU, measured
bit for bit (kvbridge.engine.cold_cut, Docs/Research.md §26 and §28).

`python -m kvbridge.models.cut_probe [--save]` (or `kvbridge cut-probe`; KVB_MODEL, KVB_CACHE_TYPE_K/V,
KVB_FLASH_ATTN and KVB_THREADS pick what is probed) prefills random-token prompts of several lengths cold, then,
for every restore end in each prompt's last WINDOW positions (and CROSS ends before its last prefill piece), does
what an engine does after a restore and compares with the cold run:
- **same prompt**: the cells before the cut are the cold run's own (a repeat of the prompt that stored them);
- **another prompt**: the rows of the cut's prefill piece were computed by a prompt that continued differently
  after the cut (the usual case: a stored document, a new question), by `other` tokens of a random length.
Then the rest of the prompt is prefilled as pieces from the cut, as llama.cpp prefills after a restore, and
"equal" means the sequence's whole KV state after the prompt, the prompt's last logits and STEPS greedy decodes'
logits equal the cold run's bit for bit. From the cuts that differ, `derive_rule` picks the finest grid, then the
fewest rows left to compute, under which no probed cut differs; `--save` keeps that verdict beside the build
record (kvbridge.engine.cut_verdicts), where CachedEngine finds it. It takes about a minute per model on two
cores: cuts are probed from the prompt's end backwards, so the cold cells before each cut are already there.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import numpy as np

from kvbridge.backends.base import BATCH_TOKENS
from kvbridge.backends.llama_context import LlamaContext
from kvbridge.backends.llama_cpp_model import model_path_for
from kvbridge.engine.cold_cut import DEFAULT_RULE, CutRule
from kvbridge.settings import Settings

LENGTHS = (45, 130, 301, 555)
WINDOW = 40      # restore ends probed at the prompt's end: its last WINDOW positions
CROSS = 12       # and this many ends just before the last prefill piece (prompts longer than a piece)
STEPS = 3        # greedy decode steps compared after the prompt
OTHER_MAX = 24   # "another prompt" continued for 0..OTHER_MAX tokens after the cut (0: it ended there)
GRIDS = (1, 2, 4, 8, 16, 32)
MAX_ROWS = 32    # the most rows a proven rule may leave to compute; beyond it only piece starts are trusted


@dataclass
class PromptProbe:
    """One prompt's probed restore ends and the ones whose answer differed from cold (either way)."""

    n: int
    cuts: list[int] = field(default_factory=list)
    differ: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"n": self.n, "cuts": [min(self.cuts), max(self.cuts)] if self.cuts else [],
                "n_cuts": len(self.cuts), "differ": self.differ}


def prefill(ctx: LlamaContext, tokens: list[int], start: int) -> np.ndarray:
    """tokens[start:] prefilled in pieces of BATCH_TOKENS counted from `start`; the last token's logits."""
    first = None
    for a in range(start, len(tokens), BATCH_TOKENS):
        piece = tokens[a:a + BATCH_TOKENS]
        if ctx.decode([(t, a + i, 0, i == len(piece) - 1) for i, t in enumerate(piece)]) != 0:
            raise RuntimeError("llama_decode found no room")
        first = ctx.logits(len(piece) - 1)
    return first


def _first_decodes(ctx: LlamaContext, tokens: list[int], last: np.ndarray) -> list[np.ndarray]:
    outs = [last]
    for step in range(STEPS):
        if ctx.decode([(int(np.argmax(outs[-1])), len(tokens) + step, 0, True)]) != 0:
            raise RuntimeError("llama_decode found no room")
        outs.append(ctx.logits(0))
    ctx.seq_rm(0, len(tokens), -1)
    return outs


def cold_run(ctx: LlamaContext, tokens: list[int]) -> tuple[bytes, list[np.ndarray]]:
    """The cold run's KV state after the prompt and its answer's logits (the context keeps the prompt's cells)."""
    ctx.seq_rm(0, 0, -1)
    last = prefill(ctx, tokens, 0)
    state = bytes(ctx.save_seq(0))
    return state, _first_decodes(ctx, tokens, last)


def same_as_cold(ctx: LlamaContext, tokens: list[int], last: np.ndarray, state: bytes,
                 cold: list[np.ndarray]) -> bool:
    """Whether the context, just prefilled to the prompt's end (`last`: its last logits), is the cold run."""
    if not np.array_equal(last, cold[0]) or bytes(ctx.save_seq(0)) != state:
        return False
    for step in range(STEPS):
        if ctx.decode([(int(np.argmax(cold[step])), len(tokens) + step, 0, True)]) != 0:
            raise RuntimeError("llama_decode found no room")
        if not np.array_equal(ctx.logits(0), cold[step + 1]):
            ctx.seq_rm(0, len(tokens), -1)
            return False
    ctx.seq_rm(0, len(tokens), -1)
    return True


def probe_cuts(ctx: LlamaContext, tokens: list[int], cuts: list[int], rng: np.random.Generator) -> list[int]:
    """The restore ends among `cuts` after which the engine's answer is not the cold one, either way."""
    n = len(tokens)
    state, cold = cold_run(ctx, tokens)
    cuts = sorted(set(c for c in cuts if 0 < c < n), reverse=True)
    differ = set()
    for c in cuts:   # the same prompt: cells [0, c) stay the cold run's from one cut to the next
        ctx.seq_rm(0, c, -1)
        if not same_as_cold(ctx, tokens, prefill(ctx, tokens, c), state, cold):
            differ.add(c)
    for c in cuts:   # another prompt: its piece holding the cut computed rows that continue differently
        piece = c // BATCH_TOKENS * BATCH_TOKENS   # the cells before it are the cold run's (the same pieces)
        other = tokens[:c] + [int(t) for t in rng.integers(100, 20000, size=int(rng.integers(0, OTHER_MAX + 1)))]
        ctx.seq_rm(0, piece, -1)
        prefill(ctx, other, piece)
        ctx.seq_rm(0, c, -1)
        if not same_as_cold(ctx, tokens, prefill(ctx, tokens, c), state, cold):
            differ.add(c)
    return sorted(differ)


def differing_cuts(settings: Settings, tokens: list[int], cuts: list[int]) -> list[int]:
    """probe_cuts in a context of its own (the tests' check of one rule's restore ends)."""
    ctx = LlamaContext(settings, max(1024, -(-(len(tokens) + STEPS + 1) // 256) * 256), 1)
    try:
        return probe_cuts(ctx, tokens, cuts, np.random.default_rng(len(tokens)))
    finally:
        ctx.close()


def cuts_for(n: int) -> list[int]:
    """The restore ends probed for an n-token prompt: its last WINDOW, and CROSS before its last prefill piece."""
    piece = (n - 1) // BATCH_TOKENS * BATCH_TOKENS
    tail = list(range(max(1, n - WINDOW), n))
    cross = list(range(max(1, piece - CROSS), piece)) if piece else []
    return cross + tail


def probe(settings: Settings, lengths: tuple[int, ...] = LENGTHS, seed: int = 7) -> tuple[list[PromptProbe], bool]:
    """Every length's probed and differing cuts, and whether the cold run repeats itself bit for bit (a build or
    thread count whose arithmetic varies run to run proves nothing)."""
    ctx = LlamaContext(settings, max(1024, -(-(max(lengths) + STEPS + 1) // 256) * 256), 1)
    try:
        rng = np.random.default_rng(seed)
        vocab = min(ctx.n_vocab, 20000)
        results, repeatable = [], True
        for n in lengths:
            tokens = [int(t) for t in rng.integers(100, vocab, size=n)]
            first, second = cold_run(ctx, tokens), cold_run(ctx, tokens)
            repeatable &= first[0] == second[0] and all(np.array_equal(a, b) for a, b in zip(first[1], second[1]))
            cuts = cuts_for(n)
            results.append(PromptProbe(n, cuts, probe_cuts(ctx, tokens, cuts, rng)))
        return results, repeatable
    finally:
        ctx.close()


def _allowed(rule: CutRule, n: int, c: int) -> bool:
    """Whether `rule` lets a restore of an n-token prompt end at c (the probe's cuts are all ≤ the store's reach)."""
    return rule.cut(c, n) == c


def derive_rule(results: list[PromptProbe], repeatable: bool = True, source: str = "") -> CutRule:
    """The finest grid, then the fewest rows left, under which no probed cut differed; piece starts only when none
    up to (32, MAX_ROWS) holds, and DEFAULT_RULE when the probe proved nothing (its runs did not repeat)."""
    if not repeatable or not results:
        return DEFAULT_RULE
    for grid in GRIDS:
        for rows in range(1, MAX_ROWS + 1):
            for crosses in (True, False):
                rule = CutRule(grid, rows, crosses, proven=True, source=source)
                if not any(_allowed(rule, r.n, c) for r in results for c in r.differ):
                    return rule
    return CutRule(BATCH_TOKENS, 1, False, proven=True, source=f"{source}; only prefill piece starts are exact")


def add_arguments(parser) -> None:
    parser.add_argument("--save", action="store_true", help="keep the verdict where engines find it")
    parser.add_argument("--if-missing", action="store_true",
                        help="with --save: do nothing when this model, build and CPU already have a verdict")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths probed")


def run(args) -> int:
    """`kvbridge cut-probe`: probe the configured model (KVB_MODEL, KVB_CACHE_TYPE_K/V, KVB_FLASH_ATTN,
    KVB_THREADS), print every differing restore end and the verdict, and keep it with --save."""
    from kvbridge.engine import cut_verdicts
    from kvbridge.errors import BadSettings

    settings = Settings.from_env()
    try:
        lengths = tuple(int(x) for x in args.lengths.split(",") if x.strip())
    except ValueError:
        lengths = ()
    if not lengths or min(lengths) < 2 or max(lengths) > 4 * BATCH_TOKENS:
        raise BadSettings(f"--lengths takes prompt lengths of 2 to {4 * BATCH_TOKENS} tokens separated by commas "
                          f"(default {','.join(map(str, LENGTHS))}); got {args.lengths!r}")
    key = cut_verdicts.verdict_key(settings, model_path_for(settings))
    if args.save and args.if_missing and cut_verdicts.load(key) is not None:
        print(f"{key['model_file']}: a cut verdict for this model, build and CPU is kept already; not probing again")
        return 0
    started = time.perf_counter()
    results, repeatable = probe(settings, lengths)
    seconds = time.perf_counter() - started
    rule = derive_rule(results, repeatable, source=cut_verdicts.source_line(key))
    print(f"{key['model_file']}, K/V {settings.cache_type_k}/{settings.cache_type_v}, flash attention "
          f"{'on' if settings.flash_attn else 'off'}, {settings.resolved_threads()} threads, {seconds:.0f} s"
          f"{'' if repeatable else ' — COLD RUNS DID NOT REPEAT: nothing proven'}")
    for r in results:
        shown = ", ".join(f"{c} (-{r.n - c})" for c in r.differ) or "none"
        print(f"  {r.n} tokens: {len(r.differ)} of {len(r.cuts)} restore ends differ: {shown}")
    print(f"verdict: {rule.describe()}; a cut before the last prefill piece "
          f"{'is allowed' if rule.crosses_pieces else 'goes back to the piece start'}")
    if args.save:
        print(f"saved: {cut_verdicts.save(key, rule, results, seconds)}")
    return 0


def main(argv: list[str] | None = None) -> None:
    from kvbridge.settings.cmdline import Parser

    parser = Parser(prog="python -m kvbridge.models.cut_probe", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
