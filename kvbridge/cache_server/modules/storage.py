"""StorageModule: retrieve, store, release, clear and flush through the server's store, and its pressure loop.

Every request here runs on the calling client's affinity thread, in the order the client sent them
(a release is not waited for, so the client's later requests must not overtake it).
A same-host client gets read and write leases on shared-memory pages; any other client (or one
that asked for inline bytes) gets and sends the bytes in data frames (cut to the size it asked for). The module's background
loop (once a second, and at once when a store meets pressure) revokes expired leases and evicts
cold objects under SOFT pressure. It is a liveness target: a client the reaper drops has every
lease released, so a killed engine cannot hold pages forever.
"""
from __future__ import annotations

import logging
import threading

from kvbridge.cache_server.calls import Answer, Call, RequestFailed
from kvbridge.cache_server.module import DiscoverableModule, ModuleBuildContext
from kvbridge.cache_server.liveness import InstanceClock, writer_lock_held
from kvbridge.cache_server.pool import LeaseNotOwned, StoreRefused, UnknownLease
from kvbridge.cache_server.protocol import (MIN_INLINE_FRAME_BYTES, Code, CommitManyReply, FlushReply, Kind,
                                            PrepareManyReply, PrepareReply, RetrieveManyReply, RetrieveReply,
                                            StoreReply, WireMeta, cut_frames, join_frames)

log = logging.getLogger("kvbridge.cache_server")
MAINTENANCE_INTERVAL_S = 1.0
MAX_KEYS_PER_CALL = 4096   # keys (retrieve_many) or objects (store_prepare_many) one call may name


def _frame_bytes(asked: int) -> int:
    """The frame size a retrieve asked for, checked: 0 (each object in one frame) or at least MIN_INLINE_FRAME_BYTES."""
    if asked == 0 or asked >= MIN_INLINE_FRAME_BYTES:
        return asked
    raise RequestFailed(Code.BAD_REQUEST, f"frame_bytes must be 0 (one frame per object) or at least "
                                          f"{MIN_INLINE_FRAME_BYTES}, got {asked}")


def _check_grant_next(size: int) -> None:
    if size < 0:
        raise RequestFailed(Code.BAD_REQUEST, f"grant_next must be >= 0 (bytes to lend ahead of the next store), got {size}")


class StorageModule(DiscoverableModule):
    module_name = "storage"

    def __init__(self, context) -> None:
        super().__init__(context)
        self.store = context.store
        self.instances = InstanceClock()
        # Writers through shared memory: a client dropped for silence may still be running (SIGSTOP),
        # so its unfinished writes stay orphaned, their pages quarantined, while its writer lock is held
        # (kvbridge.cache_server.liveness; checked every maintenance round). Not the pid it claimed at
        # hello: in another PID namespace that pid is some other process, or none.
        self._writers: set[str] = set()
        self._orphans: set[str] = set()
        self._writers_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._loop = threading.Thread(target=self._maintain, name="kvb-cs-pressure", daemon=True)
        self._loop.start()

    @classmethod
    def create(cls, build_ctx: ModuleBuildContext) -> "StorageModule":
        return cls(build_ctx.server_context)

    def register_handlers(self, router) -> None:
        for kind, fn in ((Kind.RETRIEVE, self.retrieve), (Kind.RETRIEVE_MANY, self.retrieve_many),
                         (Kind.STORE_INLINE, self.store_inline)):   # may read or write the disk: a worker
            router.handle(kind, fn, affinity=True, owner=self.module_name)
        for kind, fn in ((Kind.RELEASE, self.release), (Kind.STORE_PREPARE, self.prepare),
                         (Kind.STORE_COMMIT, self.commit), (Kind.STORE_PREPARE_MANY, self.prepare_many),
                         (Kind.STORE_COMMIT_MANY, self.commit_many),
                         (Kind.STORE_GRANTED, self.store_granted)):   # page bookkeeping only: may run inline
            router.handle(kind, fn, affinity=True, owner=self.module_name, fast=True)
        # clear and flush too: in order with the caller's stores and releases
        router.handle(Kind.CLEAR, self.clear, affinity=True, owner=self.module_name)
        router.handle(Kind.FLUSH, self.flush, affinity=True, owner=self.module_name)

    # -- handlers --------------------------------------------------------------------------------
    def retrieve(self, call: Call) -> Answer:
        body = call.body
        reply, data = self._retrieve_one(body.key, body.namespace, body.via_shm, call.instance_id,
                                         frame_bytes=_frame_bytes(body.frame_bytes))
        return Answer(reply, data)

    def retrieve_many(self, call: Call) -> Answer:
        """Several objects in one reply, which is bounded like a request: each key at most once, and the
        bytes that travel in the reply (objects not lent through shared memory) at most
        KVB_CACHE_SERVER_MAX_MESSAGE_BYTES, checked before anything is read, so one small request cannot
        make the server build a reply of many gigabytes."""
        body = call.body
        if len(body.keys) > MAX_KEYS_PER_CALL:
            raise RequestFailed(Code.BAD_REQUEST, f"retrieve_many takes at most {MAX_KEYS_PER_CALL} keys")
        if len(set(body.keys)) != len(body.keys):
            raise RequestFailed(Code.BAD_REQUEST, f"retrieve_many names {len(body.keys) - len(set(body.keys))} "
                                                  "key(s) more than once; ask for each key once")
        limit = self.context.settings.cache_server_max_message_bytes
        frame_bytes = _frame_bytes(body.frame_bytes)
        items, frames, leases, inline_bytes = [], [], [], 0
        try:
            for key in body.keys:
                reply, data = self._retrieve_one(key, body.namespace, body.via_shm, call.instance_id,
                                                 budget=limit - inline_bytes, frame_bytes=frame_bytes)
                items.append(reply)
                frames += data
                inline_bytes += sum(len(d) for d in data)
                if reply.lease_id:
                    leases.append(reply.lease_id)
        except RequestFailed:
            if leases:   # nothing of a refused request stays lent
                self.store.release(leases, call.instance_id)
            raise
        return Answer(RetrieveManyReply(items), tuple(frames))

    def _retrieve_one(self, key: bytes, namespace, via_shm: bool, client_id: str, budget: int | None = None,
                      frame_bytes: int = 0) -> tuple[RetrieveReply, tuple]:
        """A lease on shared pages for a client that maps them, else the bytes as data frames of at most
        `frame_bytes` (0: one frame; refused, TOO_LARGE, when they would pass `budget`: what is left of
        the reply's byte limit)."""
        found = self._bad_key_is_bad_request(lambda: self.store.retrieve(key, namespace, client_id))
        if found is None:
            return RetrieveReply(False), ()
        meta = WireMeta.of(found.meta)
        if found.lease is not None and via_shm and self.context.settings.cache_server_shm:
            lease = found.lease
            return RetrieveReply(True, found.tier, meta, found.size, lease.lease_id, list(lease.pages),
                                 lease.generation, lease.checksum), ()
        if budget is not None and found.size > budget:
            if found.lease is not None:
                self.store.release([found.lease.lease_id], client_id)
            limit = self.context.settings.cache_server_max_message_bytes
            raise RequestFailed(Code.TOO_LARGE, f"the reply would pass KVB_CACHE_SERVER_MAX_MESSAGE_BYTES ({limit} "
                                                "bytes); ask for fewer objects at a time")
        if found.lease is not None:
            try:
                blob = self.store.read(found.lease)
            finally:
                self.store.release([found.lease.lease_id], client_id)
        else:
            blob = found.blob
        frames = cut_frames(blob, frame_bytes)
        return RetrieveReply(True, found.tier, meta, found.size, frames=len(frames)), frames

    def release(self, call: Call) -> Answer:
        self._lease_call(lambda: self.store.release(list(call.body.lease_ids), call.instance_id))
        return Answer(None)

    def prepare(self, call: Call) -> Answer:
        return Answer(self._prepare_one(call.body, call))

    def prepare_many(self, call: Call) -> Answer:
        if len(call.body.items) > MAX_KEYS_PER_CALL:
            raise RequestFailed(Code.BAD_REQUEST, f"store_prepare_many takes at most {MAX_KEYS_PER_CALL} objects")
        return Answer(PrepareManyReply([self._prepare_one(item, call) for item in call.body.items]))

    def _prepare_one(self, body, call: Call) -> PrepareReply:
        meta = self._meta(body.meta)
        if body.size < 0:
            raise RequestFailed(Code.BAD_REQUEST, f"store of a negative size ({body.size})")
        if not self._may_still_write(call.instance_id):
            # without the lock the server could not tell, once this client is dropped, whether it still
            # writes; such a client stores inline (CacheClient does so by itself)
            return PrepareReply(False, "no_writer_lock")
        with self._writers_lock:
            self._writers.add(call.instance_id)
        try:
            lease = self._bad_key_is_bad_request(
                lambda: self.store.prepare(body.key, body.size, meta, call.instance_id, call.client.priority,
                                           body.checksum))
        except StoreRefused as refused:
            if refused.reason in ("pressure", "no_space"):
                self._wake.set()
            return PrepareReply(False, refused.reason)
        return PrepareReply(True, "", lease.lease_id, list(lease.pages), lease.generation)

    def commit(self, call: Call) -> Answer:
        _check_grant_next(call.body.grant_next)
        stored = self._lease_call(lambda: self.store.commit(call.body.lease_id, call.instance_id))
        grant = self._grant(call.body.grant_next, call) if stored else None
        return Answer(StoreReply(stored, "" if stored else "revoked", grant))

    def store_granted(self, call: Call) -> Answer:
        """A lone store in one round trip: the bytes are in a grant's pages already (issue 47)."""
        body = call.body
        _check_grant_next(body.grant_next)
        meta = self._meta(body.meta)
        outcome = self._lease_call(lambda: self._bad_key_is_bad_request(lambda: self.store.commit_granted(
            body.lease_id, call.instance_id, body.key, body.size, meta, body.checksum)))
        grant = self._grant(body.grant_next, call) if outcome == "stored" else None
        return Answer(StoreReply(outcome in ("stored", "exists"), "" if outcome == "stored" else outcome, grant))

    def _grant(self, size: int, call: Call) -> PrepareReply | None:
        """Pages lent ahead of the writer's next store, when it asked and the pool has them free (no pressure)."""
        if not size or not self._may_still_write(call.instance_id):
            return None
        lease = self.store.grant(size, call.instance_id, call.client.priority)
        if lease is None:
            return None
        return PrepareReply(True, "", lease.lease_id, list(lease.pages), lease.generation)

    def commit_many(self, call: Call) -> Answer:
        """Every lease of the list is committed (or refused) in turn; a bad id among them is the reply's
        error, after the others are done, so no good lease waits for the lease timeout."""
        results, refusal = [], None
        for lease_id in call.body.lease_ids:
            try:
                results.append(self._lease_call(lambda: self.store.commit(lease_id, call.instance_id)))
            except RequestFailed as exc:
                refusal = refusal or exc
                results.append(False)
        if refusal is not None:
            raise refusal
        return Answer(CommitManyReply(results))

    def store_inline(self, call: Call) -> Answer:
        if not call.data:
            raise RequestFailed(Code.BAD_REQUEST, "store_inline carries the object's bytes in one or more data frames")
        meta = self._meta(call.body.meta)
        blob = bytes(join_frames(call.data))
        stored, reason = self._bad_key_is_bad_request(lambda: self.store.store_inline(
            call.body.key, blob, meta, call.instance_id, call.client.priority))
        return Answer(StoreReply(stored, reason))

    def clear(self, call: Call) -> Answer:
        tier = call.body.tier
        if tier not in self.store.tier_names:
            raise RequestFailed(Code.BAD_REQUEST, f"unknown tier {tier!r}; this server has {', '.join(self.store.tier_names)}")
        self.store.clear(tier)
        return Answer(None)

    def flush(self, call: Call) -> Answer:
        return Answer(FlushReply(self.store.flush()))

    @staticmethod
    def _meta(wire: WireMeta):
        try:
            return wire.to_meta()
        except (ValueError, TypeError) as exc:
            raise RequestFailed(Code.BAD_REQUEST, f"bad object metadata: {exc}") from None

    @staticmethod
    def _bad_key_is_bad_request(fn):
        try:
            return fn()
        except ValueError as exc:
            raise RequestFailed(Code.BAD_REQUEST, str(exc)) from None

    @staticmethod
    def _lease_call(fn):
        try:
            return fn()
        except LeaseNotOwned as exc:
            raise RequestFailed(Code.NOT_OWNER, f"refused: {exc}") from None
        except UnknownLease as exc:
            raise RequestFailed(Code.UNKNOWN_LEASE, f"refused: {exc}") from None

    # -- pressure loop ---------------------------------------------------------------------------
    def _maintain(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(MAINTENANCE_INTERVAL_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._release_dead_orphans()
                self.store.maintenance()
            except Exception:   # the loop must outlive a bug in one round: logged
                log.exception("storage maintenance round failed")

    # -- liveness target -------------------------------------------------------------------------
    def touch_instance(self, instance_id: str) -> None:
        self.instances.touch(instance_id)

    def reap_stale_instances(self, reap_timeout_s: float, registration_grace_s: float) -> list[str]:
        return self.instances.stale(reap_timeout_s, registration_grace_s)

    def tracked_instance_count(self) -> int:
        return len(self.instances)

    def _may_still_write(self, instance_id: str) -> bool:
        """Whether the client's writer lock is held: its process (in any PID namespace) is not gone."""
        return writer_lock_held(self.store.segment.fileno(), instance_id)

    def drop_instance_state(self, instance_id: str) -> None:
        with self._writers_lock:
            wrote = instance_id in self._writers
            self._writers.discard(instance_id)
        alive = wrote and self._may_still_write(instance_id)
        released = self.store.drop_client(instance_id, may_still_write=alive)
        self.instances.forget(instance_id)
        if alive and instance_id in self.store.pool.orphan_owners():
            with self._writers_lock:
                self._orphans.add(instance_id)
            log.warning("client %s was dropped while writing and its writer lock is still held: its unfinished "
                        "writes' pages stay quarantined until its process exits", instance_id[:8])
        if released:
            log.info("released %d lease(s) of dropped client %s", released, instance_id[:8])

    def _release_dead_orphans(self) -> None:
        with self._writers_lock:
            dead = [iid for iid in self._orphans if not self._may_still_write(iid)]
            self._orphans.difference_update(dead)
        for iid in dead:
            freed = self.store.pool.release_orphans(iid)
            log.info("client %s has exited: %d orphaned write(s) released", iid[:8], freed)

    # -- module contract -------------------------------------------------------------------------
    def report_status(self) -> dict:
        stats = self.store.stats()
        return {"tiers": stats["tiers"], "pool": stats["pool"], "counts": stats["counts"],
                "write_queue": stats["write_queue"], "write_queue_capacity": stats["write_queue_capacity"],
                "tier_names": self.store.tier_names, "page_map": self.store.pool.page_map()}

    def quiesce(self) -> None:
        self._stop.set()
        self._wake.set()
        self._loop.join(timeout=5)
