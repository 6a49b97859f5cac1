"""The one small interface every tier implements, and the RAM tier (L1).

A tier only stores and fetches: it knows nothing of recency, capacity decisions or other tiers.
The store pairs each tier with an LRUPolicy and decides what is evicted, demoted and promoted.
Deliberately left out: async I/O and batching (objects here are tens of MB; one call each is fine).

Contract (tests/test_store_contract.py runs it over every tier): a tier is thread-safe on its own;
its index and bytes_used() always describe what it really holds, whatever runs concurrently; get()
raises only StoreFault subclasses (never OSError), put() reports failure as False, and remove(),
clear() and discover() do not raise for storage faults (clear() may raise StoreFault when it cannot
even list its storage). The store mirrors each tier's sizes in its policy by asking size().
"""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from typing import ClassVar, Collection, Sequence

from kvbridge.store.objects import ObjectMeta, StoreFault


class Tier(ABC):
    """Storage for (key -> blob, meta). Sizes are payload bytes; get() may raise StoreFault."""

    persistent: ClassVar[bool] = False  # survives a restart: put() writes through to it
    remote: ClassVar[bool] = False      # on the network, shared by hosts: written behind the request
    location: str = "memory"            # shown in stats (a directory for disk tiers)

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self._capacity = max(0, int(capacity))
        self.corrupt_found = 0          # bad objects dropped while indexing or discovering
        self.temp_files_removed = 0     # temp files of writers that died mid-put (tiers that write files)

    def capacity(self) -> int:
        return self._capacity

    @abstractmethod
    def contains(self, key: bytes) -> bool: ...

    @abstractmethod
    def meta(self, key: bytes) -> ObjectMeta | None:
        """Metadata from the index, without reading the payload."""

    @abstractmethod
    def size(self, key: bytes) -> int | None:
        """Payload size from the index, or None when absent."""

    @abstractmethod
    def get(self, key: bytes) -> tuple[bytes, ObjectMeta] | None:
        """The object, or None when absent; raises StoreFault when it is present but unusable."""

    @abstractmethod
    def put(self, key: bytes, blob: bytes, meta: ObjectMeta) -> bool:
        """Store or replace; False when it could not be stored (disk full, I/O error)."""

    @abstractmethod
    def remove(self, key: bytes) -> None: ...

    @abstractmethod
    def keys(self) -> list[bytes]: ...

    @abstractmethod
    def bytes_used(self) -> int: ...

    @abstractmethod
    def entries(self) -> list[tuple[bytes, int, float]]:
        """(key, size, last_used) for every object; seeds the store's policy at start."""

    @abstractmethod
    def clear(self, keep: Collection[bytes] = ()) -> None:
        """Remove every object except those in `keep` (the store keeps pinned objects this way)."""

    def bytes_by_namespace(self) -> dict[str, int]:
        """Bytes of the objects this tier holds (as far as this process knows), by their namespace."""
        held: dict[str, int] = {}
        for key in self.keys():
            meta, size = self.meta(key), self.size(key)
            if meta is not None and size is not None:
                held[meta.namespace] = held.get(meta.namespace, 0) + size
        return held

    def namespaces_stored(self) -> dict[str, int]:
        """Bytes by namespace of what this tier holds, as far as it can tell (a miss's probe asks; a shared
        tier may know more than bytes_by_namespace: L3 keeps a registry on the server)."""
        return self.bytes_by_namespace()

    def discover(self, key: bytes) -> int | None:
        """Index an object another process stored since we started; its size, or None.

        Only shared tiers (a disk directory) can gain objects behind our back.
        """
        return None

    def writing(self, key: bytes) -> bool:
        """Whether a live writer (another process, or another thread here) is writing `key` into this tier
        now; a lookup may wait for it (kvbridge.store.tiered_inflight). Only shared tiers can tell."""
        return False

    def available(self) -> bool:
        """False while the tier is known to be unreachable (a remote tier marked down): lookups skip it."""
        return True

    def calls_on_this_thread(self) -> int:
        """Network round trips this thread has sent to the tier so far (0 for a tier in this process): a caller
        counts what one of its operations cost from the difference (TieredStore.probe_miss)."""
        return 0

    def why_down(self) -> str:
        """Why available() is False ("" while it is True), for a miss's detail."""
        return "" if self.available() else "unavailable"

    def discover_many(self, keys: Sequence[bytes]) -> list[int | None]:
        """discover() for several keys (a remote tier asks about all of them in one round trip)."""
        return [self.discover(key) for key in keys]

    def get_many(self, keys: Sequence[bytes]) -> list[tuple[bytes, ObjectMeta] | StoreFault | None]:
        """get() for several keys, each fault returned in its key's place instead of raised."""
        results: list[tuple[bytes, ObjectMeta] | StoreFault | None] = []
        for key in keys:
            try:
                results.append(self.get(key))
            except StoreFault as fault:
                results.append(fault)
        return results

    def close(self) -> None:
        """Release what the tier holds in memory; stored data stays where it is."""


class MemoryTier(Tier):
    """L1: blobs kept as the very bytes objects handed to put(), never copied."""

    def __init__(self, capacity: int, name: str = "L1") -> None:
        super().__init__(name, capacity)
        self._objects: dict[bytes, tuple[bytes, ObjectMeta, float]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._objects

    def meta(self, key: bytes) -> ObjectMeta | None:
        with self._lock:
            found = self._objects.get(key)
        return found[1] if found else None

    def size(self, key: bytes) -> int | None:
        with self._lock:
            found = self._objects.get(key)
        return len(found[0]) if found else None

    def get(self, key: bytes) -> tuple[bytes, ObjectMeta] | None:
        with self._lock:
            found = self._objects.get(key)
        return (found[0], found[1]) if found else None

    def put(self, key: bytes, blob: bytes, meta: ObjectMeta) -> bool:
        with self._lock:
            old = self._objects.get(key)
            self._bytes += len(blob) - (len(old[0]) if old else 0)
            self._objects[key] = (blob, meta, time.time())
        return True

    def remove(self, key: bytes) -> None:
        with self._lock:
            old = self._objects.pop(key, None)
            if old:
                self._bytes -= len(old[0])

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._objects)

    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    def entries(self) -> list[tuple[bytes, int, float]]:
        with self._lock:
            return [(key, len(blob), stamp) for key, (blob, _, stamp) in self._objects.items()]

    def clear(self, keep: Collection[bytes] = ()) -> None:
        with self._lock:
            self._objects = {key: found for key, found in self._objects.items() if key in keep}
            self._bytes = sum(len(blob) for blob, _, _ in self._objects.values())

    def close(self) -> None:
        self.clear()
