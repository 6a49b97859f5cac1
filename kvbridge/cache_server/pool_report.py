"""PagedPool's reports: its pressure level, numbers, page map and invariants, and what it remembers of the
objects that left it (the eviction ring) and tells about a miss (a write still pending, namespaces held).

A part of PagedPool (kvbridge.cache_server.pool), whose constructor sets the state declared below;
every method here takes the pool's lock (those named _record run under it already).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from kvbridge.cache_server.pages import FREE, LEASED_OBJECT, OBJECT, PENDING, QUARANTINED, PageTable, PressureLevel
from kvbridge.store.history import Eviction, EvictionRing
from kvbridge.store.objects import ObjectMeta, check_key

if TYPE_CHECKING:
    from kvbridge.cache_server.shm import Segment

log = logging.getLogger("kvbridge.cache_server.pool")
REFUSALS = ("exists", "busy", "too_large", "pressure", "no_space")   # why prepare_write said no


class PoolReport:
    """Reporting and history (a part of PagedPool)."""

    segment: "Segment"
    watermarks: Any
    history: EvictionRing
    _lock: threading.Lock
    _total: int
    _pages: PageTable
    _objects: dict
    _leases: dict
    _generation: int
    _bytes_used: int
    _counts: Counter[str]
    _kept_below: Callable[[bytes], bool]

    # -- reporting ---------------------------------------------------------------------------------
    def level(self) -> PressureLevel:
        with self._lock:
            return self._level()

    def stats(self) -> dict:
        with self._lock:
            live = [lease for lease in self._leases.values() if not lease.zombie]
            pages = self._pages.counts()
            free = pages[FREE]
            return {
                "total_pages": self._total, "free_pages": free, "object_pages": pages[OBJECT],
                "pending_pages": pages[PENDING], "quarantined_pages": pages[QUARANTINED],
                "page_bytes": self.segment.page_bytes,
                "objects": len(self._objects),
                "bytes_used": self._bytes_used,
                "read_leases": sum(not lease.writing for lease in live),
                "write_leases": sum(lease.writing for lease in live),
                "zombie_leases": len(self._leases) - len(live),
                "leased_objects": sum(1 for obj in self._objects.values() if obj.readers),
                "level": self._level().name,
                "usage_ratio": (self._total - free) / self._total,
                **{name: self._counts[name] for name in ("evictions", "evict_callback_errors", "revoked", "expired")},
                "refused": {reason: self._counts[f"refused_{reason}"] for reason in REFUSALS},
                "generation": self._generation,
            }

    def page_map(self) -> bytes:
        """One byte per page: 0 free, 1 object, 2 object with a live lease, 3 pending write, 4 quarantined."""
        with self._lock:
            pages = self._pages.state.copy()
            for obj in self._objects.values():
                if obj.readers:
                    pages[obj.pages] = LEASED_OBJECT
            return pages.tobytes()

    def check_invariants(self) -> None:
        """Rebuild every page's place from the objects and leases and compare (tests call this)."""
        with self._lock:
            expected = np.full(self._total, FREE, dtype=np.uint8)
            owners: Counter[int] = Counter()
            holds = np.zeros(self._total, dtype=np.int64)
            readers: Counter[bytes] = Counter()
            for obj in self._objects.values():
                expected[obj.pages] = OBJECT
                owners.update(obj.pages)
            for lease in self._leases.values():
                if lease.zombie:
                    np.add.at(holds, lease.pages, 1)
                    if lease.writing:
                        owners.update(lease.pages)   # a dead write's pages belong to no object
                elif lease.writing:
                    expected[lease.pages] = PENDING
                    owners.update(lease.pages)
                else:
                    readers[lease.key] += 1
            shared = sorted(page for page, count in owners.items() if count > 1)
            assert not shared, f"pages in two places: {shared}"
            assert np.array_equal(holds, self._pages.holds), "zombie holds differ from the zombie leases"
            expected[(expected == FREE) & (holds > 0)] = QUARANTINED
            wrong = np.flatnonzero(expected != self._pages.state).tolist()
            assert not wrong, f"page states differ at {wrong[:20]}: " \
                              f"{self._pages.state[wrong[:20]].tolist()} != {expected[wrong[:20]].tolist()}"
            counts = [int(np.count_nonzero(self._pages.state == s)) for s in (OBJECT, PENDING, QUARANTINED, FREE)]
            assert sum(counts) == self._total, f"object+pending+quarantined+free = {counts} != {self._total}"
            for key, obj in self._objects.items():
                assert obj.readers == readers[key], f"{key.hex()[:16]}: refcount {obj.readers} != {readers[key]} leases"
                assert self.segment.generation_ok(obj.pages, obj.generation), f"{key.hex()[:16]}: generation slots"
            free = np.flatnonzero(self._pages.state == FREE).tolist()
            assert not free or self.segment.generation_ok(free, 0), "a free page carries a generation"
            assert self._bytes_used == sum(obj.size for obj in self._objects.values()), "bytes_used drifted"


    def _record(self, key: bytes, obj: Any, reason: str, for_key: bytes = b"",
                for_meta: ObjectMeta | None = None, for_size: int = 0) -> None:
        try:
            kept = self._kept_below(key)
        except Exception:   # an observer's question: a failure leaves the entry "gone", logged
            log.exception("kept_below failed for %s", key.hex()[:16])
            kept = False
        self.history.record(Eviction(key=key, namespace=obj.meta.namespace, tier="L1", reason=reason,
                                     at=time.time(), policy="LRU" if reason in ("lru", "pressure") else "",
                                     for_key=for_key, for_kind=for_meta.kind if for_meta is not None else "",
                                     for_size=for_size, size=obj.size, gone=not kept))

    def pending_write(self, key: bytes) -> bool:
        """Whether a live write lease holds pages for `key` (prepared, not committed yet)."""
        key = check_key(key)
        with self._lock:
            return any(lease.writing and not lease.zombie and lease.key == key for lease in self._leases.values())

    def bytes_by_namespace(self) -> dict[str, int]:
        with self._lock:
            held: dict[str, int] = {}
            for obj in self._objects.values():
                held[obj.meta.namespace] = held.get(obj.meta.namespace, 0) + obj.size
            return held

