"""A request's way through the queues: started (with as much of its context as resident cells or the
store hold), preempted (swapped out), finished (its prompt kept and stored), cancelled, or failed.

Each move changes a queue, a sequence and the ledger together, and records it (events, counters,
the request's record). Faults stay with the requests they touch: an operation marks the requests it
is changing (`working_on`), and an exception in a step fails only those (their futures get it,
their sequences and blocks are freed: `faults`, `failed`) while the loop goes on.
"""
from __future__ import annotations

import contextlib
import time

from kvbridge.scheduler.blend_placement import BlendPlacer
from kvbridge.scheduler.events import Journal
from kvbridge.scheduler.ledger import Holding
from kvbridge.scheduler.prefix_cache import PrefixCache
from kvbridge.scheduler.requests import Queues, Request
from kvbridge.scheduler.restorer import Restorer, resolve
from kvbridge.scheduler.sequences import SequencePool


class Lifecycle:
    def __init__(self, ctx, queues: Queues, pool: SequencePool, cache: PrefixCache, restorer: Restorer,
                 blend: BlendPlacer, chunk_size: int, journal: Journal) -> None:
        self._ctx = ctx   # the context the moved sequences live in (the tests read their state through it)
        self.queues = queues
        self.pool = pool
        self.cache = cache
        self.restorer = restorer
        self.blend = blend
        self.chunk_size = chunk_size
        self.journal = journal
        self._involved: list[Request] = []   # the requests the step's operation in progress is changing

    # -- fault scope ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def working_on(self, *requests: Request):
        """Mark the requests an operation is changing: if the step fails inside it, they are the ones
        left half-changed (a sequence taken, cells decoded but not accounted), so they are the ones failed."""
        mark = len(self._involved)
        self._involved.extend(requests)
        yield
        del self._involved[mark:]

    def fail_step(self, exc: Exception) -> None:
        """Fail the requests whose operation the exception interrupted (a batch's, a start's, a
        preemption's) and free their sequences and blocks, so the loop goes on serving the others. A
        fault outside every request's operation is one in the policy itself, which would recur each
        step: then every queued request is failed (and freed) rather than the loop spinning on it."""
        involved = self._involved or self.queues.everyone()
        self._involved = []
        self.journal.counters["faults"] += 1
        seen: set[int] = set()
        for request in involved:
            if request.id not in seen:
                seen.add(request.id)
                self.abort(request, exc)

    # -- the moves ------------------------------------------------------------------------------------
    def start(self, request: Request, resumed: bool) -> None:
        """Give the request a sequence holding as much of its context as resident cells or the store have."""
        with self.working_on(request):
            request.seq = self.pool.take()
            request.held = Holding(request.holder)
            if request.blend and not resumed:
                kv, tier = self.blend.place(request)
            else:
                kv, tier = self.restorer.reuse(request, resumed)
            self.release_swap(request)   # restored (or to be recomputed): the store may evict them again
            context = request.context
            if resumed:
                self.journal.counters["swap_ins"] += 1
                if kv < len(context) - 1:
                    self.journal.counters["recomputed"] += 1
                self.journal.event("swap-in", request, f"{kv} of {len(context)} tokens restored")
            else:
                self.journal.counters["hits" if kv else "misses"] += 1
                if not request.blend:   # a blend request's positions held include the tokens it recomputed
                    request.record.matched_tokens = kv
                request.record.chunks_hit = kv // self.chunk_size
                request.record.tier = tier
                if request.record.restore_ok is None:   # False stays: a restore failed and was recomputed
                    request.record.restore_ok = True if kv else None
                self.journal.event("admit", request, f"{len(context)} tokens, {kv} reused ({tier})")
            request.kv_tokens = kv
            request.pending = context[kv:]
            request.state = "running"
            self.queues.running.append(request)

    def preempt(self, request: Request, why: str) -> None:
        """Swap the request's KV out to the store, free its cells, and queue it to resume later."""
        with self.working_on(request):
            start = time.perf_counter()
            self.queues.running.remove(request)
            kept = request.kv_tokens
            if request.blend:
                # blended KV is not what the exact store may hold: resumed, it is recomputed exactly
                request.blend = False
                request.record.add_note("blend: preempted; resumed by computing the context exactly")
            elif kept > 0:
                request.swap = self.restorer.swap_out(request, kept)
            self.pool.free_holder(request)
            request.kv_tokens = 0
            request.pending = request.context
            request.state = "swapped"
            request.record.preemptions += 1
            request.record.swap_out_ms += (time.perf_counter() - start) * 1e3
            self.queues.swapped.append(request)
            self.journal.counters["preemptions"] += 1
            self.journal.event("preempt", request, why)
            lost = request.swap is not None and not request.swap.complete
            self.journal.event("swap-out", request, f"{kept} tokens" + (" (store refused: will recompute)" if lost else ""))

    def finish(self, request: Request) -> None:
        """The answer is complete: on its Future first, then its prompt stored and kept resident (a
        store_before_answer request: its prompt stored first, its Future resolved by the writer after)."""
        tail = request.pieces.flush()
        if tail:
            request.text += tail
            if request.on_token is not None:
                request.on_token(tail)
        self.queues.running.remove(request)
        request.state = "done"
        record = request.record
        record.text = request.text
        record.gen_tokens = len(request.generated)
        record.total_ms = (time.perf_counter() - request.submitted) * 1e3
        self.journal.counters["finished"] += 1
        self.journal.event("finish", request, f"{record.gen_tokens} tokens")
        if request.store_before_answer:
            self.restorer.store_prompt(request)        # queued at its first token already, unless it ends here
            self.restorer.answer_after_store(request)  # on the writer, after that write
        else:
            resolve(request.future, record)   # first: what follows is housekeeping, not the answer's time
            self.restorer.store_prompt(request)
        if request.blend:
            self.blend.store_passages(request)
        self.cache.keep(request)
        self.pool.free_holder(request)

    def end_full_streams(self, batch, stream_cells: int) -> bool:
        """Exact mode: a sequence whose stream (KVB_CTX_SIZE cells) has no room for its next token ends its answer
        there, as llama-server's slot does at its context's end; whether one did."""
        ended = False
        for request, feed in batch:
            if request.kv_tokens + len(feed) > stream_cells and request.state == "running":
                request.record.add_note(f"the answer stopped at the context's end ({stream_cells} cells, KVB_CTX_SIZE)")
                self.finish(request)
                ended = True
        return ended

    def drop_cancelled(self) -> None:
        """Requests whose Future was cancelled leave their queue, their sequence and blocks freed."""
        queues = self.queues
        for queue_ in (queues.waiting, queues.running, queues.swapped):
            for request in [r for r in queue_ if r.future.cancelled()]:
                with self.working_on(request):
                    queue_.remove(request)
                    self.pool.free_holder(request)
                    self.release_swap(request)
                request.state = "done"
                self.journal.counters["cancelled"] += 1
                self.journal.event("cancel", request)

    def abort(self, request: Request, error: Exception) -> None:
        """A request a fault left half-changed: out of its queue, its sequence and blocks freed, the
        error on its future (counted; one that has its answer already is only freed)."""
        self.queues.remove_everywhere(request)
        self.pool.free_holder(request)
        answered = request.future.done()
        self.fail(request, error)
        if not answered:
            self.journal.counters["failed"] += 1
            self.journal.event("fail", request, f"{type(error).__name__}: {error}")

    def fail(self, request: Request, error: Exception) -> None:
        """The request is done with `error` on its Future (unless it has its answer already)."""
        request.state = "done"
        self.release_swap(request)
        if not request.future.done():
            request.future.set_exception(error)

    @staticmethod
    def release_swap(request: Request) -> None:
        """Unpin what the request's swap-out left in the store: the store may evict it again."""
        if request.swap is not None:
            request.swap.release()
            request.swap = None
