"""TieredStore's writing half: a put into the levels, copies written behind, eviction with demotion, pins.

Place in the flow: ... -> generate -> save_state -> chunks -> **TieredStore.put**: the first tier
that can hold an object takes it, every persistent tier gets a write-through copy, a remote tier's
copy goes to the write-behind queue (kvbridge.store.behind); a level over its capacity evicts its
least recent objects, each demoted to the next level unless that level has it.

Level pairs a tier with its LRU policy. The policy mirrors the tier: after any tier call that may
have changed a key, its size is copied from the tier into the policy under the store's lock
(`_sync_locked`). TierWrites is a part of TieredStore (kvbridge.store.tiered), whose constructor
sets the state declared below; reads it calls (`_read`) are the store's.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

from kvbridge.store.behind import BehindWriter
from kvbridge.store.history import Eviction, EvictionRing
from kvbridge.store.objects import ObjectMeta, check_key
from kvbridge.store.policy import LRUPolicy
from kvbridge.store.tiers import Tier

log = logging.getLogger("kvbridge.store.tiered")   # the store's one logger, as before it was split


@dataclass
class Level:
    """One tier of the store and the LRU policy that decides what it keeps."""

    tier: Tier
    policy: LRUPolicy


class TierWrites:
    """put() and what keeps each level within its capacity (a part of TieredStore)."""

    _levels: list[Level]
    _lock: threading.RLock
    _counts: Counter[str]
    _evictions: Counter[str]
    _doomed: dict[str, set[bytes]]
    _all_persistent: bool
    _behind: BehindWriter
    history: EvictionRing
    _namespaces_cache: tuple[float, dict[str, int]] | None

    # -- writing ---------------------------------------------------------------------------------
    def put(self, key: bytes, blob: bytes, meta: ObjectMeta) -> bool:
        """Store or replace. False when no tier took it (too large, disk full): counted, not raised."""
        key = check_key(key)
        if not isinstance(blob, bytes) and not (isinstance(blob, memoryview) and self._all_persistent):
            blob = bytes(blob)   # a RAM tier keeps what it is given, so it must own it; a disk tier only writes it out
        if not isinstance(meta, ObjectMeta):
            raise TypeError(f"meta must be an ObjectMeta, got {type(meta).__name__}")
        self._count("puts")
        self.history.forget(key)   # written again: an old eviction no longer explains a miss of it
        stored = False
        for index, level in enumerate(self._levels):
            if stored and not level.tier.persistent:
                continue  # already in a faster tier; only persistent tiers get a write-through copy
            if level.tier.remote:
                stored = self._queue_write(index, key, blob, meta, "written_behind") or stored
            elif self._put_into(index, key, blob, meta):
                stored = True
        if not stored:
            self._count("put_failures")
        elif self._namespaces_cache is not None and meta.namespace not in self._namespaces_cache[1]:
            self._namespaces_cache = None   # a namespace the cached listing lacks: the next probe_miss lists again
        return stored

    def put_many(self, items: list[tuple[bytes, bytes, ObjectMeta]]) -> list[bool]:
        """put() for each (key, blob, meta) (a remote store stores them in one round trip)."""
        return [self.put(key, blob, meta) for key, blob, meta in items]

    def _queue_write(self, index: int, key: bytes, blob, meta: ObjectMeta, counter: str) -> bool:
        """A copy for level `index`, written behind the request; False (counted) when the queue is full."""
        if not isinstance(blob, bytes) and not (isinstance(blob, memoryview) and blob.readonly and blob.obj is not None
                                                and isinstance(blob.obj, bytes)):
            blob = bytes(blob)   # the caller's buffer (the cache server's pages) is not ours to keep
        if self._behind.submit((index, key, blob, meta, counter)):
            return True
        self._count("behind_dropped")
        log.debug("%s: write-behind queue full, %s not written", self._levels[index].tier.name, key.hex()[:16])
        return False

    def _write_behind(self, job) -> None:
        index, key, blob, meta, counter = job
        if self._put_into(index, key, blob, meta):
            self._count(counter)

    def _put_into(self, index: int, key: bytes, blob: bytes, meta: ObjectMeta) -> bool:
        level = self._levels[index]
        if not level.policy.fits(len(blob)):
            return False
        if not level.tier.put(key, blob, meta):  # I/O outside the lock
            self._count("write_errors")
            return False
        with self._lock:
            if self._sync_locked(level, key) is None:
                return False  # a concurrent clear() or eviction removed it in the meantime
            self._doomed[level.tier.name].discard(key)  # new content after a clear is wanted
            demoted = self._evict_locked(index, key, meta, memoryview(blob).nbytes)
        self._demote_all(index + 1, demoted)
        return True

    def _evict_locked(self, index: int, for_key: bytes = b"",
                      for_meta: ObjectMeta | None = None, for_size: int = 0) -> list[tuple[bytes, bytes, ObjectMeta]]:
        """Evict LRU victims until the level fits; return those the next level should receive.

        Each victim goes into the eviction ring, naming the object whose write made room (`for_key`)."""
        level = self._levels[index]
        below = self._levels[index + 1] if index + 1 < len(self._levels) else None
        demoted = []
        for key in level.policy.victims():
            meta, size = level.tier.meta(key), level.tier.size(key) or 0
            if below is not None and key not in below.policy:
                # Reads the payload under the lock: free for RAM; a future tier below disk should
                # hand victims out by path instead.
                found = self._read(level, key)
                if found is not None:
                    demoted.append((key, *found))
            level.tier.remove(key)
            if self._sync_locked(level, key) is None:  # else its file would not go (logged): kept
                self._evictions[level.tier.name] += 1
                kept = self._held_elsewhere(level, key) or any(item[0] == key for item in demoted)
                self._record_eviction_locked(level, key, meta, size, "lru", for_key=for_key, for_meta=for_meta,
                                             for_size=for_size, gone=not kept)
        return demoted

    def _record_eviction_locked(self, level: Level, key: bytes, meta: ObjectMeta | None, size: int, reason: str, *,
                                for_key: bytes = b"", for_meta: ObjectMeta | None = None, for_size: int = 0,
                                gone: bool = True) -> None:
        """One object left one level: into the ring (kvbridge.store.history), so a later miss can name it."""
        self.history.record(Eviction(
            key=key, namespace=meta.namespace if meta is not None else "", tier=level.tier.name, reason=reason,
            at=time.time(), policy=type(level.policy).__name__.removesuffix("Policy") if reason == "lru" else "",
            for_key=for_key, for_kind=for_meta.kind if for_meta is not None else "", for_size=for_size,
            size=size, gone=gone))

    def _demote_all(self, index: int, demoted: list[tuple[bytes, bytes, ObjectMeta]]) -> None:
        if index >= len(self._levels):
            return
        for key, blob, meta in demoted:
            if self._levels[index].tier.remote:
                self._queue_write(index, key, blob, meta, "demotions")
            elif self._put_into(index, key, blob, meta):
                self._count("demotions")

    def _held_elsewhere(self, level: Level, key: bytes) -> bool:
        return any(key in other.policy for other in self._levels if other is not level)

    def _sync_locked(self, level: Level, key: bytes) -> int | None:
        """Copy the tier's truth about key into the policy (as most recent); its size, None when absent."""
        size = level.tier.size(key)
        if size is None:
            level.policy.on_remove(key)
        else:
            level.policy.on_put(key, size)
        return size

    def _unpin_locked(self, level: Level, key: bytes) -> None:
        """Release one pin; the last one on an object cleared while pinned deletes it now."""
        level.policy.unpin(key)
        doomed = self._doomed[level.tier.name]
        if key in doomed and not level.policy.is_pinned(key):
            doomed.discard(key)
            meta, size = level.tier.meta(key), level.tier.size(key) or 0
            level.tier.remove(key)
            if self._sync_locked(level, key) is None:
                self._record_eviction_locked(level, key, meta, size, "clear", gone=not self._held_elsewhere(level, key))

    def quiet(self):
        """A context in which the write-behind queue starts no new write (CachedEngine holds it around a
        request, so an L3 copy or an L2 promotion never competes with a prefill for a core)."""
        return self._behind.hold()

    @contextmanager
    def pinned(self, keys: Iterable[bytes]) -> Iterator[None]:
        """Keep these objects from being evicted (from any tier) while the block runs."""
        keys = [check_key(key) for key in keys]
        with self._lock:
            for level in self._levels:
                for key in keys:
                    level.policy.pin(key)
        try:
            yield
        finally:
            with self._lock:
                for level in self._levels:
                    for key in keys:
                        self._unpin_locked(level, key)
