"""A cache salt's view of the store: the scheduler's swap space and long-term memory for sequences,
in CachedEngine's own object format (the scheduler's restorer, kvbridge.scheduler.restorer, calls it).

A sequence's KV leaves llama.cpp as `llama_state_seq_get_data` bytes and is cut into content-addressed
chunk and tail objects by ChunkKV (the same objects CachedEngine's lmcache mode stores, under the
same namespace), so what the scheduler stores a restart or another process restores, and the other
way round. Three uses:

- swap-out: a preempted sequence's whole context is stored and its objects pinned until it resumes
  (the store's pressure may not evict them); the ticket says whether the store really holds all of
  it. Whole chunks are content-addressed; the cells after the last whole chunk go under a key of
  their own (the boundary and the tail's token digest), not under the shared tail key that every
  prompt with the same leading chunks writes, so another request's prompt cannot replace them;
- swap-in and admission: the longest stored prefix of a context is restored into a sequence;
- a prompt's KV is stored after its prefill on a background thread (off the TTFT path).

A recurrent or hybrid model's chunks carry the recurrent state captured where each ends (the
scheduler's prefill steps end there: `boundary`). A swapped-out sequence of such a model is kept as
one whole-sequence snapshot instead (`swap_out_whole`): its recurrent state exists only at its
current position, not at the chunk ends its decode steps passed, and a tail object cannot carry it
(ChunkKV.store_tail refuses recurrent layouts), while llama.cpp restores a whole-sequence state
bit for bit.

One SequenceStore per cache salt (its namespace seeds every key), all of them sharing one background
writer and one assembly buffer (`SequenceStoreShared`): a new salt costs a hasher and an entry in a
bounded table (kvbridge.scheduler.salts), never a thread or a 40 MB buffer of its own.
"""
from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, Sequence

from blake3 import blake3

from kvbridge.backends.base import SeqState, WindowCapture
from kvbridge.engine.assembly_buffer import AssemblyBuffer
from kvbridge.engine.chunks import ChunkKV, ForeignState
from kvbridge.engine.hashing import make_hasher, tokens_digest
from kvbridge.formats.llama_state import KVGeometry
from kvbridge.settings import Settings
from kvbridge.store.behind import BehindWriter

log = logging.getLogger(__name__)

SWAP_TAIL_PREFIX = b"kvb-swap-tail:"


@dataclass
class SwapTicket:
    """What a swap-out left in the store: whether all of it, the pins that keep it there until the
    request resumes, and its own tail (boundary, key) for the restore."""

    complete: bool
    pins: ExitStack = field(default_factory=ExitStack)
    tail: tuple[bytes, bytes] | None = None
    # a recurrent model's swapped-out sequence: its whole llama.cpp state (every attention cell and the
    # recurrent state after its last position) and how many positions that is
    snapshot: bytes | memoryview | None = None
    n_tokens: int = 0

    def release(self) -> None:
        self.pins.close()
        self.snapshot = None


class SequenceStoreShared:
    """What every salt's SequenceStore shares: one writer thread (prompts stored in order, a bounded queue) and one
    assembly buffer (restores run one at a time, on the scheduler's loop)."""

    def __init__(self, write_queue: int = 16) -> None:
        self.writer = BehindWriter(_store_prompt_job, write_queue, name="kvbridge-sched-store")
        self.buffer = AssemblyBuffer()
        self.skipped_writes = 0

    def close(self) -> None:
        self.writer.close()
        self.buffer.close()


class SequenceStore:
    """One namespace's (one cache salt's) sequences in the store: swapped-out ones, pinned until they
    resume, and finished prompts, stored behind the loop; both restored by the longest stored prefix."""

    def __init__(self, store, settings: Settings, namespace: str, geometry: KVGeometry,
                 shared: SequenceStoreShared | None = None) -> None:
        self.store = store
        self.hasher = make_hasher(settings.chunk_size, namespace, settings.prefer_lmcache_hasher)
        self.seed = getattr(self.hasher, "seed", b"")
        self._own_shared = shared is None
        self.shared = shared if shared is not None else SequenceStoreShared()
        self.kv = ChunkKV(store, namespace, self.seed, settings.chunk_size, geometry, buffer=self.shared.buffer)
        self.kv.prefault_scratch = False

    def hashes(self, tokens: Sequence[int]) -> list[bytes]:
        return self.hasher.chunk_hashes(tokens)

    # -- swap -----------------------------------------------------------------------------------------
    def swap_out(self, data, tokens: list[int], capture: Callable[[int], WindowCapture | None] | None = None) -> SwapTicket:
        """Store a context's KV (chunks, and its tail under a key of its own) and pin the objects.
        `capture`: a sliding-window model's earlier window rows (Restorer.window_captures)."""
        hashes = self.hashes(tokens)
        c = self.kv.chunk_size
        whole = len(tokens) // c
        boundary = hashes[whole - 1] if whole else self.seed
        ticket = SwapTicket(False)
        if whole * c < len(tokens):
            ticket.tail = (boundary, swap_tail_key(boundary, tokens[whole * c:]))
        ticket.pins.enter_context(self.store.pinned(list(hashes[:whole]) + [ticket.tail[1]] if ticket.tail else hashes))
        try:
            self._store_swapped(ticket, data, tokens, hashes, capture)
        except BaseException:   # the caller never gets the ticket: unpin here, or the objects stay pinned
            ticket.release()
            raise
        return ticket

    @staticmethod
    def swap_out_whole(data, n_tokens: int) -> SwapTicket:
        """A recurrent or hybrid model's preempted sequence: a copy of its whole state, held in this process
        until it resumes (the store's objects are cut by chunk, and no chunk or tail can carry a recurrent
        state taken between chunk ends; only this process ever resumes the sequence). `data`: a buffer of its own
        (LlamaContext.save_seq's), kept without a copy."""
        return SwapTicket(True, snapshot=data, n_tokens=n_tokens)

    def _store_swapped(self, ticket: SwapTicket, data, tokens: list[int], hashes: list[bytes], capture) -> None:
        """Store the pinned objects and mark the ticket complete when the store really holds all of them."""
        c = self.kv.chunk_size
        whole = len(tokens) // c
        self.drain()   # a queued prompt store of the same chunks lands first, not after us
        try:
            self.kv.store_prompt(SeqState(data=data, n_tokens=len(tokens), token_ids=tuple(tokens)), tokens, hashes,
                                 capture=capture)
        except ForeignState as exc:   # cannot happen with our own sequence; recompute rather than trust it
            log.warning("swap-out not stored: %s", exc)
            return
        found = self.store.lookup(hashes[:whole], namespace=self.kv.namespace).n_hit == whole
        tail = ticket.tail is None or (self.kv.store_tail(data, tokens, whole * c, ticket.tail[1], capture)
                                       and self.store.contains(ticket.tail[1], namespace=self.kv.namespace))
        ticket.complete = found and tail

    def restore(self, tokens: list[int], ticket: SwapTicket | None = None, at_least: int = 0):
        """The longest stored prefix of `tokens` (at most all but the last), with a swapped-out
        sequence's own tail when `ticket` is given: a RestorePlan whose state is set when matched_tokens
        > at_least (a shorter one is not assembled: the caller holds that much already)."""
        plan = self.kv.find_prefix(tokens, self.hashes(tokens), tail_override=ticket.tail if ticket else None)
        try:
            if plan.matched_tokens > at_least:
                self.kv.assemble(plan)
        finally:
            plan.release()
        return plan

    # -- prompts --------------------------------------------------------------------------------------
    def store_behind(self, data, tokens: list[int], capture: Callable[[int], WindowCapture | None] | None = None,
                     boundary: Callable[[int], bytes | None] | None = None) -> bool:
        """Queue a prompt's KV (a buffer of its own, out of llama.cpp: LlamaContext.save_seq) for storing;
        False when the queue is full. boundary: a recurrent model's states captured where chunks end (by the
        number of tokens before them), which its chunks carry."""
        if self.shared.writer.submit((self, data, list(tokens), capture, boundary)):
            return True
        self.shared.skipped_writes += 1
        return False

    def drain(self) -> None:
        self.shared.writer.drain()

    def close(self) -> None:
        """Closes the shared writer and buffer only when this store made them (the scheduler closes its own)."""
        self.kv.close()
        if self._own_shared:
            self.shared.close()


def _store_prompt_job(job) -> None:
    """The shared writer's job: one prompt's KV into its salt's SequenceStore (a failure is logged by the writer
    and costs a later miss, never the scheduler's loop)."""
    sequences, data, tokens, capture, boundary = job
    sequences.kv.store_prompt(SeqState(data=data, n_tokens=len(tokens), token_ids=tuple(tokens)), tokens,
                              sequences.hashes(tokens), capture=capture, boundary=boundary)


def swap_tail_key(boundary: bytes, tail_tokens: Sequence[int]) -> bytes:
    """A swapped-out tail's own key: the chunk boundary it follows and its exact token ids."""
    return blake3(SWAP_TAIL_PREFIX + bytes(boundary) + tokens_digest(tail_tokens)).digest()
