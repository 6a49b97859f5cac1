"""llama.cpp's sequence ids and the ledger's account of their cells, changed together.

The context has a fixed number of sequences (running slots, cached prefixes, one spare); a request or
a cached prefix takes one, and scratch work (blend placement, window captures) borrows one for a
moment. Whatever empties a sequence in llama.cpp releases its blocks in the ledger in the same call,
so the ledger (kvbridge.scheduler.ledger) stays the true account of the cells.
"""
from __future__ import annotations

from kvbridge.scheduler.ledger import BlockLedger, Holding


class SequencePool:
    def __init__(self, ctx, ledger: BlockLedger) -> None:
        self._ctx = ctx
        self.ledger = ledger
        self.free: list[int] = list(range(ctx.n_seq))

    def take(self) -> int:
        """The lowest-numbered free sequence (a request's or a cached prefix's own)."""
        return self.free.pop(0)

    def borrow(self) -> int:
        """A free sequence for scratch work, handed back with `give_back`."""
        return self.free.pop()

    def give_back(self, seq: int) -> None:
        self._ctx.seq_rm(seq)
        self.free.append(seq)

    def free_holder(self, holder) -> None:
        """A request's or cached prefix's sequence emptied and freed, its blocks released."""
        if holder.seq is not None:
            self.give_back(holder.seq)
            holder.seq = None
        if holder.held is not None:
            self.ledger.release(holder.held)
            holder.held = None

    def share(self, request, source, n_tokens: int) -> None:
        """The first n_tokens of `source`'s cells join the request's (empty) sequence: seq_cp, no copy."""
        self._ctx.seq_cp(source.seq, request.seq, n_tokens)
        request.held = self.ledger.share(source.held, request.holder, n_tokens)

    def empty(self, request) -> None:
        """The request's sequence gives up every cell it holds (its sequence id stays with it)."""
        self._ctx.seq_rm(request.seq)
        self.ledger.release(request.held)
        request.held = Holding(request.holder)
