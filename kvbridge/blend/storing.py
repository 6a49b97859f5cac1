"""Storing what an answer computed: each segment not stored yet, from its own prefill after the instruction, a
part of BlendRunner kept in its own module.

Place in the flow: BlendRunner.run -> the answer -> **store_missing** (off the TTFT path): per segment the
instruction's cells shared from the answer's sequence into the scratch sequence, the passage decoded after
them, the passage's cells cut from that state (kvbridge.formats.llama_chunks.encode_chunk) and put under its
passage key (kvbridge.blend.passages). A sliding-window model decodes instruction + segment afresh instead
(llama.cpp reuses the answer's instruction cells in its sliding-window cache once the answer's window passed
them, so they may be gone), and its state holds the sliding-window cache's last window only: **_window_rows**
reads the earlier windows' rows through a free sequence, so a stored passage has both caches' rows for every
one of its positions.
"""
from __future__ import annotations

from kvbridge.backends.llama_context import BATCH_TOKENS
from kvbridge.blend.passages import instruction_key, passage_key, passage_meta
from kvbridge.blend.result import BlendResult, Placement
from kvbridge.errors import StateTransferError
from kvbridge.formats.llama_chunks import encode_chunk
from kvbridge.formats.llama_state import LayoutError, ParsedState, parse_state, parse_window_rows, with_window_rows


class PassageStoring:
    """BlendRunner's storing; the runner provides ctx, store, namespace, geometry, _own_context and _decode."""

    def store_missing(self, tokens: list[int], placement: Placement, result: BlendResult, *,
                      answer: int, scratch: int) -> None:
        """Each segment prefilled for this answer, stored from its own prefill after the instruction
        (off the TTFT path): the instruction's cells are shared from `answer` (a sliding-window model decodes
        the instruction again: see below), the passage decoded after them in `scratch`, and the passage's cells
        cut from that state."""
        ctx, instruction = self.ctx, placement.instruction
        n_instr = len(instruction)
        for start, end in placement.missing:
            is_instruction = start == 0
            segment = tokens[start:end]
            if is_instruction:
                key = instruction_key(self.namespace, instruction)
            else:
                key = passage_key(self.namespace, instruction, segment)
            if self.store.contains(key, namespace=self.namespace):
                continue   # stored by an earlier prompt, or twice in this one
            ctx.seq_rm(scratch)
            try:
                if self.geometry.window:
                    # the answer's instruction cells may be gone from its sliding-window cache (llama.cpp reuses
                    # them once the answer's window passed them): instruction and segment decoded here afresh
                    self._decode_held(scratch, list(instruction) + ([] if is_instruction else list(segment)))
                else:
                    ctx.seq_cp_range(answer, scratch, 0, n_instr)
                    if not is_instruction:
                        self._decode(scratch, segment, n_instr, want_logits=False)
                parsed = self._window_rows(parse_state(ctx.save_seq(scratch), window=self.geometry.window), scratch)
                lo = 0 if is_instruction else n_instr
                payload = encode_chunk(parsed, lo, lo + len(segment), segment)
            except (LayoutError, StateTransferError) as exc:
                result.notes.append(f"blend: a segment was not stored ({exc})")
                continue
            finally:
                ctx.seq_rm(scratch)
            what = "instruction" if is_instruction else "passage"
            if self.store.put(key, payload, passage_meta(self.namespace, segment, f"blend {what}")):
                result.stored_segments += 1

    def _decode_held(self, seq: int, tokens: list[int]) -> None:
        """Decode `tokens` from position 0 of the empty `seq` a batch at a time; in an own context every batch's
        cells are held by the next sequence too until the whole is decoded, so llama.cpp reuses none of them
        for the next batch (it would once seq's window passed them) and _window_rows finds every row."""
        spare = seq + 1 if self._own_context else None
        try:
            for lo in range(0, len(tokens), BATCH_TOKENS):
                piece = tokens[lo: lo + BATCH_TOKENS]
                self._decode(seq, piece, lo, want_logits=False)
                if spare is not None and lo + len(piece) < len(tokens):
                    self.ctx.seq_cp_range(seq, spare, lo, lo + len(piece))
        finally:
            if spare is not None:
                self.ctx.seq_rm(spare)

    def _window_rows(self, parsed: ParsedState, seq: int) -> ParsedState:
        """A sliding-window model: `parsed` (seq's state) with its windowed layers' rows reaching back to
        position 0. llama.cpp writes only the last window's cells of that cache, though the full-size cache
        (swa_full) keeps every row; the earlier windows are read through a free run sequence
        (LlamaContext.save_window). Without one, the rows stay as they are and a passage they do not
        cover is not stored (encode_chunk refuses it: the record's notes say so)."""
        g = self.geometry
        spare = seq + 1    # seq is an own context's scratch sequence: the next one is its first run sequence
        if not g.window or parsed.window_start == 0 or not self._own_context:
            return parsed
        rows, end = [], parsed.window_start
        while end > 0:
            part = parse_window_rows(self.ctx.save_window(seq, spare, end), g)
            if part.n_cells == 0 or part.first_pos >= end:
                break
            rows.append(part)
            end = part.first_pos
        return with_window_rows(parsed, rows)
