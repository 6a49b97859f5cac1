"""The cache server's L1: objects in pages of a shared-memory Segment, handed to clients under leases.

Flow: a client's store is prepare_write (pages reserved, invisible to readers) -> the client copies
its bytes into the pages -> commit (the object becomes visible under its content key). A retrieve is
acquire_read (the object is pinned, most recently used) -> the client copies out -> release. One
object per key, shared by every prompt with that prefix; what the server does not hold in L1 it
demotes through `on_evict` (to disk) before the pages are reused.

Pages (kvbridge.cache_server.pages): a free list that prefers one contiguous run (best fit) so a
reader gets a zero-copy view, and scatters only when no run is long enough. Every committed object gets a fresh generation, written
into its pages' generation slots and zeroed when the pages are freed, so a client whose copy raced a
reuse sees the mismatch and counts a miss instead of restoring wrong data.

Pressure follows the free fraction (Watermarks): SOFT asks the background loop for evict_to_target;
under HARD (after evicting what is not leased) clients below hard_min_priority are refused; under
CRITICAL the pending writes of lower-priority clients are revoked.

Leases that outlive lease_timeout_s are expired by the background loop. A client may still be
copying into or out of a revoked or expired lease's pages, so those pages are QUARANTINED: never
handed to another object until that client releases the lease or is dropped (drop_client).

Every object that leaves the pool (an eviction to make room for a write, naming it; a pressure shed; a
clear; a remove) goes into the eviction ring `history` (kvbridge.store.history); the reports and the
ring's use are kvbridge.cache_server.pool_report's.

Thread-safe: one lock guards everything. on_evict runs under it, so it must not call the pool.
Deliberately left out: moving objects to defragment (a leased object never moves; a run is
re-formed as objects are evicted) and any knowledge of the wire protocol.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from typing import Callable

from kvbridge.cache_server.pages import (FREE, LEASED_OBJECT, OBJECT, PENDING, QUARANTINED, PageTable,  # noqa: F401
                                         PressureLevel, Watermarks)
from kvbridge.cache_server.pool_grants import GRANT_KEY, PoolGrants
from kvbridge.cache_server.pool_report import REFUSALS, PoolReport  # noqa: F401 - REFUSALS: importers use pool's
from kvbridge.cache_server.shm import Segment
from kvbridge.store.history import EvictionRing
from kvbridge.store.objects import ObjectMeta, check_key

log = logging.getLogger(__name__)



ORPHAN_PREFIX = "orphan:"   # the owner of a dropped client's write leases while its process may still write


class StoreRefused(Exception):
    """prepare_write said no; `reason` is one of REFUSALS (the client skips the store)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class LeaseError(Exception):
    """A lease id a client may not use; the pool changed nothing."""


class UnknownLease(LeaseError):
    """No such lease (never issued, already released, or not of the kind asked for)."""


class LeaseNotOwned(LeaseError):
    """The lease belongs to another client."""


@dataclass(frozen=True)
class ReadLease:
    lease_id: int
    key: bytes
    pages: tuple[int, ...]
    size: int
    generation: int
    meta: ObjectMeta
    checksum: bytes = b""   # its writer's digest of the bytes (KVB_CACHE_SERVER_CHECKSUM); b"": none given


@dataclass(frozen=True)
class WriteLease:
    lease_id: int
    key: bytes
    pages: tuple[int, ...]
    size: int
    generation: int


@dataclass
class _Object:
    pages: list[int]
    size: int
    meta: ObjectMeta
    generation: int
    readers: int = 0   # live read leases; an object with readers is never evicted
    checksum: bytes = b""


@dataclass
class _Lease:
    lease_id: int
    client_id: str
    writing: bool
    key: bytes
    pages: list[int]
    size: int
    generation: int
    started: float
    priority: int = 0
    meta: ObjectMeta | None = None   # a write lease's object-to-be
    zombie: bool = False             # revoked or expired: holds its pages in quarantine until released
    checksum: bytes = b""            # a write lease's object-to-be: its writer's digest


def pages_needed(size: int, page_bytes: int) -> int:
    return max(1, -(-size // page_bytes))


class PagedPool(PoolReport, PoolGrants):
    """Objects in a Segment's pages, under read and write leases (see the module docstring)."""

    def __init__(self, segment: Segment, watermarks: Watermarks = Watermarks(), lease_timeout_s: float = 30.0,
                 hard_min_priority: int = 5,
                 on_evict: Callable[[bytes, ObjectMeta, memoryview], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, history: EvictionRing | None = None,
                 kept_below: Callable[[bytes], bool] = lambda key: False) -> None:
        """history: the ring every object leaving the pool is recorded in (kvbridge.store.history);
        kept_below(key): whether a tier below holds it or gets it (on_evict demotes it): then not gone."""
        self.segment = segment
        self.watermarks = watermarks
        self.lease_timeout_s = lease_timeout_s
        self.hard_min_priority = hard_min_priority
        self._on_evict = on_evict
        self._clock = clock
        self.history = history if history is not None else EvictionRing()
        self._kept_below = kept_below
        self._lock = threading.Lock()
        self._total = segment.n_pages
        self._pages = PageTable(self._total)
        self._objects: OrderedDict[bytes, _Object] = OrderedDict()  # least recently used first
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(1)
        self._generation = 0
        self._bytes_used = 0
        self._counts: Counter[str] = Counter()   # evictions, revoked, expired, refused_<reason>, ...
        segment.set_generation(list(range(self._total)), 0)

    # -- reading -----------------------------------------------------------------------------------
    def acquire_read(self, key: bytes, client_id: str) -> ReadLease | None:
        """Pin the object for this client's copy-out and make it most recently used; None on a miss."""
        key = check_key(key)
        with self._lock:
            obj = self._objects.get(key)
            if obj is None:
                return None
            obj.readers += 1
            obj.meta = replace(obj.meta, last_used=time.time())  # wall time: the disk tier seeds its LRU from it
            self._objects.move_to_end(key)
            lease = self._new_lease(client_id, False, key, obj.pages, obj.size, obj.generation)
            return ReadLease(lease.lease_id, key, tuple(obj.pages), obj.size, obj.generation, obj.meta, obj.checksum)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return check_key(key) in self._objects

    def meta(self, key: bytes) -> ObjectMeta | None:
        with self._lock:
            obj = self._objects.get(check_key(key))
            return obj.meta if obj else None

    def size(self, key: bytes) -> int | None:
        with self._lock:
            obj = self._objects.get(check_key(key))
            return obj.size if obj else None

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._objects)

    def object_count(self) -> int:
        with self._lock:
            return len(self._objects)

    # -- writing -----------------------------------------------------------------------------------
    def prepare_write(self, key: bytes, size: int, meta: ObjectMeta, client_id: str, priority: int,
                      checksum: bytes = b"") -> WriteLease:
        """Reserve pages for a new object (invisible until commit), or raise StoreRefused(reason).
        checksum: the writer's digest of the bytes it will write, handed to every reader."""
        key = check_key(key)
        if size < 0:
            raise ValueError(f"an object's size is >= 0, got {size}")
        if not isinstance(meta, ObjectMeta):
            raise TypeError(f"meta must be an ObjectMeta, got {type(meta).__name__}")
        n = pages_needed(size, self.segment.page_bytes)
        with self._lock:
            # A chunk's key is its content: the same key is the same bytes. A tail (or a snapshot or an
            # index) is filed under its chunk boundary and a newer prompt's replaces it, as in the
            # embedded store; one a reader holds now stays, and the newer store is refused as busy.
            refusal = self._replaces(key, meta)
            if refusal == "exists":
                self._refuse("exists", f"{key.hex()[:16]} is already stored")
            if refusal == "busy":
                self._refuse("busy", f"{key.hex()[:16]} is being read; the newer {meta.kind} is not stored")
            if n > self._total:
                self._refuse("too_large", _too_large(size, n, self._total, self.segment.page_bytes))
            # Cold objects make room first, so a full but unleased pool is never "under pressure".
            self._evict_until(lambda: self._free_count() >= n
                              and self._free_count() - n >= self.watermarks.hard_free * self._total,
                              for_key=key, for_meta=meta, for_size=size)
            level = self._level()
            if level >= PressureLevel.HARD and priority < self.hard_min_priority:
                self._refuse("pressure", f"the pool is under {level.name} pressure (few pages free, the rest leased), "
                                         f"so it takes stores only from clients of priority {self.hard_min_priority} "
                                         f"and above (KVB_CACHE_SERVER_HARD_MIN_PRIORITY); this one has {priority} "
                                         "(KVB_CLIENT_PRIORITY). The store is skipped; the pool frees as leases end")
            if level == PressureLevel.CRITICAL:
                self._revoke_writes_below(priority)
            pages = self._pages.allocate(n)
            if pages is None:
                self._refuse("no_space", f"{n} pages wanted, {self._free_count()} free: the rest is leased to readers "
                                         "and writers now; the store is skipped, the pool frees as leases end")
            self._pages.mark(pages, PENDING)
            self._generation += 1
            lease = self._new_lease(client_id, True, key, pages, size, self._generation, priority, meta)
            lease.checksum = bytes(checksum)
            return WriteLease(lease.lease_id, key, tuple(pages), size, lease.generation)

    def commit(self, lease_id: int, client_id: str) -> bool:
        """Make the written object visible. False when the lease was revoked or expired (release it)."""
        with self._lock:
            lease = self._owned(lease_id, client_id)
            if not lease.writing:
                raise UnknownLease(f"lease {lease_id} is a read lease; only write leases are committed")
            if lease.key == GRANT_KEY:
                raise UnknownLease(f"lease {lease_id} is a grant; it is committed with the object's key (store_granted)")
            if lease.zombie:
                return False
            del self._leases[lease_id]
            if lease.key in self._objects:   # another writer of the same content won: same bytes, keep theirs
                self._free_pages(lease.pages)
                return True
            assert lease.meta is not None
            self._pages.mark(lease.pages, OBJECT)
            self.segment.set_generation(lease.pages, lease.generation)
            self._objects[lease.key] = _Object(lease.pages, lease.size, lease.meta, lease.generation,
                                               checksum=lease.checksum)
            self._bytes_used += lease.size
            return True

    def _replaces(self, key: bytes, meta: ObjectMeta) -> str:
        """Inside the lock, before an object is written under `key`: "" when it may be (an older tail under
        the same key is dropped), else the refusal ("exists": a chunk's key is its content; "busy": read now)."""
        held = self._objects.get(key)
        if held is None:
            return ""
        if meta.kind == "chunk" or held.meta.kind == "chunk":
            return "exists"
        if held.readers:
            return "busy"
        self._drop_object(key)
        self._counts["replaced"] += 1
        return ""

    def release(self, lease_ids: list[int] | int, client_id: str) -> None:
        """End read leases, abort write leases, and let go of revoked or expired ones (their pages free up).

        Every id is checked before any is acted on, so a bad id changes nothing.
        """
        ids = [lease_ids] if isinstance(lease_ids, int) else list(lease_ids)
        with self._lock:
            leases = [self._owned(lease_id, client_id) for lease_id in dict.fromkeys(ids)]
            for lease in leases:
                self._end_lease(lease)

    def lease_key(self, lease_id: int, client_id: str) -> bytes:
        """The key a lease of this client is about (LeaseNotOwned / UnknownLease as for release)."""
        with self._lock:
            return self._owned(lease_id, client_id).key

    def drop_client(self, client_id: str, may_still_write: bool = False) -> int:
        """Release every lease, live or zombie, of a client that is gone; how many there were.

        may_still_write: the client was dropped for silence, not because it said goodbye or died, and
        its process can still write into shared memory (SIGSTOP, a frozen VM, swap). Its write leases
        then become orphans: their pages stay quarantined, named by no client (its commit is refused),
        until release_orphans() says the process is dead. Freed at once, they would be handed to
        another object, and the writer's resumed copy would land in that object's committed pages.
        """
        with self._lock:
            leases = [lease for lease in self._leases.values() if lease.client_id == client_id]
            for lease in leases:
                if may_still_write and lease.writing:
                    if not lease.zombie:
                        self._make_zombie(lease)
                    lease.client_id = ORPHAN_PREFIX + client_id
                    self._counts["orphaned_writes"] += 1
                else:
                    self._end_lease(lease)
            return len(leases)

    def release_orphans(self, client_id: str) -> int:
        """The dropped client's process is gone: its orphaned writes' pages can be reused."""
        with self._lock:
            owner = ORPHAN_PREFIX + client_id
            leases = [lease for lease in self._leases.values() if lease.client_id == owner]
            for lease in leases:
                self._end_lease(lease)
            return len(leases)

    def orphan_owners(self) -> set[str]:
        """Client ids whose orphaned writes still hold pages."""
        with self._lock:
            return {lease.client_id[len(ORPHAN_PREFIX):] for lease in self._leases.values()
                    if lease.client_id.startswith(ORPHAN_PREFIX)}

    def expire_leases(self) -> int:
        """Turn leases older than lease_timeout_s into zombies (the background loop calls this)."""
        with self._lock:
            deadline = self._clock() - self.lease_timeout_s
            old = [lease for lease in self._leases.values() if not lease.zombie and lease.started < deadline]
            for lease in old:
                self._make_zombie(lease)
            self._counts["expired"] += len(old)
            return len(old)

    # -- eviction and removal ----------------------------------------------------------------------
    def evict_to_target(self) -> int:
        """Evict least recently used unleased objects until target_free of the pages are free."""
        with self._lock:
            return self._evict_until(lambda: self._free_count() >= self.watermarks.target_free * self._total,
                                     reason="pressure")

    def remove(self, key: bytes) -> bool:
        """Drop an object without demoting it; False when it is absent or leased."""
        key = check_key(key)
        with self._lock:
            obj = self._objects.get(key)
            if obj is None or obj.readers:
                return False
            self._record(key, obj, "removed")
            self._drop_object(key)
            return True

    def clear(self) -> int:
        """Drop every unleased object (leased ones and pending writes stay); how many were dropped."""
        with self._lock:
            doomed = [key for key, obj in self._objects.items() if not obj.readers]
            for key in doomed:
                self._record(key, self._objects[key], "clear")
                self._drop_object(key)
            return len(doomed)

    # -- inside the lock ---------------------------------------------------------------------------
    def _free_count(self) -> int:
        return self._pages.count(FREE)

    def _level(self) -> PressureLevel:
        return self.watermarks.level(self._free_count() / self._total)

    def _refuse(self, reason: str, detail: str) -> None:
        self._counts[f"refused_{reason}"] += 1
        raise StoreRefused(reason, detail)

    def _new_lease(self, client_id: str, writing: bool, key: bytes, pages: list[int], size: int, generation: int,
                   priority: int = 0, meta: ObjectMeta | None = None) -> _Lease:
        lease = _Lease(next(self._lease_ids), client_id, writing, key, list(pages), size, generation,
                       self._clock(), priority, meta)
        self._leases[lease.lease_id] = lease
        return lease

    def _owned(self, lease_id: int, client_id: str) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise UnknownLease(f"no lease {lease_id} (never issued, or already released)")
        if lease.client_id != client_id:
            raise LeaseNotOwned(f"lease {lease_id} belongs to another client, not {client_id!r}")
        return lease

    def _free_pages(self, pages: list[int]) -> None:
        """Pages leave an object or a write: free, or quarantined while a zombie lease still names them."""
        self.segment.set_generation(pages, 0)
        self._pages.release(pages)

    def _drop_object(self, key: bytes) -> None:
        obj = self._objects.pop(key)
        self._bytes_used -= obj.size
        self._free_pages(obj.pages)

    def _evict_until(self, enough: Callable[[], bool], reason: str = "lru", for_key: bytes = b"",
                     for_meta: ObjectMeta | None = None, for_size: int = 0) -> int:
        """Evict unleased objects, least recently used first, reporting each to on_evict, until enough().

        reason "lru": to make room for the write of `for_key`; "pressure": the background loop's shedding."""
        evicted = 0
        for key in [key for key, obj in self._objects.items() if not obj.readers]:
            if enough():
                break
            self._report_eviction(key, self._objects[key])
            self._record(key, self._objects[key], reason, for_key, for_meta, for_size)
            self._drop_object(key)
            self._counts["evictions"] += 1
            evicted += 1
        return evicted

    def _report_eviction(self, key: bytes, obj: _Object) -> None:
        if self._on_evict is None:
            return
        view = self.segment.view(obj.pages, obj.size)
        if view is None:
            view = memoryview(self.segment.read(obj.pages, obj.size))
        try:
            self._on_evict(key, obj.meta, view)
        except Exception:  # noqa: BLE001 - the pages must be reclaimed anyway; counted and logged
            self._counts["evict_callback_errors"] += 1
            log.exception("on_evict failed for %s; the object is dropped from L1 without a copy", key.hex()[:16])
        try:
            view.release()   # a view left exported would keep the segment from unmapping at shutdown
        except BufferError:
            log.warning("on_evict kept a buffer over the evicted bytes of %s; it must copy them", key.hex()[:16])

    def _make_zombie(self, lease: _Lease) -> None:
        """A revoked or expired lease: its client may still touch the pages, so they stay out of reuse."""
        lease.zombie = True
        self._pages.hold(lease.pages, quarantine=lease.writing)
        if not lease.writing:
            self._objects[lease.key].readers -= 1   # evictable again; eviction then quarantines its pages

    def _end_lease(self, lease: _Lease) -> None:
        del self._leases[lease.lease_id]
        if lease.zombie:
            self._pages.unhold(lease.pages)
        elif lease.writing:
            self._free_pages(lease.pages)
        else:
            self._objects[lease.key].readers -= 1

    def _revoke_writes_below(self, priority: int) -> None:
        """Under CRITICAL: revoke pending writes of lower-priority clients, lowest (then oldest) first,
        until the pages that come back once their holders release would lift the pool out of CRITICAL.

        Revoking frees nothing at once (the writer may still be copying), so counting quarantined
        pages as coming back is what keeps one critical moment from revoking every lower write.
        """
        victims = sorted((lease for lease in self._leases.values()
                          if lease.writing and not lease.zombie and lease.priority < priority),
                         key=lambda lease: (lease.priority, lease.started, lease.lease_id))
        for lease in victims:
            returning = self._free_count() + self._pages.count(QUARANTINED)
            if self.watermarks.level(returning / self._total) < PressureLevel.CRITICAL:
                break
            self._make_zombie(lease)
            self._counts["revoked"] += 1


def _too_large(size: int, pages: int, total_pages: int, page_bytes: int) -> str:
    """An object bigger than the whole pool: what it needs, what there is, and the two settings that fit them."""
    return (f"an object of {size / 2**20:.1f} MiB needs {pages} pages of {page_bytes // 1024} KiB, more than the whole "
            f"pool ({total_pages} pages, {total_pages * page_bytes / 2**20:.1f} MiB): give the cache server a larger "
            "pool (its KVB_L1_BYTES), or store smaller objects (a smaller KVB_CHUNK_SIZE on the engines)")
