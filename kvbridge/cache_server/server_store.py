"""The cache server's store: the shared-memory L1 pool in front of the ordinary tiers (L2, L3, S3).

Place in the flow: a client's lookup / retrieve / store reaches the storage and lookup modules,
which call this. L1 is kvbridge.cache_server.pool.PagedPool over one shared-memory segment; the tiers
below it are a kvbridge.store.TieredStore without L1 built by TieredStore.from_settings: L2 on disk
(the same files an embedded store writes), then L3 on Redis when KVB_L3_URL is set and S3 when
KVB_S3_URL is set (in KVB_S3_ORDER). So every engine on the host shares the server's one L3 client,
one S3 client and its one write queue (tests/test_s3_cache_server.py).

- lookup: L1 first, then the tiers below, leading hits only (as TieredStore.lookup).
- retrieve: an L1 object is read-leased; an object found only below is promoted into L1 first (when
  the pool will take it; otherwise its bytes are returned for an inline reply).
- store: prepare (pages and a write lease) -> the client writes -> commit; then a write-through copy
  to the persistent tiers is queued for the background writer, so the client waits for the copy
  into shared memory only. An L1 eviction queues a demotion when the tiers below lack the object.
  The writer's queue is bounded: a full queue is counted (write_queue_full) and logged, never silent.
- probe_miss: what a client's explainer asks on a miss (the eviction ring shared by the pool and the
  tiers below, pending write leases, the tiers holding the prompt's keys under other namespaces).
- maintenance(): expired leases revoked, SOFT pressure evicted down to the target (the storage
  module's background loop calls it once a second and whenever a store meets pressure).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace

from kvbridge.cache_server.pool import PagedPool, PressureLevel, ReadLease, StoreRefused, Watermarks, WriteLease
from kvbridge.cache_server.shm import Segment, object_checksum
from kvbridge.settings import Settings
from kvbridge.store import LookupResult, ObjectMeta, TieredStore
from kvbridge.store.behind import run_in_background
from kvbridge.store.history import Eviction, EvictionRing, MissProbe
from kvbridge.store.objects import check_key

log = logging.getLogger("kvbridge.cache_server")

SERVER_CLIENT = "kvbridge-server"   # the pool client id of the server's own leases (promotion, writer)
L1_NAME = "L1"


@dataclass(frozen=True)
class Found:
    """A retrieve's result: a read lease on L1 pages, or the bytes (when the pool could not take them)."""

    tier: str
    meta: ObjectMeta
    size: int
    lease: ReadLease | None = None
    blob: bytes | None = None


class ServerStore:
    def __init__(self, settings: Settings, segment_dir: str | None = None) -> None:
        self.settings = settings
        page = settings.cache_server_page_bytes
        n_pages = max(1, settings.l1_bytes // page)
        kwargs = {} if segment_dir is None else {"directory": segment_dir}
        self.segment = Segment.create(n_pages, page, **kwargs)
        marks = Watermarks(soft_free=settings.cache_server_soft_free, hard_free=settings.cache_server_hard_free,
                           critical_free=settings.cache_server_critical_free,
                           target_free=settings.cache_server_target_free)
        # one ring for the server: the pool's evictions and those of the tiers below (kvbridge.store.history)
        self.history = EvictionRing(settings.eviction_history)
        try:
            self.lower = TieredStore.from_settings(settings, with_l1=False, owner="cache-server", history=self.history)
        except BaseException:
            self.segment.close(unlink=True)
            raise
        self._persistent_below = any(tier.persistent for tier in self.lower.tiers)
        self.pool = PagedPool(self.segment, marks, lease_timeout_s=settings.cache_server_lease_timeout,
                              hard_min_priority=settings.cache_server_hard_min_priority, on_evict=self._on_evict,
                              history=self.history, kept_below=lambda key: self._persistent_below)
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=settings.cache_server_write_queue)
        self._writer = threading.Thread(target=self._write_loop, name="kvb-l2-writer", daemon=True)
        self._writer.start()
        self._closed = False
        self._listeners: list = []

    def add_listener(self, listener) -> None:
        """listener(event, key, tier, size) for every "stored", "evicted" and "removed" object.

        Called on the thread that changed the store (an eviction: under the pool's lock), so a
        listener must only hand the event on (a queue), never call back into the store.
        """
        self._listeners.append(listener)

    def remove_listener(self, listener) -> None:
        """Stop calling `listener` (a module that closes removes its own)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _emit(self, event: str, key: bytes, tier: str, size: int) -> None:
        for listener in self._listeners:
            try:
                listener(event, key, tier, size)
            except Exception:   # an observer's bug must not fail a store: logged
                log.exception("store event listener failed")

    @property
    def tier_names(self) -> list[str]:
        return [L1_NAME] + self.lower.tier_names

    # -- reading ---------------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes], namespace: str | None) -> LookupResult:
        tiers: list[str] = []
        for index, key in enumerate(hashes):
            key = check_key(key)
            meta = self.pool.meta(key)
            if meta is None:
                rest = self.lower.lookup(hashes[index:], namespace)
                tiers += rest.tiers
                break
            if namespace is not None and meta.namespace != namespace:
                self._count("foreign")
                break
            tiers.append(L1_NAME)
        self._count("lookups")
        return LookupResult(len(tiers), tiers)

    def retrieve(self, key: bytes, namespace: str | None, client_id: str) -> Found | None:
        """A read lease on the object in L1 (promoted from below when needed), or its bytes, or None."""
        key = check_key(key)
        lease = self.pool.acquire_read(key, client_id)
        if lease is not None:
            if namespace is not None and lease.meta.namespace != namespace:
                self.pool.release(lease.lease_id, client_id)
                self._count("foreign")
                return None
            self._count("hits_L1")
            return Found(L1_NAME, lease.meta, lease.size, lease=lease)
        obj = self.lower.get(key, namespace)
        if obj is None:
            self._count("misses")
            return None
        self._count(f"hits_{obj.tier}")
        if self._admit(key, obj.blob, obj.meta, SERVER_CLIENT, priority=9, write_through=False):
            lease = self.pool.acquire_read(key, client_id)
            if lease is not None:
                self._count("promotions")
                return Found(obj.tier, lease.meta, lease.size, lease=lease)
        return Found(obj.tier, obj.meta, len(obj.blob), blob=obj.blob)

    def read(self, lease: ReadLease) -> bytes:
        return self.segment.read(lease.pages, lease.size)

    def release(self, lease_ids: list[int], client_id: str) -> None:
        """Raises pool.LeaseNotOwned / UnknownLease (the client gets an error reply)."""
        self.pool.release(lease_ids, client_id)

    def probe_miss(self, keys: list[bytes], probes: list[bytes]) -> MissProbe:
        """What the server knows about keys a client's restore missed (kvbridge.store.history.MissProbe): the
        ring's latest entry per key (gone: no tier here holds it now), a write lease not committed yet or a
        copy still queued below (pending), the tier holding each probe, namespaces, tiers down."""
        keys = [check_key(key) for key in keys]
        probes = [check_key(key) for key in probes]
        in_pool = [self.pool.contains(key) for key in probes]
        below = self.lower.probe_miss(keys, [key for key, held in zip(probes, in_pool) if not held])
        pending = [self.pool.pending_write(key) or self._queued(key) or queued for key, queued in zip(keys, below.pending)]
        history: list[Eviction | None] = []
        for key, entry, busy in zip(keys, below.history, pending):   # the ring is shared; gone over every tier
            kept = entry is not None and (busy or self.pool.contains(key))   # busy: a demotion on its way down
            history.append(replace(entry, gone=False) if kept else entry)
        found_below = iter(below.found)
        found = [L1_NAME if held else next(found_below, "") for held in in_pool]
        namespaces = dict(below.namespaces)
        for namespace, size in self.pool.bytes_by_namespace().items():
            namespaces[namespace] = namespaces.get(namespace, 0) + size
        self._count("miss_probes")
        return MissProbe(history=history, pending=pending, found=found, namespaces=namespaces, down=below.down)

    def _queued(self, key: bytes) -> bool:
        """Whether the disk writer's queue holds a copy of `key` (a demotion or write-through on its way)."""
        with self._queue.mutex:
            return any(job is not None and job[0] == key for job in self._queue.queue)

    def recent_evictions(self, limit: int = 100) -> list[Eviction]:
        """The newest `limit` evictions of every tier here, newest first."""
        return self.history.recent(limit)

    # -- writing ---------------------------------------------------------------------------------
    def prepare(self, key: bytes, size: int, meta: ObjectMeta, client_id: str, priority: int,
                checksum: bytes = b"") -> WriteLease:
        """Pages for a new object and a write lease on them; StoreRefused (counted) when not admitted."""
        key = check_key(key)
        try:
            return self.pool.prepare_write(key, size, meta, client_id, priority, checksum)
        except StoreRefused as refused:
            self._count(f"refused_{refused.reason}")
            raise

    def commit(self, lease: WriteLease | int, client_id: str, meta: ObjectMeta | None = None) -> bool:
        lease_id = lease if isinstance(lease, int) else lease.lease_id
        key = self.pool.lease_key(lease_id, client_id)
        stored = self.pool.commit(lease_id, client_id)
        if stored:
            self._count("stores")
            self.history.forget(key)   # written again: an old eviction no longer explains a miss of it
            self._emit("stored", key, L1_NAME, self._size(key))
            self._queue_write(key, None, None)
        else:
            # Revoked under pressure: a commit means the client is done with the pages, so they can
            # leave quarantine now (the client need not send a release; it does not wait for this reply).
            self.pool.release(lease_id, client_id)
            self._count("commits_revoked")
        return stored

    def grant(self, size: int, client_id: str, priority: int) -> WriteLease | None:
        """Pages a writer holds for its next store (pool.grant_write), or None."""
        return self.pool.grant_write(size, client_id, priority)

    def commit_granted(self, lease_id: int, client_id: str, key: bytes, size: int, meta: ObjectMeta,
                       checksum: bytes = b"") -> str:
        """pool.commit_granted, and what a commit does after: counted, written through to L2."""
        outcome = self.pool.commit_granted(lease_id, client_id, key, size, meta, checksum)
        if outcome == "stored":
            self._count("stores")
            self.history.forget(key)
            self._emit("stored", key, L1_NAME, self._size(key))
            self._queue_write(key, None, None)
        elif outcome in ("exists", "busy"):
            self._count(f"refused_{outcome}")
        return outcome

    def store_inline(self, key: bytes, blob: bytes, meta: ObjectMeta, client_id: str, priority: int) -> tuple[bool, str]:
        """A store whose bytes came in the message: into L1 (and queued for L2), else straight to L2."""
        key = check_key(key)
        try:
            if self._admit(key, blob, meta, client_id, priority, write_through=True):
                return True, ""
        except StoreRefused as refused:
            if refused.reason in ("exists", "busy", "pressure"):
                return False, refused.reason
            reason = refused.reason
        else:
            reason = "no_space"
        if self.lower.tiers and self.lower.put(key, blob, meta):   # too large for L1: the disk may still take it
            self._count("stores")
            return True, ""
        return False, reason

    def _admit(self, key: bytes, blob, meta: ObjectMeta, client_id: str, priority: int, write_through: bool) -> bool:
        # bytes the server writes itself (an inline store, a promotion) get their digest here, when asked for
        checksum = object_checksum(blob) if self.settings.cache_server_checksum else b""
        try:
            lease = self.pool.prepare_write(key, len(blob), meta, client_id, priority, checksum)
        except StoreRefused as refused:
            self._count(f"refused_{refused.reason}")
            if client_id == SERVER_CLIENT:
                return False
            raise
        try:
            self.segment.write(lease.pages, blob)
        except BaseException:
            self.pool.release(lease.lease_id, client_id)
            raise
        stored = self.pool.commit(lease.lease_id, client_id)
        if stored:
            self.history.forget(key)
            self._emit("stored", key, L1_NAME, len(blob))
        if stored and write_through:
            self._count("stores")
            self._queue_write(key, None, None)
        return stored

    # -- the background writer -------------------------------------------------------------------
    def _on_evict(self, key: bytes, meta: ObjectMeta, view: memoryview) -> None:
        """Called by the pool before an evicted object's pages are freed: demote it when the tiers below lack it."""
        self._emit("evicted", key, L1_NAME, len(view))
        if not self.lower.tiers or self._lower_knows(key):
            return
        self._queue_write(key, bytes(view), meta, demotion=True)

    def _lower_knows(self, key: bytes) -> bool:
        """Whether a tier below already indexes `key`, from the tiers' own indexes only: this runs under
        the pool lock, often on the server's loop thread (a prepare that evicts), where asking a remote
        tier (TieredStore.contains discovers through Redis) would stall every client for its timeout
        when Redis is silent. The writer thread asks the full question before it writes."""
        return any(tier.contains(key) for tier in self.lower.tiers)

    def _queue_write(self, key: bytes, blob: bytes | None, meta: ObjectMeta | None, demotion: bool = False) -> None:
        """blob None: write-through of an L1 object, read from the pool when the writer gets to it."""
        if not self.lower.tiers or not any(t.persistent for t in self.lower.tiers):
            return
        try:
            self._queue.put_nowait((key, blob, meta, demotion))
        except queue.Full:
            self._count("write_queue_full")
            log.warning("L2 writer queue full (KVB_CACHE_SERVER_WRITE_QUEUE=%d): %s of %s not written to disk",
                        self.settings.cache_server_write_queue, "demotion" if demotion else "write-through",
                        key.hex()[:16])

    def _write_loop(self) -> None:
        run_in_background()   # clients' prefills first: a disk write that began before one must not slow it
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                key, blob, meta, demotion = job
                if self.lower.contains(key) and not self._replaces(key, meta):
                    continue
                if blob is None:
                    self._write_through(key)
                else:
                    self._write_lower(key, blob, meta, demotion)
            except Exception:   # a bug here must not stop the writer: logged and counted
                log.exception("L2 writer failed on one object")
                self._count("write_errors")
            finally:
                self._queue.task_done()

    def _replaces(self, key: bytes, meta: ObjectMeta | None) -> bool:
        """Whether a copy below must be rewritten although the key is there: not a chunk (content-keyed)
        but a tail, snapshot or index filed under a chunk boundary, which a newer prompt replaces."""
        meta = meta if meta is not None else self.pool.meta(key)
        return meta is not None and meta.kind != "chunk"

    def _write_through(self, key: bytes) -> None:
        """Write an L1 object to the tiers below straight from its pages, under a read lease (no copy
        when the pages are contiguous: the disk tier hashes and writes from the view, GIL released)."""
        lease = self.pool.acquire_read(key, SERVER_CLIENT)
        if lease is None:
            return   # evicted before we got here: its demotion was queued instead
        view = None
        try:
            view = self.segment.view(list(lease.pages), lease.size)
            self._write_lower(key, view if view is not None else self.segment.read(lease.pages, lease.size),
                              lease.meta, demotion=False)
        finally:
            if view is not None:
                view.release()
            self.pool.release(lease.lease_id, SERVER_CLIENT)

    def _write_lower(self, key: bytes, blob, meta: ObjectMeta, demotion: bool) -> None:
        if self.lower.put(key, blob, meta):
            self._count("demotions" if demotion else "written_through")
            self._emit("stored", key, self.lower.tier_names[-1], len(blob))
        else:
            self._count("write_errors")

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until the writer queue is empty (for flush and shutdown); False when it timed out."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    # -- housekeeping ----------------------------------------------------------------------------
    def maintenance(self) -> None:
        expired = self.pool.expire_leases()
        if expired:
            self._count("leases_expired", expired)
        if self.pool.level() >= PressureLevel.SOFT:
            self.pool.evict_to_target()

    def drop_client(self, client_id: str, may_still_write: bool = False) -> int:
        return self.pool.drop_client(client_id, may_still_write)

    def clear(self, tier: str) -> None:
        """Empty one tier; objects under a client's live lease stay (a later call clears them).

        L1 waits for the disk writer first: its write-through holds a short lease on each new object,
        and L2 should have the copies before L1 lets go of them."""
        if tier == L1_NAME:
            self.drain()
            before = {key: self._size(key) for key in self.pool.keys()}
            self.pool.clear()
            kept = set(self.pool.keys())
        else:
            level = self.lower.tiers[self.lower.tier_names.index(tier)]
            before = {key: level.size(key) or 0 for key in level.keys()}
            self.lower.clear(tier)
            kept = set(level.keys())
        for key, size in before.items():
            if key not in kept:
                self._emit("removed", key, tier, size)

    def _size(self, key: bytes) -> int:
        return self.pool.size(key) or 0

    def flush(self) -> int:
        """Every L1 object onto the persistent tiers now (queued writes first); how many were written."""
        self.drain()
        written = 0
        for key in self.pool.keys():
            if self.lower.tiers and not self.lower.contains(key):
                lease = self.pool.acquire_read(key, SERVER_CLIENT)
                if lease is None:
                    continue
                try:
                    written += self.lower.put(key, self.segment.read(lease.pages, lease.size), lease.meta)
                finally:
                    self.pool.release(lease.lease_id, SERVER_CLIENT)
        return written

    def stats(self) -> dict:
        pool = self.pool.stats()
        lower = self.lower.stats()
        with self._lock:
            counts = dict(self._counts)
        tiers = {L1_NAME: {"objects": pool["objects"], "bytes": pool["bytes_used"],
                           "capacity": pool["total_pages"] * pool["page_bytes"], "hits": counts.get("hits_L1", 0),
                           "evictions": pool["evictions"], "location": str(self.segment.path)}}
        for name, tier in lower["tiers"].items():
            tiers[name] = {**tier, "hits": counts.get(f"hits_{name}", 0)}
        return {"tiers": tiers, "hits": {name: t["hits"] for name, t in tiers.items()},
                "pool": pool, "lower": lower, "counts": counts, "write_queue": self._queue.qsize(),
                "write_queue_capacity": self.settings.cache_server_write_queue}

    def close(self, flush: bool = True) -> None:
        """Flush L1 to disk (when asked), stop the writer, release the shared memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if flush:
                self.flush()
        finally:
            self._queue.put(None)
            self._writer.join(timeout=30)
            self.lower.close()
            self.segment.close(unlink=True)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n
