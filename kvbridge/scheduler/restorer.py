"""Between llama.cpp's sequences and the store: restore what resident cells do not hold, store prompts
and swapped-out sequences, and fall back to recompute when llama.cpp refuses a restored state.

A new sequence first shares the longest resident run (kvbridge.scheduler.prefix_cache); the store's
copy of a longer prefix (chunks, then the tail) replaces it when it brings at least half a block
more. A preempted request's whole context is swapped out (pinned) and restored by the same path when
it resumes; if the store could not take it, it is recomputed from its tokens. A restore llama.cpp
refuses is recomputed from the cells the sequence really holds (`restore_failed`). A request that
answers only once its prompt is stored (store_before_answer: a prefill instance handing its prompt to a
decode instance through a shared store) gets its answer from the writer, after that write. Each cache salt
has a SequenceStore of its own (kvbridge.scheduler.sequence_store), found through `store_for`.

A recurrent or hybrid model: a prompt's chunks carry the recurrent states its prefill captured where they
end (Request.boundaries); a swapped-out sequence comes back from its whole-sequence snapshot; and every
restore is checked to leave the recurrent state after the last restored position (llama.cpp only warns).
"""
from __future__ import annotations

import logging
import secrets
import time
from concurrent.futures import Future, InvalidStateError
from typing import Callable

from kvbridge.backends.base import WindowCapture
from kvbridge.engine.cold_cut import CutRule
from kvbridge.errors import KVBridgeError, StateTransferError
from kvbridge.formats.llama_state import KVGeometry, LayoutError, parse_recurrent_capture, parse_state
from kvbridge.scheduler.events import Journal
from kvbridge.scheduler.exact import ALIGN_RULE, safe_reuse
from kvbridge.scheduler.misses import AdmissionMisses, resident_tokens
from kvbridge.scheduler.prefix_cache import PrefixCache
from kvbridge.scheduler.requests import Request
from kvbridge.scheduler.sequence_store import SequenceStore, SwapTicket
from kvbridge.scheduler.sequences import SequencePool
from kvbridge.store import StoreFault

log = logging.getLogger(__name__)


def resolve(future: Future, result) -> None:
    """Set a Future's result unless it is done already (a cancel may come from any thread at any time)."""
    try:
        if not future.done():
            future.set_result(result)
    except InvalidStateError:   # cancelled between the check and the set: nobody waits for it
        pass


class Restorer:
    def __init__(self, ctx, pool: SequencePool, cache: PrefixCache, store_for: Callable[[str], SequenceStore],
                 window: int, chunk_size: int, journal: Journal, geometry: KVGeometry | None = None,
                 misses: AdmissionMisses | None = None, exact: bool = False,
                 rule: CutRule = ALIGN_RULE) -> None:
        self._ctx = ctx
        self.exact = exact   # KVB_SCHED_EXACT: restores cut where a solo prefill would cut; swap-outs private
        self.rule = rule     # where: exact mode's cut rule (kvbridge.scheduler.exact.cut_rule)
        # exact mode's swapped-out contexts of a sliding-window model: under a salt nobody can send (random per
        # scheduler), so a swapped answer's KV, decoded one token a call, never serves another prompt's prefill
        self._swap_salt_tag = "\x00exact-swap-" + secrets.token_hex(16)
        self.pool = pool
        self.ledger = pool.ledger
        self.cache = cache
        self.store_for = store_for      # a cache salt's SequenceStore
        self.window = window            # the model's sliding window (0: none)
        self.chunk_size = chunk_size
        self.journal = journal
        self.geometry = geometry if geometry is not None and geometry.recurrent else None   # recurrent models only
        self.awaiting_store: dict[int, Request] = {}   # store_before_answer requests whose answer waits on the writer
        # names why a first admission did not reuse its whole prompt (kvbridge.scheduler.misses)
        self.misses = misses if misses is not None else AdmissionMisses(None, True, pool.ledger.block_tokens // 2)

    # -- into a sequence ------------------------------------------------------------------------------
    def reuse(self, request: Request, resumed: bool) -> tuple[int, str]:
        """Fill the request's new sequence with the longest resident run (shared), replaced by the store's
        copy when that is longer: (tokens the sequence holds, where they came from)."""
        source, shared = self.cache.share_into(request)
        if resumed and request.swap is not None and not request.swap.complete:
            return shared, "resident" if shared else "none"   # the store could not take it at swap-out
        if resumed and request.swap is not None and request.swap.snapshot is not None:
            kv, tier, restore_ms = self._restore_snapshot(request, source, shared)
            request.record.swap_in_ms += restore_ms
            return kv, tier
        kv, tier, restore_ms = self._restore_beyond(request, source, shared, explain=not resumed)
        if resumed:
            request.record.swap_in_ms += restore_ms
        return kv, tier

    def _restore_beyond(self, request: Request, source, shared: int, explain: bool = False) -> tuple[int, str, float]:
        """Restore the context's longest stored prefix into the request's sequence when it beats the
        `shared` cells from `source`: (tokens the sequence holds then, their tier, ms spent restoring).
        `explain` (a first admission): the record says why the rest of the prompt was not reused."""
        kept = shared, "resident" if shared else "none", 0.0
        enough = shared + self.ledger.block_tokens // 2    # less is not worth replacing the shared cells
        if len(request.context) - 1 <= enough:
            if explain:
                self.misses.resident_only(request, self.store_for(request.salt), shared, resident_tokens(source))
            return kept     # the resident run covers all the store could give
        start = time.perf_counter()
        ticket = request.swap
        sequences = ticket.sequences if ticket is not None and ticket.sequences is not None else \
            self.store_for(request.salt)
        try:
            plan = sequences.restore(request.context, request.swap, at_least=enough)
        except StoreFault as exc:   # a storage fault is a counted miss: the resident cells stay, the rest is computed
            log.warning("restore lookup for %s failed (%s); recomputing past %d shared tokens", request.holder, exc,
                        shared)
            self.journal.counters["restore_failed"] += 1
            request.record.add_note(f"restore failed ({exc}); recomputed")
            if explain:
                self.misses.store_fault(request, shared, exc)
            return kept
        usable = plan.matched_tokens
        whole_swap = ticket is not None and usable == len(request.context) - 1   # a swapped context, all of it back
        if self.exact and not whole_swap:   # the rest prefills as a solo run would (kvbridge.scheduler.exact)
            usable = safe_reuse(usable, len(request.prompt), self.rule)
        restored = usable > enough and plan.state is not None   # judged on what exact mode keeps of it
        if explain:
            self.misses.after_lookup(request, sequences, plan, shared, resident_tokens(source), restored, usable)
        if not restored:
            return kept
        self.pool.empty(request)   # the store's copy replaces the shared cells: one sequence, one source
        try:
            self._load(request.seq, plan.state.data, plan.matched_tokens)
        except KVBridgeError as exc:
            kv = self._recompute_after_failed_restore(request, source, shared, exc)
            if explain:
                self.misses.refused(request, kv, exc)
            return kv, "resident" if kv else "none", (time.perf_counter() - start) * 1e3
        held = usable
        if held < plan.matched_tokens:   # exact mode's cut (usable is the plan's reach otherwise)
            self._ctx.seq_rm(request.seq, held, -1)
            self.journal.counters["exact_cut_tokens"] += plan.matched_tokens - held
        self.ledger.grow(request.held, held, request.holder)
        self.journal.counters["restored_tokens"] += held
        self.journal.event("restore", request, f"{held} tokens from {plan.tier}")
        return held, plan.tier if held else "none", (time.perf_counter() - start) * 1e3

    def _restore_snapshot(self, request: Request, source, shared: int) -> tuple[int, str, float]:
        """A recurrent model's swapped-out sequence back from its whole-sequence snapshot
        (SequenceStore.swap_out_whole), bit for bit, unless resident cells already hold as much of it."""
        ticket = request.swap
        if ticket.n_tokens <= shared:
            return shared, "resident", 0.0
        start = time.perf_counter()
        self.pool.empty(request)
        try:
            self._load(request.seq, ticket.snapshot, ticket.n_tokens)
        except KVBridgeError as exc:
            kv = self._recompute_after_failed_restore(request, source, shared, exc)
            return kv, "resident" if kv else "none", (time.perf_counter() - start) * 1e3
        self.ledger.grow(request.held, ticket.n_tokens, request.holder)
        self.journal.counters["restored_tokens"] += ticket.n_tokens
        self.journal.event("restore", request, f"{ticket.n_tokens} tokens from its swap snapshot")
        return ticket.n_tokens, "snapshot", (time.perf_counter() - start) * 1e3

    def _load(self, seq: int, data, n_tokens: int) -> None:
        """Put a state of n_tokens positions into the empty sequence `seq`; StateTransferError unless it holds
        exactly those and, for a recurrent model, its recurrent state follows the last of them (llama.cpp
        accepts a state whose recurrent position disagrees with its cells, with a warning only)."""
        self._ctx.load_seq(seq, data)
        held = self._ctx.seq_len(seq)
        if held != n_tokens:
            raise StateTransferError(f"the sequence holds {held} positions after restoring {n_tokens}")
        if self.geometry is not None:
            try:
                pos = parse_recurrent_capture(self._ctx.save_recurrent(seq), self.geometry).pos
            except LayoutError as exc:
                raise StateTransferError(f"the restored recurrent state is not understood: {exc}") from exc
            if pos != n_tokens - 1:
                raise StateTransferError(f"the restored recurrent state follows position {pos}, not {n_tokens - 1}")

    def _recompute_after_failed_restore(self, request: Request, source, shared: int, exc: Exception) -> int:
        """llama.cpp refused the state (no room for its cells near capacity, or a layout it does not
        take) after the sequence gave up its shared cells for it. Share them again (no new cells, which
        the cache is short of) and recompute the rest; the count returned is what the sequence really
        holds, so the next decode continues at cells that are there, not past missing ones."""
        log.warning("restore into sequence %d failed (%s); recomputing past %d shared tokens", request.seq, exc, shared)
        self.journal.counters["restore_failed"] += 1
        request.record.restore_ok = False
        request.record.add_note(f"restore failed ({exc}); recomputed")
        self.pool.empty(request)   # whatever a refused load left behind
        if shared > 0:
            self.pool.share(request, source, shared)
        held = self._ctx.seq_len(request.seq)
        if held != shared:     # the cells are not what the ledger says: recompute all of it
            self.pool.empty(request)
            held = 0
        self.journal.event("restore-failed", request,
                           f"{exc}; {held} tokens kept, {len(request.context) - held} recomputed")
        return held

    # -- out of a sequence ----------------------------------------------------------------------------
    def swap_out(self, request: Request, n_tokens: int) -> SwapTicket:
        """Store the first n_tokens of the request's context from its sequence, pinned until it resumes."""
        data = self._ctx.save_seq(request.seq)
        # a recurrent state cannot be cut into chunks, and exact mode's swapped-out cells come back bit for bit and
        # stay private: its generated tokens' KV, computed one at a time, must never serve another prompt's prefill
        if self.geometry is not None or (self.exact and not self.window):
            return self.store_for(request.salt).swap_out_whole(data, n_tokens)
        # a sliding-window model's state holds only its last window's rows: exact mode swaps it out through the
        # store, whose restore gives back every cell where it was, under a salt of the scheduler's own
        sequences = self.store_for(request.salt + self._swap_salt_tag if self.exact else request.salt)
        capture = self.window_captures(request.seq, data)
        ticket = sequences.swap_out(data, request.context[:n_tokens], capture)
        if self.exact:
            ticket.sequences = sequences
        return ticket

    def worth_storing(self, request: Request) -> bool:
        """What it reused came from the store or from a sequence whose prompt was stored, so only what
        lies beyond is new: worth storing unless every whole chunk is there already and the rest is a
        few tokens (a new question after a shared document). That tail would cost a copy of the whole
        sequence's state (tens of MB) and a tail object of up to a chunk to save recomputing a few
        tokens, and on a 2-core machine it competes with the next request's prefill."""
        if request.blend:
            return False   # blended KV never becomes exact chunks (its passages are stored by BlendPlacer.store_passages)
        reused, n = request.record.matched_tokens, len(request.prompt)
        new_tokens = n - reused
        c = self.chunk_size
        return new_tokens > 1 and not (reused // c >= n // c and new_tokens < c // 4)

    def store_prompt(self, request: Request) -> None:
        """Queue the request's prompt KV for the store's background writer, once, when it is due (a request
        that answers only once it is stored is never skipped for a full queue)."""
        if request.store_pending and request.seq is not None:
            request.store_pending = False
            data = self._ctx.save_seq(request.seq)
            boundaries, request.boundaries = request.boundaries, {}   # the store's now; the request takes no more
            self.store_for(request.salt).store_behind(data, request.prompt, self.window_captures(request.seq, data),
                                                      boundaries.get if self.geometry is not None else None,
                                                      must=request.store_before_answer)

    def answer_after_store(self, request: Request) -> None:
        """A store_before_answer request: its Future resolves on the writer, after the prompt's write queued
        before (writes run in order), with record.stored_tokens = the leading prompt tokens the store holds
        then (a lookup). The loop goes on meanwhile; close() fails what a closed writer never ran."""
        sequences = self.store_for(request.salt)
        self.awaiting_store[request.id] = request

        def answer() -> None:
            try:
                request.record.stored_tokens = sequences.stored_prefix(request.prompt)
            finally:   # answered even when the lookup failed (the writer logs it): stored_tokens then says 0
                if self.awaiting_store.pop(request.id, None) is not None:
                    resolve(request.future, request.record)

        sequences.shared.run_in_order(answer)

    def window_captures(self, seq: int, data) -> Callable[[int], WindowCapture | None] | None:
        """Sliding-window models: a saved state holds the window rows of its last positions only; the
        earlier windows are read now, on this thread (llama.cpp's context is not shared), through a
        free sequence id, for ChunkKV.store_prompt to take later (its capture calls, precomputed:
        each asks one position past the rows still missing). None: no window, or no free sequence."""
        window = self.window
        if not window or len(self.pool.free) < (2 if self.exact else 1):
            return None
        start = parse_state(data, window=window).window_start
        scratch = self.pool.free[-1]
        spare = self.pool.free[-2] if self.exact else None   # exact mode: flushes llama.cpp's stream copy
        captured: dict[int, WindowCapture] = {}
        while start > 0:
            end = start + 1
            captured[end] = WindowCapture(self._ctx.save_window(seq, scratch, end, spare), whole_state=False,
                                          trusted_end=end)
            start = max(0, end - window)
        return captured.get
