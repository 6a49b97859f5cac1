"""Where a restore stops, so the engine prefills the rest of the prompt with its cold run's arithmetic.

Place in the flow: chunk hashes -> lookup -> fetch + confirm (ChunkKV.find_prefix, **cut here**) -> assemble
-> restore -> the engine prefills the rest -> generate.

A restore hands the engine KV computed as a cold run computed it; the promise is that greedy output after it
equals the cold output token for token. That holds only when the tokens the engine still computes go through
the same kernels as in the cold run. llama.cpp's CPU kernels choose their arithmetic by a batch's rows
(Docs/Research.md §26, `kvbridge.bench.probes.cut_probe`):
- one row alone takes the matrix-vector kernels (with f16 K/V the K·Q product too), which round differently
  from the rows of a prefill batch: restoring "all but the last token" changed SmolLM2's answer to a
  near-tie question ("south orchard, week 4" cold, "north orchard, week 3" warm);
- repacked quantised weights (Gemma 3's Q4_K on AVX2) multiply four rows at a time and the rows left over
  one by one, counted from the batch's first row: a batch that starts off that grid, or ends with a few
  rows, computes some rows another way.
Both engines (llama-cpp-python and llama-server) prefill in pieces of BATCH_TOKENS from position 0 and, after a
restore, the rest of the prompt as pieces from the restored position. So a restore ends at the start of the
prompt's last prefill piece, or inside it at a multiple of GRID tokens that leaves GRID or more of it: every
position the cut probe measured there gave logits bit-equal to one piece, on SmolLM2 and Gemma 3, 1 and 2
threads. A stored prefix is cut to the grid as well: the last rows of the prompt that stored it may have been
computed as leftover rows (a cold run of a longer prompt computes them inside a group).

The cost: 8 to 15 tokens a warm request computes instead of 1 (a few milliseconds), and a prompt under
2 × GRID tokens is computed whole. A recurrent state cannot be cut by position; those models keep their own
rule (the whole stored piece, ending one token before the prompt's end).
"""
from __future__ import annotations

from kvbridge.backends.base import BATCH_TOKENS

GRID = 8   # a restore ends on this grid, with at least this many tokens of the last prefill piece left


def restorable(n_prompt: int) -> int:
    """The most of an `n_prompt`-token prompt a restore may give: the start of its last prefill piece, or the
    last multiple of GRID inside that piece that leaves GRID or more tokens to compute."""
    if n_prompt < 1:
        return 0
    piece_start = (n_prompt - 1) // BATCH_TOKENS * BATCH_TOKENS
    return max(piece_start, on_grid(n_prompt - GRID))


def on_grid(n_tokens: int) -> int:
    """`n_tokens` restorable tokens brought down to the grid (prefill pieces start on it too)."""
    return max(0, n_tokens) // GRID * GRID
