"""The deviation rule's placement (KVB_BLEND_RECOMPUTE_AT=deviation), a part of BlendRunner kept in its own module.

Place in the flow: BlendRunner.place(recompute_at="deviation") -> **every stored passage placed whole** (the
fixed placement with nothing recomputed) -> the selection pass (kvbridge.blend.selection) ranks the shifted
passages' tokens by how far their stored KV deviates from the prompt's own in an early layer -> **the gate**:
a prompt whose kept tokens deviate more than KVB_BLEND_GATE is placed again as prefix reuse (the instruction
and the first passage from blend's store, the rest computed; result.fell_back) -> else **the most deviant
tokens recomputed in place**: each run of consecutive chosen tokens decoded in a sequence of its own that
shares the answer's cells before it, stored ones included, so a recomputed token attends to the reused KV of
the tokens around it as CacheBlend's do; then the run's stored cells leave the answer and the new ones join it.

How many: KVB_BLEND_RECOMPUTE_RATIO of the shifted passages' tokens when it is above 0, else
KVB_BLEND_RECOMPUTE_TOKENS per shifted passage, chosen from the whole prompt (a passage that deviates more
gives more). A model the selection cannot read (a quantised KV cache, a graph without llama.cpp's Kcur/Vcur
names) falls back to the start rule, and the record's notes say so.
"""
from __future__ import annotations

from typing import Sequence

from kvbridge.blend.result import BlendResult, Placement
from kvbridge.blend.selection import PlacedPassage, SelectionPass, SelectionUnavailable, rope_of, runs_of


class DeviationPlacement:
    """BlendRunner's deviation rule; the runner provides ctx, settings, geometry, _scratch, _pin and _place_fixed."""

    def _selector(self) -> SelectionPass:
        """The selection pass, made on first use and shared with the runners made by under()."""
        if self._scratch.selection is None:
            self._scratch.selection = SelectionPass(self.settings, self.geometry, rope_of(self.ctx),
                                                    self.settings.blend_select_layers)
        return self._scratch.selection

    def _place_deviation(self, tokens: list[int], starts: Sequence[int], recompute: int, result: BlendResult, *,
                         answer: int, scratch: int, reuse: bool, run_seqs: Sequence[int], ratio: float,
                         gate: float) -> "Placement":
        """Every stored passage placed whole, the selection pass's most deviant reused tokens (`ratio` of them,
        else `recompute` per placed passage) recomputed in context; or, above the gate, prefix reuse."""
        placed: list[PlacedPassage] = []
        placement = self._place_fixed(tokens, starts, 0, result, answer=answer, scratch=scratch, reuse=reuse,
                                      recompute_at="end", run_seqs=(), shifted=placed)
        prefix = [p for p in placed if p.start == p.computed_at]      # the instruction and first passage
        placed = [p for p in placed if p.start != p.computed_at]      # the shifted passages
        if not placed:
            return placement
        reused = sum(p.end - p.start for p in placed)
        count = round(ratio * reused) if ratio > 0 else recompute * len(placed)
        try:
            selection = self._selector().select(tokens, placed, count, prefix)
        except SelectionUnavailable as exc:
            self._restart(result, answer)
            result.notes.append(f"blend: the deviation rule could not run ({exc}); each passage's first tokens "
                                "were recomputed instead (KVB_BLEND_RECOMPUTE_AT=start)")
            return self._place_fixed(tokens, starts, recompute, result, answer=answer, scratch=scratch, reuse=reuse,
                                     recompute_at="start", run_seqs=run_seqs, ratio=ratio)
        result.selection_ms = selection.pass_ms + selection.score_ms
        result.prefill_ms += result.selection_ms    # a prefill of the first layers: the prefill stage holds it
        result.drift = selection.drift
        if selection.note:
            result.notes.append(f"blend: {selection.note}")
        if gate > 0 and selection.drift > gate:
            self._restart(result, answer)
            result.fell_back = True
            return self._place_fixed(tokens, starts, 0, result, answer=answer, scratch=scratch, reuse=reuse,
                                     recompute_at="end", run_seqs=(), prefix_only=True)
        runs = runs_of(selection.positions)
        # each run sees the stored cells around it, as CacheBlend's recomputed tokens attend to the reused KV
        self._recompute_runs([(a, tokens[a:b]) for a, b in runs], answer, run_seqs or (scratch,), result,
                             replace=True)
        result.reused_tokens -= len(selection.positions)
        result.recomputed_tokens = len(tokens) - result.reused_tokens
        result.recomputed_runs = len(runs)
        return placement

    def _restart(self, result: BlendResult, answer: int) -> None:
        """The answer's sequence emptied for another placement; what was read and spent stays counted."""
        self.ctx.seq_rm(answer)
        if self._pin is not None:
            self.ctx.seq_rm(self._pin)
        result.reused_tokens = result.reused_segments = 0
