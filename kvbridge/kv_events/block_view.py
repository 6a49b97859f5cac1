"""What this instance holds, as blocks a router can route by: the scheduler's listener on one side,
KV events on the other.

The scheduler tells the view two things (both return at once; the work happens on the view's thread):
`resident(runs)`, every token run whose KV is in llama.cpp's context now, and `stored(tokens, n)`, a
prompt's first n chunks written to the store. The view cuts runs into whole chunks (block size = the
chunk size), names each block by its chunk hash's first 8 bytes, and keeps per block the media it is
in: "GPU" while resident (no transfer needed), and "CPU" (store L1) or "DISK" (L2/L3) while the store
has it. It publishes the difference between that and what consumers were last told: BlockStored per
medium gained (a block's parent always announced before it: consumers skip orphans), BlockRemoved per
medium lost. A block in two media is two claims, as vllm-router keeps them (one per tier), so a prefix
that is partly resident and wholly in L1 still matches to its end on the CPU tier.

Nothing tells the view when the store evicts, so every `check_s` it asks `scheduler.stored_media` for
every block it claims is stored and publishes what changed: no claim outlives its block by more than
check_s plus the send. A new subscriber (or one reconnecting after a gap it could not replay) gets
AllBlocksCleared and every current claim, so a PUB/SUB late joiner is not left blind or stale. PUB sends
that to every subscriber, so re-announcements are coalesced: at most one per RESYNC_MIN_INTERVAL_S,
however many subscriptions arrive (a subscription storm costs one announcement per interval, not one
per subscription; a joiner waits at most that long for its first view).
State is bounded: at most MAX_BLOCKS blocks, the oldest non-resident ones dropped (with BlockRemoved).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

from kvbridge.kv_events import wire

log = logging.getLogger(__name__)
MAX_BLOCKS = 1 << 16
MAX_PENDING_STORES = 1024      # stored() notices waiting; the oldest dropped beyond (an unclaimed block is safe)
CHECK_SLICE = 4096             # hashes per stored_media call
RESYNC_MIN_INTERVAL_S = 2.0    # at most one re-announcement of every claim (to every subscriber) per interval


@dataclass
class Block:
    chunk_hash: bytes
    parent: int | None
    tokens: tuple[int, ...]
    resident: bool = False
    store_medium: str | None = None
    published: set[str] = field(default_factory=set)   # the media consumers were told

    def media(self) -> set[str]:
        return ({"GPU"} if self.resident else set()) | ({self.store_medium} if self.store_medium else set())


class BlockView:
    """The scheduler's kv listener; publishes through `publish(events)` (KVEventPublisher.publish)."""

    def __init__(self, scheduler, publish, *, chunk_size: int, check_s: float, max_blocks: int = MAX_BLOCKS,
                 resync_interval_s: float = RESYNC_MIN_INTERVAL_S):
        self._scheduler = scheduler
        self._publish = publish
        self._cs = chunk_size
        self._check_s = check_s
        self._max_blocks = max_blocks
        self._blocks: collections.OrderedDict[int, Block] = collections.OrderedDict()
        self._resident: set[int] = set()
        self._hash_cache: dict[tuple[int, ...], list[bytes]] = {}
        self._cond = threading.Condition()
        self._pending_runs: list | None = None
        self._pending_stores: collections.deque = collections.deque(maxlen=MAX_PENDING_STORES)
        self._resync = True            # the first cycle tells everyone: nothing held yet
        self._resync_interval_s = resync_interval_s
        self._next_resync = 0.0        # time.monotonic() before which a requested resync waits
        self.resyncs = 0               # re-announcements sent (AllBlocksCleared + every claim)
        self._touch_all = False        # after a fault: recompute every block's claims
        self._closing = False
        self.dropped_stores = 0
        self.faults = 0
        self._thread = threading.Thread(target=self._run, name="kv-events-view", daemon=True)
        self._thread.start()

    # --- the scheduler's listener: queue and return ---
    def resident(self, runs) -> None:
        with self._cond:
            self._pending_runs = list(runs)      # only the newest set matters
            self._cond.notify()

    def stored(self, tokens, n_chunks: int) -> None:
        with self._cond:
            if len(self._pending_stores) == self._pending_stores.maxlen:
                self.dropped_stores += 1
            self._pending_stores.append((tuple(tokens[:n_chunks * self._cs]), n_chunks))
            self._cond.notify()

    def request_resync(self) -> None:
        """A subscriber joined: clear its view and announce every claim (the publisher's on_subscribe)."""
        with self._cond:
            self._resync = True
            self._cond.notify()

    def _resync_due(self) -> bool:
        return self._resync and time.monotonic() >= self._next_resync

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def snapshot(self) -> dict:
        """Claims by medium, for tests and status pages."""
        with self._cond:
            counts = collections.Counter(m for b in list(self._blocks.values()) for m in list(b.published))
            return {"blocks": len(self._blocks), "claims": dict(counts), "dropped_stores": self.dropped_stores,
                    "faults": self.faults, "resyncs": self.resyncs}

    # --- the view's thread ---
    def _run(self) -> None:
        next_check = time.monotonic() + self._check_s
        while True:
            with self._cond:
                while not (self._closing or self._resync_due() or self._pending_runs is not None
                           or self._pending_stores or time.monotonic() >= next_check):
                    wake = next_check if not self._resync else min(next_check, self._next_resync)
                    self._cond.wait(max(0.0, wake - time.monotonic()))
                if self._closing:
                    return
                runs, self._pending_runs = self._pending_runs, None
                stores = list(self._pending_stores)
                self._pending_stores.clear()
                resync = self._resync_due()
                if resync:     # a resync asked for too soon stays pending until its time
                    self._resync = False
                    self._next_resync = time.monotonic() + self._resync_interval_s
                    self.resyncs += 1
            try:
                events = self._cycle(runs, stores, resync, time.monotonic() >= next_check)
            except Exception:                    # a scheduler fault costs this cycle's claims, never the thread
                self.faults += 1
                log.exception("KV events: a view update failed; announcing everything again")
                with self._cond:
                    self._resync = True
                self._touch_all = True
                events = []
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self._check_s
            if events:
                self._publish(events)

    def _cycle(self, runs, stores, resync: bool, check: bool) -> list:
        touched: dict[int, None] = dict.fromkeys(self._blocks) if self._touch_all else {}   # an ordered set
        self._touch_all = False
        if runs is not None:
            self._apply_resident(runs, touched)
        for tokens, n_chunks in stores:
            self._apply_stored(tokens, n_chunks, touched)
        if check:
            self._recheck(touched)
        self._bound(touched)
        events = self._diff(touched)
        if resync:
            events = [wire.AllBlocksCleared()] + self._announce_all()
        return events

    def _hashes(self, tokens: tuple[int, ...]) -> list[bytes]:
        return list(self._scheduler.unsalted_hashes(list(tokens)))

    def _chain(self, tokens: tuple[int, ...], hashes: list[bytes]):
        """(block id, Block) for each whole chunk, created if new, parents first."""
        parent = None
        for i, chunk_hash in enumerate(hashes):
            bid = wire.block_id(chunk_hash)
            block = self._blocks.get(bid)
            if block is None:
                block = self._blocks[bid] = Block(chunk_hash, parent, tokens[i * self._cs:(i + 1) * self._cs])
            else:
                self._blocks.move_to_end(bid)
            yield bid, block
            parent = bid

    def _apply_resident(self, runs, touched: dict) -> None:
        cache: dict[tuple[int, ...], list[bytes]] = {}
        now: set[int] = set()
        for run in runs:
            whole = tuple(run[:len(run) // self._cs * self._cs])
            if not whole or whole in cache:
                continue
            hashes = cache[whole] = self._hash_cache.get(whole) or self._hashes(whole)
            for bid, block in self._chain(whole, hashes):
                block.resident = True
                now.add(bid)
                touched[bid] = None
        self._hash_cache = cache
        gone = [bid for bid in self._resident - now if bid in self._blocks]
        self._resident = now
        for bid in gone:
            self._blocks[bid].resident = False
            touched[bid] = None
        # a block that leaves the context may still be in the store (restored from it, or written by it)
        unknown = [bid for bid in gone if self._blocks[bid].store_medium is None]
        self._ask_store(unknown)

    def _apply_stored(self, tokens: tuple[int, ...], n_chunks: int, touched: dict) -> None:
        hashes = self._hashes(tokens)[:n_chunks]
        chain = list(self._chain(tokens, hashes))
        for bid, _ in chain:
            touched[bid] = None
        self._ask_store([bid for bid, _ in chain])

    def _recheck(self, touched: dict) -> None:
        claimed = [bid for bid, block in self._blocks.items() if block.store_medium]
        before = {bid: self._blocks[bid].store_medium for bid in claimed}
        self._ask_store(claimed)
        for bid in claimed:
            if self._blocks[bid].store_medium != before[bid]:
                touched[bid] = None

    def _ask_store(self, bids: list[int]) -> None:
        for start in range(0, len(bids), CHECK_SLICE):
            part = bids[start:start + CHECK_SLICE]
            media = self._scheduler.stored_media([self._blocks[bid].chunk_hash for bid in part])
            for bid, medium in zip(part, media):
                self._blocks[bid].store_medium = medium if medium in ("CPU", "DISK") else None

    def _bound(self, touched: dict) -> None:
        """Beyond max_blocks, the oldest non-resident blocks stop being claimed (they get no media)."""
        excess = len(self._blocks) - self._max_blocks
        for bid, block in self._blocks.items():
            if excess <= 0:
                break
            if not block.resident:
                block.store_medium = None
                touched[bid] = None
                excess -= 1

    def _diff(self, touched: dict) -> list:
        """Events that bring consumers from what they were told to what is held, for the touched blocks;
        blocks in no medium are forgotten."""
        gained: dict[str, list[int]] = collections.defaultdict(list)
        lost: dict[str, list[int]] = collections.defaultdict(list)
        for bid in touched:
            block = self._blocks.get(bid)
            if block is None:
                continue
            media = block.media()
            for medium in sorted(media - block.published):
                gained[medium].append(bid)
            for medium in sorted(block.published - media):
                lost[medium].append(bid)
            block.published = media
        events = []
        for medium, bids in gained.items():
            events += self._stored_events(self._in_parent_order(bids), medium)
        for medium, bids in lost.items():
            events.append(wire.BlockRemoved(bids, medium))
        for bid in touched:
            block = self._blocks.get(bid)
            if block is not None and not block.published and not block.resident:
                del self._blocks[bid]
        return events

    def _announce_all(self) -> list:
        by_medium: dict[str, list[int]] = collections.defaultdict(list)
        for bid, block in self._blocks.items():
            for medium in block.published:
                by_medium[medium].append(bid)
        events = []
        for medium, bids in sorted(by_medium.items()):
            events += self._stored_events(self._in_parent_order(bids), medium)
        return events

    def _in_parent_order(self, bids: list[int]) -> list[int]:
        """The same blocks, each after its parent when both are in the list."""
        wanted, done, out = set(bids), set(), []
        for bid in bids:
            chain = []
            while bid in wanted and bid not in done:
                chain.append(bid)
                done.add(bid)
                bid = self._blocks[bid].parent
            out += reversed(chain)
        return out

    def _stored_events(self, bids: list[int], medium: str) -> list:
        """One BlockStored per unbroken parent->child chain: that is how vLLM sends them."""
        events: list[wire.BlockStored] = []
        last = None
        for bid in bids:
            block = self._blocks[bid]
            if events and block.parent == last and len(events[-1].block_hashes) < 64:
                events[-1].block_hashes.append(bid)
                events[-1].token_ids.extend(block.tokens)
            else:
                events.append(wire.BlockStored([bid], block.parent, list(block.tokens), self._cs, medium=medium))
            last = bid
        return events
