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
- a prompt's KV is stored after its prefill on a background thread (off the TTFT path); what the
  store then holds of a prompt (`stored_prefix`) and in which medium (`media`) is asked the store.

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

import functools
import itertools
import logging
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, Sequence

from blake3 import blake3

from kvbridge.backends.base import SeqState, WindowCapture
from kvbridge.engine.assembly_buffer import AssemblyBuffer
from kvbridge.engine.chunks import ChunkKV, ForeignState, common_prefix_length
from kvbridge.engine.hashing import make_hasher, tail_key, tokens_digest
from kvbridge.formats.llama_state import KVGeometry
from kvbridge.settings import Settings
from kvbridge.store.behind import BehindWriter

log = logging.getLogger(__name__)

SWAP_TAIL_PREFIX = b"kvb-swap-tail:"
MEDIA_WINDOW, MAX_MEDIA_WINDOW = 32, 2048   # hashes per lookup in media(): after a miss, and at most
MEMORY_TIERS = {"L1"}   # the embedded store's RAM tier and the cache server's shared-memory L1 have this name


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
    # the SequenceStore holding it when not its request's salt's (exact mode's private swap space)
    sequences: "SequenceStore | None" = None

    def release(self) -> None:
        self.pins.close()
        self.snapshot = None


class QueuedPrompts:
    """The prompts queued in the shared writer or being written now, by namespace: KV the store does not hold
    yet, so a restore that stops short of one is `lease_busy` (a follow-up sent the moment an answer came),
    not `none_stored` (kvbridge.scheduler.misses). Bounded by the writer's queue; any thread."""

    def __init__(self) -> None:
        self._prompts: dict[int, tuple[str, list[int]]] = {}
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, namespace: str, tokens: Sequence[int]) -> int:
        with self._lock:
            number = next(self._numbers)
            self._prompts[number] = (namespace, list(tokens))
            return number

    def done(self, number: int) -> None:
        with self._lock:
            self._prompts.pop(number, None)

    def reach(self, namespace: str, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` a queued prompt of `namespace` holds (0: none)."""
        with self._lock:
            queued = [prompt for ns, prompt in self._prompts.values() if ns == namespace]
        return max((common_prefix_length(prompt, tokens) for prompt in queued), default=0)


class SequenceStoreShared:
    """What every salt's SequenceStore shares: one writer thread (prompts stored in order, a bounded queue) and one
    assembly buffer (restores run one at a time, on the scheduler's loop)."""

    def __init__(self, write_queue: int = 16) -> None:
        self.writer = BehindWriter(_run_job, write_queue, name="kvbridge-sched-store")
        self.buffer = AssemblyBuffer()
        self.queued = QueuedPrompts()   # what the writer holds and the store not yet
        self.skipped_writes = 0
        self.waited_writes = 0   # writes that must not be skipped and found the queue full (run_in_order)

    def run_in_order(self, job: Callable[[], None]) -> None:
        """Run `job` on the writer after every write queued before it, never skipped: a full queue is waited
        out (drained) on the caller's thread, and a writer that still refuses (closed) has it run here."""
        if self.writer.submit(job):
            return
        self.waited_writes += 1
        self.writer.drain()
        if not self.writer.submit(job):
            job()

    def close(self) -> None:
        self.writer.close()
        self.buffer.close()


class SequenceStore:
    """One namespace's (one cache salt's) sequences in the store: swapped-out ones, pinned until they
    resume, and finished prompts, stored behind the loop; both restored by the longest stored prefix."""

    def __init__(self, store, settings: Settings, namespace: str, geometry: KVGeometry,
                 shared: SequenceStoreShared | None = None, n_stream: int = 1) -> None:
        """n_stream: the KV streams of the scheduler's context (KVB_SCHED_EXACT: one per sequence id), which a
        restored state must name."""
        self.store = store
        self.hasher = make_hasher(settings.chunk_size, namespace, settings.prefer_lmcache_hasher)
        self.seed = getattr(self.hasher, "seed", b"")
        self._own_shared = shared is None
        self.shared = shared if shared is not None else SequenceStoreShared()
        self.kv = ChunkKV(store, namespace, self.seed, settings.chunk_size, geometry, buffer=self.shared.buffer)
        self.kv.prefault_scratch = False
        self.kv.n_stream = n_stream
        # told (tokens, whole chunks the store holds) after a prompt or a swapped-out context was written: the
        # scheduler's kv listeners, on the unsalted store only (kvbridge.scheduler.kv_listeners)
        self.on_stored: Callable[[tuple[int, ...], int], None] | None = None

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
        held = self.store.lookup(hashes[:whole], namespace=self.kv.namespace, purpose="store").n_hit
        if held and self.on_stored is not None:
            self.on_stored(tuple(tokens), held)
        found = held == whole
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
                     boundary: Callable[[int], bytes | None] | None = None, must: bool = False) -> bool:
        """Queue a prompt's KV (a buffer of its own, out of llama.cpp: LlamaContext.save_seq) for storing;
        False when the queue is full (the write skipped, counted). boundary: a recurrent model's states captured
        where chunks end (by the number of tokens before them), which its chunks carry. must: never skipped
        (SequenceStoreShared.run_in_order: a full queue is waited out)."""
        queued = self.shared.queued.add(self.kv.namespace, tokens)
        job = functools.partial(self._store_prompt, data, list(tokens), capture, boundary, queued)
        if must:
            self.shared.run_in_order(job)
            return True
        if self.shared.writer.submit(job):
            return True
        self.shared.queued.done(queued)
        self.shared.skipped_writes += 1
        return False

    def queued_reach(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` a prompt queued for this namespace's store (not written yet) holds."""
        return self.shared.queued.reach(self.kv.namespace, tokens)

    def _store_prompt(self, data, tokens: list[int], capture, boundary, queued: int = 0) -> None:
        """The writer's job: one prompt's KV into the store (a failure is logged by the writer and costs a
        later miss, never the scheduler's loop), then the listener told what the store holds of it."""
        hashes = self.hashes(tokens)
        try:
            self.kv.store_prompt(SeqState(data=data, n_tokens=len(tokens), token_ids=tuple(tokens)), tokens, hashes,
                                 capture=capture, boundary=boundary)
        finally:
            self.shared.queued.done(queued)
        if self.on_stored is not None and hashes:
            held = self.store.lookup(hashes, namespace=self.kv.namespace, purpose="kv_events").n_hit
            if held:
                self.on_stored(tuple(tokens), held)

    def stored_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the store holds now: its whole chunks (a lookup), then the tail
        filed after the last of them when its token ids are these (the tail key is shared by every prompt with
        the same chunks, so its digest is checked; a tail ends at most where `tokens` end)."""
        c = self.kv.chunk_size
        hashes = self.hashes(tokens)
        held = self.store.lookup(hashes, namespace=self.kv.namespace, purpose="store").n_hit
        start = held * c
        if held < len(hashes) or start >= len(tokens):
            return start
        found = self.store.get(tail_key(hashes[held - 1] if held else self.seed), namespace=self.kv.namespace)
        if found is None:
            return start
        try:
            n = found.meta.n_tokens
            if 0 < n <= len(tokens) - start and found.meta.tokens_digest == tokens_digest(tokens[start:start + n]):
                return start + n
            return start
        finally:
            if found.release is not None:
                found.release()

    def media(self, hashes: Sequence[bytes], deadline_s: float) -> list[str | None]:
        """Where the store holds each chunk hash now: "CPU" (a tier in RAM: L1, or the cache server's L1 in
        shared memory), "DISK" (L2 on disk, L3 on Redis) or None (not held). A lookup answers for a leading run
        only, so each miss costs one more; each asks a window of the hashes (a cache server's lookup costs
        per hash sent), doubled while all hit and small again after a miss. Past `deadline_s` (a slow or
        faulty store, whose faults are its counted misses) no lookup starts and the rest are None."""
        media: list[str | None] = [None] * len(hashes)
        end = time.monotonic() + deadline_s
        at, window = 0, MEDIA_WINDOW
        while at < len(hashes) and time.monotonic() < end:
            asked = list(hashes[at:at + window])
            found = self.store.lookup(asked, namespace=self.kv.namespace, purpose="kv_events")
            for offset, tier in enumerate(found.tiers):
                media[at + offset] = "CPU" if tier in MEMORY_TIERS else "DISK"
            if found.n_hit == len(asked):
                at, window = at + len(asked), min(window * 2, MAX_MEDIA_WINDOW)
            else:
                at, window = at + found.n_hit + 1, MEDIA_WINDOW
        return media

    def drain(self) -> None:
        self.shared.writer.drain()

    def close(self) -> None:
        """Closes the shared writer and buffer only when this store made them (the scheduler closes its own)."""
        self.kv.close()
        if self._own_shared:
            self.shared.close()


def _run_job(job: Callable[[], None]) -> None:
    """The shared writer runs each job as it is: a prompt's store, or what must follow the writes before it."""
    job()


def swap_tail_key(boundary: bytes, tail_tokens: Sequence[int]) -> bytes:
    """A swapped-out tail's own key: the chunk boundary it follows and its exact token ids."""
    return blake3(SWAP_TAIL_PREFIX + bytes(boundary) + tokens_digest(tail_tokens)).digest()
