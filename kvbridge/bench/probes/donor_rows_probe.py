"""Does a prefix's KV depend on the prompt it was computed in? (issue 47 §1, Research §35)

`python -m kvbridge.bench.probes.donor_rows_probe MODEL` (MODEL: smollm2-135m or gemma3-270m; f16 K/V, flash
attention off, KVB_THREADS threads)

A restore hands an engine chunks that another prompt computed, in a prefill batch of another length. This
computes a 700-token prompt of random ids and five shorter prompts sharing its first 4 to 256 tokens, each
cold from position 0 in pieces of 512, and compares the shared rows' K, layer by layer, bit for bit (a
sliding-window layer's rows where both states hold them).
"""
from __future__ import annotations

import sys

import numpy as np

from kvbridge.backends.llama_context import BATCH_TOKENS, LlamaContext
from kvbridge.backends.model_traits import traits_of_model
from kvbridge.formats.llama_state import parse_state
from kvbridge.settings import Settings

CASES = ((20, 4), (40, 32), (300, 256), (120, 64), (513, 256))   # (the shorter prompt's length, tokens shared)


def cold_state(ctx: LlamaContext, tokens: list[int], window: int):
    """`tokens` prefilled cold in sequence 0 (pieces of BATCH_TOKENS from 0), parsed; the sequence emptied."""
    for start in range(0, len(tokens), BATCH_TOKENS):
        piece = tokens[start:start + BATCH_TOKENS]
        assert ctx.decode([(t, start + i, 0, start + i == len(tokens) - 1) for i, t in enumerate(piece)]) == 0
    state = parse_state(bytes(ctx.save_seq(0)), window=window)
    ctx.seq_rm(0)
    return state


def differing_layers(a, b, shared: int) -> list[int]:
    """Layers whose K rows of positions < `shared` differ (a windowed layer: where both states hold them)."""
    out = []
    for layer in range(len(a.k)):
        start_a = a.window_start if layer in a.geometry.windowed_layers else 0
        start_b = b.window_start if layer in b.geometry.windowed_layers else 0
        lo = max(start_a, start_b)
        if lo >= shared:
            continue
        if not np.array_equal(np.asarray(a.k[layer])[lo - start_a:shared - start_a],
                              np.asarray(b.k[layer])[lo - start_b:shared - start_b]):
            out.append(layer)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    model = argv[0] if argv else "smollm2-135m"
    settings = Settings.from_env().replace(model=model, flash_attn=False)
    ctx = LlamaContext(settings, 2048, 1)
    window = traits_of_model(ctx.model).n_swa
    rng = np.random.default_rng(3)
    base = [int(t) for t in rng.integers(300, 20000, 700)]
    long = cold_state(ctx, base, window)
    for n_short, shared in CASES:
        short = cold_state(ctx, base[:shared] + [int(t) for t in rng.integers(300, 20000, n_short - shared)], window)
        diff = differing_layers(long, short, shared)
        print(f"{model}: positions 0..{shared - 1} computed in a {n_short}-token prompt against a 700-token one: "
              f"K differs in {len(diff)} of {len(long.k)} layers {diff[:6]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
