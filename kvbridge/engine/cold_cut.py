"""Where a restore stops, so the engine prefills the rest of the prompt with its cold run's arithmetic.

Place in the flow: chunk hashes -> lookup -> fetch + confirm (ChunkKV.find_prefix, **cut here**) -> assemble
-> restore -> the engine prefills the rest -> generate.

A restore hands the engine KV computed as a cold run computed it; the promise is that greedy output after it
equals the cold output token for token. That holds only when the tokens the engine still computes go through
the same kernels as in the cold run. llama.cpp's CPU kernels choose their arithmetic by a batch's rows
(Docs/Research.md §26 and §28, `kvbridge.models.cut_probe`):
- one row alone takes the matrix-vector kernels (with f16 K/V the K·Q product too), which round differently
  from the rows of a prefill batch: restoring "all but the last token" changed SmolLM2's answer to a
  near-tie question ("south orchard, week 4" cold, "north orchard, week 3" warm);
- repacked quantised weights (Gemma 3's Q4_K on AVX2) multiply four rows at a time and the rows left over
  one by one, counted from the batch's first row: a batch that starts off that grid, or ends with a few
  rows, computes some rows another way.
Both engines (llama-cpp-python and llama-server) prefill in pieces of BATCH_TOKENS from position 0 and, after a
restore, the rest of the prompt as pieces from the restored position.

What a model needs is measured, not assumed: the cut probe runs once per model, llama.cpp build, K/V type,
batch size, thread count and CPU and keeps its verdict (kvbridge.engine.cut_verdicts) — a `CutRule`: restores
end on a grid of `grid` tokens leaving at least `min_rows` to compute (SmolLM2 on this CPU: 1 and 2, so a
restore ends where the prompt diverges). Where nothing was proven, DEFAULT_RULE: a grid of 8 leaving 8 or more,
a margin for kernels that group up to 8 rows (every cut of §26's probe on it was exact). A stored prefix that a
longer prompt extends is cut to the grid as well: the last rows of the prompt that stored it may have been
computed as leftover rows. A recurrent state cannot be cut by position: those models are prefilled chunk by
chunk in every mode and a restore ends at the last chunk end before the prompt's end (kvbridge.backends.llamacpp).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbridge.backends.base import BATCH_TOKENS

GRID = 8   # DEFAULT_RULE's grid and its fewest rows left to compute (nothing proven)


@dataclass(frozen=True)
class CutRule:
    """Where a restore may end: at a multiple of `grid` leaving `min_rows` or more of the prompt to compute, or
    at the start of a prefill piece (the cold run starts one there too). `crosses_pieces`: a cut before the
    prompt's last prefill piece was proven too (the pieces after it then start off the cold run's); otherwise
    such a restore ends at a piece start. `proven`: measured by the cut probe here; `source` says where from."""

    grid: int = GRID
    min_rows: int = GRID
    crosses_pieces: bool = True
    proven: bool = False
    source: str = "the fixed grid of 8 (no cut probe verdict for this model, build and CPU)"

    def __post_init__(self) -> None:
        if self.grid < 1 or BATCH_TOKENS % self.grid or self.min_rows < 1:
            raise ValueError(f"a cut rule needs a grid dividing {BATCH_TOKENS} and min_rows >= 1; "
                             f"got grid {self.grid}, min_rows {self.min_rows}")

    def restorable(self, n_prompt: int) -> int:
        """The most of an `n_prompt`-token prompt a restore may give (the store holding all of it)."""
        return self.cut(n_prompt, n_prompt)

    def cut(self, reach: int, n_prompt: int) -> int:
        """Where a restore of an `n_prompt`-token prompt ends when the store holds its first `reach` tokens."""
        reach = min(reach, n_prompt - 1)
        if reach < 1:
            return 0
        piece_start = (n_prompt - 1) // BATCH_TOKENS * BATCH_TOKENS
        on_grid = self.on_grid(min(reach, n_prompt - self.min_rows))
        if on_grid < piece_start and not self.crosses_pieces:
            on_grid = 0
        # a piece start is always exact: the cold run's own pieces follow it
        return max(on_grid, min(reach, piece_start) // BATCH_TOKENS * BATCH_TOKENS)

    def on_grid(self, n_tokens: int) -> int:
        """`n_tokens` restorable tokens brought down to the grid (prefill pieces start on it too)."""
        return max(0, n_tokens) // self.grid * self.grid

    def describe(self) -> str:
        """One line for status pages: the rule and whether it was proven here."""
        rows = f"leaving {self.min_rows} or more token{'s' if self.min_rows > 1 else ''} to compute"
        grid = "at any token" if self.grid == 1 else f"on a grid of {self.grid} tokens"
        return f"restores end {grid}, {rows} ({self.source})"


DEFAULT_RULE = CutRule()


def restorable(n_prompt: int) -> int:
    """DEFAULT_RULE's restore end for an `n_prompt`-token prompt (an engine's own rule: CachedEngine.cut_rule)."""
    return DEFAULT_RULE.restorable(n_prompt)


def on_grid(n_tokens: int) -> int:
    """`n_tokens` brought down to DEFAULT_RULE's grid."""
    return DEFAULT_RULE.on_grid(n_tokens)
