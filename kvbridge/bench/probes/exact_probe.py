"""What a solo run's arithmetic depends on in llama.cpp's CPU kernels, measured bit for bit (issue 37).

`python -m kvbridge.bench.probes.exact_probe` (KVB_MODEL / KVB_CACHE_TYPE_K/V pick the model and K/V type)
prints two tables; kvbridge.scheduler.exact is built on what they show (Docs/Research.md §25):

1. Decoding together: five sequences (random token prompts of 37 to 300 tokens, each prefilled in a call of
   its own) decode 12 steps in calls of `width` sequences, in the unified cache (every sequence's cells in
   one pool, as the scheduler's mode off keeps them) and in a non-unified one (a stream per sequence, as
   exact mode keeps them). For each sequence: the steps whose logits equal, bit for bit, those of the same
   prompt decoded alone in a fresh context, and the steps whose greedy token does.
2. Cutting the prefill: one 300-token prompt prefilled in pieces cut at the positions listed, then 6
   decode steps; whether every step's logits equal those of the prompt prefilled in one piece.

No scheduler and no store: llama.cpp's own numerics, through kvbridge.backends.llama_context.
"""
from __future__ import annotations

import numpy as np

from kvbridge.backends.llama_context import LlamaContext
from kvbridge.settings import Settings

LENGTHS = (37, 70, 129, 300, 45)
STEPS = 12
WIDTHS = (1, 2, 3, 4, 5)
CUTS = ([96], [97], [4, 8], [8], [296], [292], [299], [128, 256], [32, 64, 96, 128, 160, 192, 224, 256, 288])


def prompts(n_vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [[int(t) for t in rng.integers(100, min(n_vocab, 20000), size=n)] for n in LENGTHS]


def decode(ctx, tokens, start: int, seq: int) -> np.ndarray:
    entries = [(t, start + i, seq, i == len(tokens) - 1) for i, t in enumerate(tokens)]
    if ctx.decode(entries) != 0:
        raise RuntimeError("llama_decode found no room")
    return ctx.logits(len(tokens) - 1)


def solo(settings: Settings, prompt: list[int], steps: int, cuts=()) -> list[np.ndarray]:
    """The prompt alone in a fresh context: prefilled in pieces cut at `cuts`, then `steps` greedy decodes."""
    ctx = LlamaContext(settings, 1024, 1)
    try:
        bounds = [0, *cuts, len(prompt)]
        for a, b in zip(bounds, bounds[1:]):
            out = decode(ctx, prompt[a:b], a, 0)
        outs, n = [out], len(prompt)
        for _ in range(steps):
            out = decode(ctx, [int(np.argmax(outs[-1]))], n, 0)
            outs.append(out)
            n += 1
        return outs
    finally:
        ctx.close()


def together(settings: Settings, prompts_: list[list[int]], width: int, exact: bool) -> list[list[np.ndarray]]:
    ctx = LlamaContext(settings, 1024, len(prompts_), exact=exact)
    try:
        outs = [[decode(ctx, p, 0, s)] for s, p in enumerate(prompts_)]
        n = [len(p) for p in prompts_]
        for _ in range(STEPS):
            for g in range(0, len(prompts_), width):
                group = list(range(g, min(g + width, len(prompts_))))
                if ctx.decode([(int(np.argmax(outs[s][-1])), n[s], s, True) for s in group]) != 0:
                    raise RuntimeError("llama_decode found no room")
                for j, s in enumerate(group):
                    outs[s].append(ctx.logits(j))
                    n[s] += 1
        return outs
    finally:
        ctx.close()


def probe_settings() -> tuple[Settings, int]:
    """The probes' settings (the environment's model and K/V type, a 1,024-token context, flash attention off)
    and the model's vocabulary size, read from a small context opened and closed at once."""
    settings = Settings.from_env().replace(ctx_size=1024, flash_attn=False)
    probe = LlamaContext(settings, 256, 1)
    try:
        return settings, probe.n_vocab
    finally:
        probe.close()


def main() -> None:
    settings, n_vocab = probe_settings()
    prompts_ = prompts(n_vocab)
    reference = [solo(settings, p, STEPS) for p in prompts_]
    print(f"{settings.model_path or settings.model}, K/V {settings.cache_type_k}/{settings.cache_type_v}, "
          f"{settings.resolved_threads()} threads")
    print(f"decoding together: of {STEPS + 1} steps per sequence (prompts of {', '.join(map(str, LENGTHS))} tokens), "
          "the ones bit-equal to a solo run / with its greedy token")
    for exact in (False, True):
        for width in WIDTHS:
            outs = together(settings, prompts_, width, exact)
            bits = [sum(np.array_equal(a, b) for a, b in zip(o, r)) for o, r in zip(outs, reference)]
            tokens = [sum(int(np.argmax(a) == np.argmax(b)) for a, b in zip(o, r)) for o, r in zip(outs, reference)]
            cache = "a stream per sequence" if exact else "unified cache       "
            print(f"  {cache}  width {width}: bit-equal {bits}  same token {tokens}")
    long_prompt = prompts_[3]
    whole = solo(settings, long_prompt, 6)
    print(f"cutting the prefill of a {len(long_prompt)}-token prompt: every step bit-equal to one piece?")
    for cuts in CUTS:
        outs = solo(settings, long_prompt, 6, cuts)
        same = all(np.array_equal(a, b) for a, b in zip(outs, whole))
        pieces = np.diff([0, *cuts, len(long_prompt)]).tolist()
        print(f"  cut at {cuts} (pieces {pieces}): {'yes' if same else 'no'}")


if __name__ == "__main__":
    main()
