"""What a blend answer cost and where its placement left the answer's sequence.

Place in the flow: BlendRunner.place (kvbridge.blend.runner) -> **Placement** (positions holding KV, the
tokens still to decode, the segments to store after the answer) -> the answer -> **BlendResult** (text,
timings by stage, segments reused and stored) -> fill_record: into the RequestRecord, as CachedEngine's
blend mode (kvbridge.blend.mode) and the scheduler record a blend request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvbridge.engine.misses import MissExplainer, hit_tiers_text


@dataclass
class BlendResult:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    first_logits: np.ndarray | None = None   # the distribution of the first generated token
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    reused_segments: int = 0      # passages (and the instruction) placed from the store
    stored_segments: int = 0      # stored after the answer
    recomputed_tokens: int = 0    # prompt tokens decoded for this answer
    reused_tokens: int = 0        # prompt tokens whose KV came from the store
    fetch_ms: float = 0.0         # reading stored segments and checking them
    assemble_ms: float = 0.0      # building each segment's sequence state
    handoff_ms: float = 0.0       # into llama.cpp: set_data, drop the recomputed cells, shift, share
    prefill_ms: float = 0.0       # decoding the prompt tokens not reused
    fetch_bytes: int = 0
    tier: str = "none"
    notes: list[str] = field(default_factory=list)
    selection_ms: float = 0.0     # the deviation rule's selection pass and choice (part of prefill_ms's wait)
    drift: float | None = None    # the deviation the kept reused tokens carry (the gate's estimate); None: not measured
    fell_back: bool = False       # the gate placed the prompt as prefix reuse instead
    recomputed_runs: int = 0      # the deviation rule: runs of consecutive recomputed tokens

    def fill_record(self, record, n_segments: int, recompute: int, recompute_at: str, ratio: float = 0.0) -> None:
        """What the placement reused, where from and what it cost, into a RequestRecord, with the note
        that says so (CachedEngine and the scheduler both record a blend request this way)."""
        record.matched_tokens = self.reused_tokens
        record.fetch_bytes, record.fetch_ms = self.fetch_bytes, self.fetch_ms
        record.assemble_ms, record.handoff_ms = self.assemble_ms, self.handoff_ms
        record.restore_ms = self.assemble_ms + self.handoff_ms
        passages = n_segments - 2
        how = f"{ratio:.0%} of each reused passage" if ratio > 0 else f"{recompute} per reused passage"
        if recompute_at == "deviation":
            share = f"{ratio:.0%} of the reused tokens" if ratio > 0 else f"{recompute} per reused passage"
            how = (f"{share}, the most deviant by the selection pass ({self.recomputed_runs} runs, "
                   f"{self.selection_ms:.0f} ms)")
        else:
            how += f", at its {recompute_at}"
        record.add_note(f"blend: {self.reused_segments} of {passages + 1} segments reused (instruction and "
                        f"{passages} passages), {self.recomputed_tokens} prompt tokens recomputed ({how})")
        for note in self.notes:
            record.add_note(note)
        record.blend_drift, record.blend_fallback = self.drift, self.fell_back
        if self.fell_back:
            record.add_note(f"blend: the gate fell back to prefix reuse (drift {self.drift:.3f} above KVB_BLEND_GATE)")
        self._explain(record, passages + 1)

    def _explain(self, record, reusable: int) -> None:
        """Blend's own miss cause: a segment not stored yet is none_stored; the tokens recomputed in every reused
        passage and the question are computed by design, not missed."""
        hit = {self.tier: self.reused_tokens} if self.reused_tokens else {}
        if self.reused_segments < reusable and not self.fell_back:   # the gate's fallback computes them by design
            MissExplainer.fixed("none_stored", f"blend: {reusable - self.reused_segments} of {reusable} segments "
                                "(instruction and passages) were not stored yet; they are stored after this answer",
                                hit_tiers=hit).apply(record)
        else:
            record.miss_reason, record.miss_detail, record.hit_tiers = "", "", hit_tiers_text(hit)


@dataclass
class Placement:
    """Where BlendRunner.place left a sequence: positions 0..kv_tokens-1 hold KV, `pending` comes next."""

    kv_tokens: int
    pending: list[int]
    instruction: list[int]
    missing: list[tuple[int, int]]   # segments (start, end) computed for this answer, to store after it
