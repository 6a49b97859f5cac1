"""Where a restore may end so the engine's answer equals its cold run's, measured bit for bit (cold_cut).

`python -m kvbridge.bench.probes.cut_probe` (KVB_MODEL, KVB_CACHE_TYPE_K/V and KVB_THREADS pick what is probed)
prints, for random-token prompts of several lengths, every restore end in the prompt's last WINDOW positions
whose answer differs from the cold run's, and whether kvbridge.engine.cold_cut's end is bit-equal
(Docs/Research.md §26).

A restore of `cut` tokens is what the engine does after one: the prompt is prefilled cold in the engine's
pieces (BATCH_TOKENS from position 0), its cells from `cut` on are removed, the rest of the prompt is prefilled
again as one piece from `cut` (the cells before it are bit for bit the cold run's, as restored ones are), and
STEPS greedy tokens are decoded. "Equal" means the logits of the prompt's last token and of every step equal
the cold run's bit for bit.
"""
from __future__ import annotations

import numpy as np

from kvbridge.backends.base import BATCH_TOKENS
from kvbridge.backends.llama_context import LlamaContext
from kvbridge.bench.probes.exact_probe import probe_settings
from kvbridge.engine.cold_cut import restorable
from kvbridge.settings import Settings

LENGTHS = (45, 130, 301, 555)
WINDOW = 40      # restore ends probed: the prompt's last WINDOW positions (inside its last prefill piece)
STEPS = 3


def prefill(ctx: LlamaContext, tokens: list[int], start: int) -> np.ndarray:
    """tokens[start:] prefilled in pieces of BATCH_TOKENS counted from `start`; the last token's logits."""
    for a in range(start, len(tokens), BATCH_TOKENS):
        piece = tokens[a:a + BATCH_TOKENS]
        if ctx.decode([(t, a + i, 0, i == len(piece) - 1) for i, t in enumerate(piece)]) != 0:
            raise RuntimeError("llama_decode found no room")
    return ctx.logits(len(tokens[start:]) - 1 - (len(tokens) - 1 - start) // BATCH_TOKENS * BATCH_TOKENS)


def answer(ctx: LlamaContext, first: np.ndarray, n: int) -> list[np.ndarray]:
    """The prompt's last logits and STEPS greedy decodes after them."""
    outs = [first]
    for step in range(STEPS):
        if ctx.decode([(int(np.argmax(outs[-1])), n + step, 0, True)]) != 0:
            raise RuntimeError("llama_decode found no room")
        outs.append(ctx.logits(0))
    return outs


def restored_answer(ctx: LlamaContext, tokens: list[int], cut: int) -> list[np.ndarray]:
    """The answer after a restore of tokens[:cut] computed as a cold run computes them (cut == len: cold)."""
    ctx.seq_rm(0, 0, -1)
    first = prefill(ctx, tokens, 0)
    if cut < len(tokens):
        ctx.seq_rm(0, cut, -1)
        first = prefill(ctx, tokens, cut)
    return answer(ctx, first, len(tokens))


def differing_cuts(settings: Settings, tokens: list[int], cuts: list[int] | None = None) -> list[int]:
    """The restore ends (`cuts`, default the last WINDOW positions) whose answer is not bit-equal to cold's."""
    n = len(tokens)
    ctx = LlamaContext(settings, 1024, 1)
    try:
        cold = restored_answer(ctx, tokens, n)
        differ = []
        for cut in cuts if cuts is not None else range(max(1, n - WINDOW), n):
            warm = restored_answer(ctx, tokens, cut)
            if not all(np.array_equal(a, b) for a, b in zip(warm, cold)):
                differ.append(cut)
        return differ
    finally:
        ctx.close()


def main() -> None:
    settings, n_vocab = probe_settings()
    rng = np.random.default_rng(7)
    print(f"{settings.model_path or settings.model}, K/V {settings.cache_type_k}/{settings.cache_type_v}, "
          f"{settings.resolved_threads()} threads: restore ends whose answer differs from cold (last {WINDOW} positions)")
    for n in LENGTHS:
        tokens = [int(t) for t in rng.integers(100, min(n_vocab, 20000), size=n)]
        differ = differing_cuts(settings, tokens)
        cut = restorable(n)
        print(f"  {n} tokens: {len(differ)} of {min(WINDOW, n - 1)} differ "
              f"({', '.join(f'{c} (-{n - c})' for c in differ) or 'none'}); "
              f"cold_cut ends at {cut}: {'DIFFERS' if cut in differ else 'equal'}")


if __name__ == "__main__":
    main()
