"""BlendRunner: one prompt of instruction + passages + question, with each stored passage's KV reused
wherever it now stands, and a few tokens of each recomputed in context to recover cross-attention.

Place in the flow: CachedEngine.infer(mode="blend") / Scheduler.submit(blend=True) -> prepare
(segments) -> **BlendRunner.place**: restore the instruction, with the first passage in the same load
(it was computed right after the instruction, so it stands where it was computed and its KV is cold's),
then left to right for each later passage: its stored cells (restored into a scratch sequence where
they were computed, moved with llama_memory_seq_add, which re-rotates K, shared into the answer's
sequence) and `recompute` of its tokens decoded in context, its last ones (the default,
KVB_BLEND_RECOMPUTE_AT=end) or its first - in an own context every passage's recomputed tokens in one
llama_decode, each passage's in a sequence of its own; a passage not stored yet is prefilled in place
-> the question and generation -> after the answer: **store_missing**: the passages (and the
instruction) not stored yet, each from its own prefill of instruction + passage in the scratch
sequence.

Why left to right: llama.cpp accepts a sequence's new tokens only at the position after its last
cell (llama-batch.cpp: "the sequence positions remain consecutive"), so every decode of recomputed
tokens comes right after the cells before it are in place: in the answer's sequence one passage at
a time, or in a run sequence that shares the answer's cells before it (its new cells then go to the
answer). Each recomputed token sees the instruction and every passage before it (stored, and in the
one-decode form not those passages' recomputed tokens); the other tokens of a passage keep
the KV they had after the instruction alone. EPIC/LegoLink recompute each chunk's first tokens,
which matter there because their chunks are computed alone (the first tokens become attention
sinks); ours are computed after the instruction, and recomputing each passage's last tokens, which
lead into what follows, halved the divergence from cold here (Docs/Research.md §16). That is lossy
by design: the namespace carries `blend=`, the record's mode is `blend` and its notes say what was
reused and recomputed.

A model whose cache cannot move cells (llama_memory_can_shift false) or whose state is recurrent is
refused. A sliding-window model (Gemma 3) runs: its context keeps a full-size sliding-window cache
(swa_full), a stored passage holds both caches' rows of every one of its positions (kvbridge.blend.storing reads
the ones llama.cpp leaves out of a state, the window before the last), and llama.cpp's K shift moves
both caches, each layer rotated with its own RoPE base.
Sequences: 0 holds the answer's context, 1 is the scratch sequence, and an own context has RUN_SEQS
more for the recomputed tokens. One thread at a time.
"""
from __future__ import annotations

import copy
import time
from typing import Callable, Sequence

import numpy as np

from kvbridge.backends.llama_context import BATCH_TOKENS, LlamaContext, Sampler
from kvbridge.backends.text_decoding import Utf8Decoder
from kvbridge.blend.passages import FoundPassage, blend_namespace, check_passage, instruction_key, passage_key
from kvbridge.blend.result import BlendResult, Placement
from kvbridge.blend.deviation import DeviationPlacement
from kvbridge.blend.storing import PassageStoring
from kvbridge.blend.selection import PlacedPassage, SelectionPass
from kvbridge.engine.layout import probe_geometry, probe_state_on_sequence
from kvbridge.engine.segments import segment_spans
from kvbridge.errors import KVBridgeError, StateTransferError
from kvbridge.formats.architectures import KVSupport
from kvbridge.formats.llama_chunks import assemble_state, assembled_size
from kvbridge.formats.llama_state import KVGeometry, LayoutError
from kvbridge.settings import Settings

ANSWER, SCRATCH = 0, 1
# which tokens of a reused passage are recomputed (KVB_BLEND_RECOMPUTE_AT): each passage's last or first ones, or
# the prompt's most deviant ones by the selection pass (kvbridge.blend.selection)
RECOMPUTE_AT = ("end", "start", "deviation")
PROBE = " ".join(["Blend layout probe."] * 4)
# An own context is sized to the prompts it has answered, in steps of CELL_STEP, up to KVB_CTX_SIZE: llama.cpp's
# K shift rotates every cell of the context, used or not, so a context twice the prompt's size shifts twice the
# cells (Docs/Research.md §16).
CELL_STEP = 512
# An own context's sequences beyond the answer and the scratch one: each passage's recomputed tokens are decoded in
# one of these, all in one llama_decode (BlendRunner.place, run_seqs); more passages take a second decode. The
# deviation rule's runs (consecutive chosen tokens) are many more: they take every sequence an own context has.
RUN_SEQS = 8
DEVIATION_SEQS = 48
# A sliding-window model's placement holds every cell it placed in this sequence as well as in the answer's: llama.cpp
# reuses a cell that only one sequence holds once that sequence's window has passed it (llama_kv_cache::find_slot),
# and a recomputed token, a passage decoded in place, sits at a position before the answer's last one, whose window
# still needs those cells. An own context's last sequence; the scheduler lends one.
PIN = 2 + DEVIATION_SEQS


class BlendRefused(KVBridgeError):
    """This model or engine cannot run blend mode; the message says why, for a person."""


class BlendRunner(DeviationPlacement, PassageStoring):
    def __init__(self, settings: Settings, store, namespace: str, *, n_cells: int | None = None,
                 context: LlamaContext | None = None, geometry: KVGeometry | None = None) -> None:
        """Own context (two sequences, grown to the prompts' size up to `n_cells`, default KVB_CTX_SIZE), or a
        shared one (the scheduler's) with its geometry."""
        self.settings = settings
        self.store = store
        self.namespace = blend_namespace(namespace)
        self.max_cells = n_cells or settings.ctx_size
        self.ctx = context if context is not None else LlamaContext(settings, min(self.max_cells, CELL_STEP),
                                                                         PIN + 1)
        self._own_context = context is None
        self._scratch = _Scratch()   # shared with the runners made by under()
        self._pin: int | None = None   # while a sliding-window model's placement runs (place)
        try:
            self._refuse_unshiftable()
            self.geometry = geometry if geometry is not None else self._probe()
        except KVBridgeError:
            self.close()
            raise

    def _refuse_unshiftable(self) -> None:
        from kvbridge.backends.model_traits import traits_of_model

        traits = traits_of_model(self.ctx.model)
        name = self.ctx.model_path.name
        if traits is not None and (traits.recurrent or traits.hybrid):
            raise BlendRefused(f"blend mode does not run {name}: its recurrent state after a passage depends on "
                               "everything before the passage, so a stored passage cannot be placed after another "
                               "instruction; use lmcache, which restores this model's prefixes exactly")
        if not self.ctx.can_shift():
            raise BlendRefused(f"blend mode needs llama.cpp to move cached tokens to new positions, and {name}'s "
                               "KV cache cannot (llama_memory_can_shift is false); use lmcache with this model")

    def _probe(self) -> KVGeometry:
        """The layout (plain, or a sliding-window model's two caches) proven on a probe in the scratch sequence."""
        from kvbridge.backends.model_traits import traits_of_model

        name = self.ctx.model_path.name
        traits = traits_of_model(self.ctx.model)
        support = KVSupport("sliding-window", window=traits.n_swa) if traits is not None and traits.n_swa \
            else KVSupport("plain")
        try:
            return probe_geometry(None, support, lambda: probe_state_on_sequence(self.ctx, SCRATCH, PROBE))
        except LayoutError as exc:
            raise BlendRefused(f"blend mode does not understand {name}'s KV layout: {exc}") from exc

    def under(self, namespace: str) -> "BlendRunner":
        """This runner on another namespace's passages (a cache salt's): the same context, geometry and
        assembly buffer, nothing made per salt. Only the runner that made the context closes it."""
        view = copy.copy(self)
        view.namespace = blend_namespace(namespace)
        view._own_context = False
        return view

    def close(self) -> None:
        if self._own_context:
            if self._scratch.selection is not None:
                self._scratch.selection.close()
                self._scratch.selection = None
            self.ctx.close()

    def _grow(self, need: int) -> None:
        """A new own context of the next CELL_STEP above `need` cells (at most max_cells); nothing in the old
        one outlives a request, and the geometry does not depend on the size."""
        cells = min(self.max_cells, -(-need // CELL_STEP) * CELL_STEP)
        grown = LlamaContext(self.settings, cells, PIN + 1)
        self.ctx.close()
        self.ctx = grown

    # -- the answer ---------------------------------------------------------------------------------
    def run(self, tokens: Sequence[int], starts: Sequence[int], *, recompute: int, n_predict: int,
            temperature: float = 0.0, seed: int | None = None, reuse: bool = True, store: bool = True,
            on_text: Callable[[str], None] | None = None, t0: float | None = None,
            recompute_at: str = "end", ratio: float = 0.0, gate: float = 0.0,
            prefix_only: bool = False) -> BlendResult:
        """Answer `tokens` (segments beginning at `starts`: instruction, passages, question).

        reuse=False computes every token (the cold reference in this same context); store=False keeps
        the store as it is (the quality curve runs one prompt at several recompute counts); prefix_only
        reuses the instruction and the first passage alone (prefix reuse: what the gate falls back to)."""
        t0 = time.perf_counter() if t0 is None else t0
        tokens = [int(t) for t in tokens]
        need = len(tokens) + n_predict
        # beside the answer, the scratch sequence holds one segment at a time (placing it, storing it); the
        # deviation rule's recomputed tokens stand beside their stored cells until they replace them
        spans = segment_spans(starts, len(tokens))
        room = need + max(b - a for a, b in spans)
        if recompute_at == "deviation" and not prefix_only:
            room += -(-int(ratio * 1000) * len(tokens) // 1000) if ratio > 0 else recompute * max(0, len(spans) - 3)
        if room > self.ctx.n_cells and self._own_context and self.ctx.n_cells < self.max_cells:
            self._grow(min(room, self.max_cells))
        if need > self.ctx.n_cells:
            raise KVBridgeError(f"The prompt ({len(tokens)} tokens) plus {n_predict} new tokens does not fit the "
                                f"blend context of {self.ctx.n_cells} tokens (KVB_CTX_SIZE).")
        result = BlendResult()
        self.ctx.seq_rm(ANSWER)
        seqs = DEVIATION_SEQS if recompute_at == "deviation" else RUN_SEQS
        run_seqs = range(SCRATCH + 1, SCRATCH + 1 + seqs) if self._own_context else ()
        if prefix_only:
            placement = self._place_fixed(tokens, starts, 0, result, answer=ANSWER, scratch=SCRATCH, reuse=reuse,
                                          recompute_at="end", run_seqs=(), prefix_only=True)
        else:
            placement = self.place(tokens, starts, recompute, result, reuse=reuse, recompute_at=recompute_at,
                                   run_seqs=run_seqs, ratio=ratio, gate=gate,
                                   pin=PIN if self._own_context else None)
        t = time.perf_counter()
        logits = self._decode(ANSWER, placement.pending, placement.kv_tokens, want_logits=True)
        result.prefill_ms += (time.perf_counter() - t) * 1000
        result.first_logits = logits
        self._generate(result, logits, len(tokens), n_predict, temperature, seed, on_text, t0)
        result.total_ms = (time.perf_counter() - t0) * 1000
        if store:
            self.store_missing(tokens, placement, result, answer=ANSWER, scratch=SCRATCH)
        return result

    def place(self, tokens: list[int], starts: Sequence[int], recompute: int, result: BlendResult, *,
              answer: int = ANSWER, scratch: int = SCRATCH, reuse: bool = True,
              recompute_at: str = "end", run_seqs: Sequence[int] = (), ratio: float = 0.0,
              gate: float = 0.0, pin: int | None = None) -> "Placement":
        """Fill the empty sequence `answer` left to right: the stored instruction (with the first passage when
        it is stored: it stands where it was computed, so its KV is cold's and nothing of it is recomputed),
        then for each later passage its stored cells and `recompute` of its tokens decoded in context: its
        last ones ("end": they lead into the next segment) or its first ones ("start": EPIC's choice for
        chunks computed alone). What is left to decode (passages not stored, after the last one placed, and
        the question) is returned.

        With `run_seqs` (free sequence ids), the recomputed tokens of every passage are decoded in one
        llama_decode after the stored cells are in place, each passage's in a sequence of its own that
        shares the answer's cells before it, instead of one decode per passage (each decode reads every
        weight once: ~28 ms here for a few tokens). They then see the stored cells of the passages before
        them, not those passages' recomputed tokens.

        `ratio` (a request passes KVB_BLEND_RECOMPUTE_RATIO), when above 0, wins over `recompute`: that share
        of each reused passage's tokens (end, start), or of all reused tokens (deviation). "deviation" places
        every stored passage whole, asks the selection pass which tokens deviate most
        (kvbridge.blend.selection), and recomputes those in context; with `gate` (KVB_BLEND_GATE) above 0, a
        prompt whose kept tokens deviate more than it is placed as prefix reuse instead (result.fell_back).

        `pin` (an empty sequence): a sliding-window model's placement holds every placed cell there too (PIN says
        why); it is emptied again before this returns. A sliding-window model needs one."""
        if recompute_at not in RECOMPUTE_AT:
            raise ValueError(f"recompute_at must be one of {RECOMPUTE_AT}, got {recompute_at!r}")
        if self.geometry.window and pin is None:
            raise BlendRefused("a sliding-window model's blend placement needs a sequence to hold its cells (pin)")
        self._pin = pin if self.geometry.window else None
        try:
            if recompute_at == "deviation":
                return self._place_deviation(tokens, starts, recompute, result, answer=answer, scratch=scratch,
                                             reuse=reuse, run_seqs=run_seqs, ratio=ratio, gate=gate)
            return self._place_fixed(tokens, starts, recompute, result, answer=answer, scratch=scratch, reuse=reuse,
                                     recompute_at=recompute_at, run_seqs=run_seqs, ratio=ratio)
        finally:
            if self._pin is not None:
                self.ctx.seq_rm(self._pin)
            self._pin = None

    def _held(self, answer: int, lo: int, hi: int) -> None:
        """The answer's cells at positions lo..hi-1, just placed, held by the pin sequence too (PIN)."""
        if self._pin is not None and hi > lo:
            self.ctx.seq_cp_range(answer, self._pin, lo, hi)

    def _place_fixed(self, tokens: list[int], starts: Sequence[int], recompute: int, result: BlendResult, *,
                     answer: int, scratch: int, reuse: bool, recompute_at: str, run_seqs: Sequence[int],
                     ratio: float = 0.0, shifted: list[PlacedPassage] | None = None,
                     prefix_only: bool = False) -> "Placement":
        """end/start: `recompute` (or `ratio` of each passage) of every stored passage's last or first tokens.
        `shifted` collects the segments placed whole (with recompute 0): the instruction and first passage where
        they were computed (start == computed_at), then the passages placed at a new position; prefix_only reuses the instruction
        and the first passage alone (the gate's fallback)."""
        at_end = recompute_at == "end"
        per_passage = (lambda n: round(ratio * n)) if ratio > 0 else (lambda n: recompute)
        spans = segment_spans(starts, len(tokens))
        instruction = tokens[spans[0][0]:spans[0][1]]
        self.ctx.seq_rm(scratch)
        pending: list[int] = []      # tokens to decode at positions pending_at.. before the next placement
        pending_at = 0
        runs: list[tuple[int, list[int]]] = []   # (position, tokens) recomputed together (run_seqs)
        missing: list[tuple[int, int]] = []    # segments prefilled here, stored after the answer
        passages = spans[1:-1]
        first = (tokens[passages[0][0]:passages[0][1]]
                 if passages and per_passage(passages[0][1] - passages[0][0]) < passages[0][1] - passages[0][0]
                 else None)
        placed = self._place_instruction(instruction, first, result, answer, shifted) if reuse else None
        if placed is not None:
            pending_at = len(instruction)
            if placed:
                pending_at = passages[0][1]
                passages = passages[1:]
        else:
            pending = list(instruction)
            missing.append(spans[0])
        for start, end in passages:
            passage = tokens[start:end]
            recompute = per_passage(len(passage))
            found = (self._fetch(passage, instruction, result)
                     if reuse and not prefix_only and recompute < len(passage) else None)
            if found is None:
                self._recompute_runs(runs, answer, run_seqs, result)
                pending += passage
                missing.append((start, end))
                continue
            keep = (0, len(passage) - recompute) if at_end else (recompute, len(passage))
            run = (end - recompute, passage[len(passage) - recompute:]) if at_end else (start, passage[:recompute])
            if run_seqs:    # stored cells now, with a hole where the recomputed tokens go in one decode later
                if pending:
                    self._recompute_runs(runs, answer, run_seqs, result)
                    self._flush(pending, pending_at, result, answer)
                    pending = []
                self._place(found, len(instruction), start, *keep, result, answer, scratch)
                if recompute:
                    runs.append(run)
                pending_at = end
            elif at_end:    # stored cells first, then the passage's last tokens join what is decoded next
                self._flush(pending, pending_at, result, answer)
                self._place(found, len(instruction), start, *keep, result, answer, scratch)
                pending, pending_at = list(run[1]), run[0]
            else:           # the passage's first tokens decoded in context, then its stored cells after them
                pending += run[1]
                self._flush(pending, pending_at, result, answer)
                self._place(found, len(instruction), start, *keep, result, answer, scratch)
                pending, pending_at = [], end
            if shifted is not None:
                shifted.append(PlacedPassage(start, end, len(instruction), found.view))
            result.reused_tokens += len(passage) - recompute
            result.reused_segments += 1
        self._recompute_runs(runs, answer, run_seqs, result)
        pending += tokens[spans[-1][0]:]
        result.recomputed_tokens = len(tokens) - result.reused_tokens
        return Placement(pending_at, pending, instruction, missing)

    def _recompute_runs(self, runs: list[tuple[int, list[int]]], answer: int, run_seqs: Sequence[int],
                        result: BlendResult, replace: bool = False) -> None:
        """Decode each run (position, tokens) in a sequence of its own sharing `answer`'s cells before it, as
        few llama_decode calls as the sequences and the batch allow, then hand the new cells to `answer`
        (emptying `runs`). replace: `answer` holds stored cells where the runs go (the deviation rule), which
        the new ones replace."""
        t = time.perf_counter()
        ctx = self.ctx
        while runs:
            group, runs[:] = runs[:len(run_seqs)], runs[len(run_seqs):]
            entries = []
            try:
                for seq, (at, run) in zip(run_seqs, group):
                    ctx.seq_rm(seq)
                    ctx.seq_cp_range(answer, seq, 0, at)
                    entries += [(token, at + i, seq, False) for i, token in enumerate(run)]
                for lo in range(0, len(entries), BATCH_TOKENS):
                    code = ctx.decode(entries[lo: lo + BATCH_TOKENS])
                    if code != 0:
                        raise StateTransferError(f"llama_decode returned {code} for {len(entries)} recomputed blend "
                                                 f"tokens (no room in the context of {ctx.n_cells} cells?)")
                for seq, (at, run) in zip(run_seqs, group):
                    if replace:
                        ctx.seq_rm(answer, at, at + len(run))
                        if self._pin is not None:
                            ctx.seq_rm(self._pin, at, at + len(run))
                    ctx.seq_cp_range(seq, answer, at, at + len(run))
                    self._held(answer, at, at + len(run))
            finally:    # a failed decode leaves no cells behind in the run sequences
                for seq, _ in zip(run_seqs, group):
                    ctx.seq_rm(seq)
        result.prefill_ms += (time.perf_counter() - t) * 1000

    def _flush(self, pending: list[int], at: int, result: BlendResult, answer: int) -> None:
        if pending:
            t = time.perf_counter()
            self._decode(answer, pending, at, want_logits=False)
            self._held(answer, at, at + len(pending))
            result.prefill_ms += (time.perf_counter() - t) * 1000

    def _decode(self, seq: int, tokens: Sequence[int], at: int, *, want_logits: bool) -> np.ndarray | None:
        """Decode tokens at positions at.. of `seq`; the logits of the last one when asked."""
        for lo in range(0, len(tokens), BATCH_TOKENS):
            piece = tokens[lo: lo + BATCH_TOKENS]
            last = lo + len(piece) == len(tokens)
            entries = [(t, at + lo + i, seq, want_logits and last and i == len(piece) - 1) for i, t in enumerate(piece)]
            code = self.ctx.decode(entries)
            if code != 0:
                raise StateTransferError(f"llama_decode returned {code} for {len(piece)} tokens of blend sequence {seq} "
                                         f"(no room in the context of {self.ctx.n_cells} cells?)")
        return self.ctx.logits((len(tokens) - 1) % BATCH_TOKENS) if want_logits else None

    def _generate(self, result: BlendResult, logits: np.ndarray, at: int, n_predict: int, temperature: float,
                  seed: int | None, on_text, t0: float) -> None:
        sampler = Sampler(temperature, 0.95, seed)
        decoder = Utf8Decoder()
        pieces: list[str] = []
        for step in range(n_predict):
            token = sampler.pick(logits)
            if self.ctx.is_end(token):
                break
            if step == 0:
                result.ttft_ms = (time.perf_counter() - t0) * 1000
            result.tokens.append(token)
            piece = decoder.feed(self.ctx.piece(token))
            pieces.append(piece)
            if on_text is not None and piece:
                on_text(piece)
            if step + 1 < n_predict:
                logits = self._decode(ANSWER, [token], at + step, want_logits=True)
        tail = decoder.flush()
        if tail:
            pieces.append(tail)
            if on_text is not None:
                on_text(tail)
        if not result.tokens:
            result.ttft_ms = (time.perf_counter() - t0) * 1000
        result.text = "".join(pieces)

    # -- stored segments ----------------------------------------------------------------------------
    def _get(self, key: bytes, tokens: Sequence[int], result: BlendResult) -> FoundPassage | None:
        t = time.perf_counter()
        try:
            return self._get_checked(key, tokens, result)
        finally:
            result.fetch_ms += (time.perf_counter() - t) * 1000

    def _get_checked(self, key: bytes, tokens: Sequence[int], result: BlendResult) -> FoundPassage | None:
        obj = borrowed = self.store.get(key, namespace=self.namespace)
        if obj is None:
            return None
        try:
            if obj.intact is not None:
                # a borrowed blob (a cache server's shared pages): a private copy, trusted only when the
                # pages were not reused while it was taken; the lease ends below
                copy = bytes(obj.blob)
                obj = type(obj)(blob=copy, meta=obj.meta, tier=obj.tier) if obj.intact() else None
            found = check_passage(obj, self.namespace, tokens, self.geometry) if obj is not None else None
        finally:
            if borrowed.release is not None:
                borrowed.release()
        if found is not None:
            result.fetch_bytes += found.n_bytes
            result.tier = found.tier if result.tier == "none" else self.store.slower(result.tier, found.tier)
        return found

    def _fetch(self, passage: Sequence[int], instruction: Sequence[int], result: BlendResult) -> FoundPassage | None:
        return self._get(passage_key(self.namespace, instruction, passage), passage, result)

    def _place_instruction(self, instruction: Sequence[int], first_tokens: Sequence[int] | None, result: BlendResult,
                           answer: int, placed: list[PlacedPassage] | None = None) -> bool | None:
        """The stored instruction into `answer` at positions 0.., followed in the same load by the first
        passage (`first_tokens`) when it is stored: it was computed right after the instruction, so it needs
        no shift and its KV is cold's. None: the instruction is not stored; else whether the passage came too."""
        found = self._get(instruction_key(self.namespace, instruction), instruction, result)
        if found is None:
            return None
        first = self._fetch(first_tokens, instruction, result) if first_tokens is not None else None
        pieces = [(found.view, found.view.n_cells)] + ([(first.view, first.view.n_cells)] if first is not None else [])
        n_cells = sum(n for _, n in pieces)
        t = time.perf_counter()
        state = assemble_state(self.geometry, pieces, seq_id=answer, out=self._scratch_for(n_cells))
        t1 = time.perf_counter()
        self.ctx.load_seq(answer, state)
        self._held(answer, 0, n_cells)
        result.assemble_ms += (t1 - t) * 1000
        result.handoff_ms += (time.perf_counter() - t1) * 1000
        result.reused_segments += 1 + (first is not None)
        result.reused_tokens += n_cells
        if placed is not None:   # where they were computed: the selection pass restores them instead of decoding
            placed.append(PlacedPassage(0, len(instruction), 0, found.view))
            if first is not None:
                placed.append(PlacedPassage(len(instruction), n_cells, len(instruction), first.view))
        return first is not None

    def _scratch_for(self, n_cells: int) -> np.ndarray:
        size = assembled_size(self.geometry, n_cells)
        held = self._scratch.data
        if held is None or len(held) < size:
            self._scratch.data = np.empty(max(size, 2 * len(held) if held is not None else size), np.uint8)
        return self._scratch.data

    def _place(self, found: FoundPassage, computed_at: int, start: int, lo: int, hi: int, result: BlendResult,
               answer: int, scratch: int) -> None:
        """The passage's stored cells lo..hi-1, computed at positions computed_at.., to positions start+lo.."""
        ctx, n = self.ctx, found.view.n_cells
        t = time.perf_counter()
        state = assemble_state(self.geometry, [(found.view, n)], seq_id=scratch, out=self._scratch_for(n),
                               first_pos=computed_at)
        t1 = time.perf_counter()
        result.assemble_ms += (t1 - t) * 1000
        ctx.load_seq(scratch, state)
        if lo:
            ctx.seq_rm(scratch, computed_at, computed_at + lo)
        if hi < n:
            ctx.seq_rm(scratch, computed_at + hi, computed_at + n)
        delta = start - computed_at
        if delta:
            ctx.seq_add(scratch, computed_at, computed_at + n, delta)
        ctx.seq_cp_range(scratch, answer, start + lo, start + hi)
        self._held(answer, start + lo, start + hi)
        ctx.seq_rm(scratch)
        result.handoff_ms += (time.perf_counter() - t1) * 1000


class _Scratch:
    """The assembly buffer of a runner and its views (one request at a time uses it), and its selection pass."""

    data: np.ndarray | None = None
    selection: SelectionPass | None = None
