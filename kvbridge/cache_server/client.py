"""CacheClient: one engine process's connection to the cache server (a ZMQ DEALER and, same-host, the shared pool).

Place in the flow: CachedEngine -> RemoteStore (kvbridge.cache_server.remote_store) -> **CacheClient**
-> the server's ROUTER. Plugin authors use it directly:

    client = CacheClient("tcp://127.0.0.1:5555")
    client.ping(); client.status()["storage"]
    client.server_module_call(ServerModuleCallRequest("my_pkg.echo", b"hi")).result(timeout=5)

The socket plumbing is kvbridge.cache_server.connection (one thread owns the socket; callers wait on
a Future), the standing with the server kvbridge.cache_server.session (keys, hello, back-off,
refusals); this module is the calls on top of them and the shared memory. A request unanswered
within `timeout_s` fails with CacheServerUnavailable and the client stays "down" for a short
back-off, answering at once with the same error, so a dead server costs an engine one timeout, not
one per chunk. After the back-off the next call says hello again: a restarted server (new shared
memory, no registrations) is picked up by itself.

Refusals a person must act on (wrong token, another protocol version) raise CacheServerRefused, and
so does a server this client cannot authenticate (ServerNotAuthenticated, a CacheServerRefused): the
client trusts only the server key it is configured with (`server_key`, KVB_CACHE_SERVER_PUBLIC_KEY)
or the one in the owner's key file (kvbridge.cache_server.curve), and sends nothing to a peer that
fails the CURVE handshake with it. A failed handshake after the key file changed is a restarted
server: the client rereads the file and says hello to it once more. A refusal is remembered for the
same back-off as a timeout, so a squatter on the port costs one handshake per back-off period.
"""
from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvbridge.cache_server import protocol
from kvbridge.cache_server.connection import (CacheServerError, CacheServerRefused, CacheServerUnavailable,
                                              NotAuthenticated)
from kvbridge.cache_server.curve import NoServerKey, ServerNotAuthenticated
from kvbridge.cache_server.liveness import WriterLockUnavailable, hold_writer_lock
from kvbridge.cache_server.protocol import Kind
from kvbridge.cache_server.session import Session
from kvbridge.cache_server.shm import Segment, SegmentUnavailable, object_checksum
from kvbridge.store.objects import LookupResult, ObjectMeta

__all__ = ["CacheClient", "CacheServerError", "CacheServerRefused", "CacheServerUnavailable", "Retrieved",
           "ServerNotAuthenticated"]
log = logging.getLogger("kvbridge.cache_server.client")
CLOSE_SETTLE_S = 2.0     # close() waits at most this long for answers still due (a store's commit)


@dataclass
class Retrieved:
    """A retrieved object. With a shared-memory lease `blob` may view the server's pages: call
    `intact()` after copying out of it (False: the pages were reused meanwhile, a torn copy), then
    `release()`. Inline or gathered objects are plain bytes and need neither."""

    blob: Any
    meta: ObjectMeta
    tier: str
    lease_id: int = 0
    pages: tuple = ()
    generation: int = 0
    checksum: bytes = b""   # its writer's digest, checked after the copy when this client checks checksums


class CacheClient:
    def __init__(self, url: str, instance_id: str | None = None, priority: int = 5, *, token: str = "",
                 server_key: str = "", timeout_s: float = 5.0, use_shm: bool = True, label: str = "",
                 wait_for_key: bool = False, checksum: bool = False,
                 frame_bytes: int = protocol.INLINE_FRAME_BYTES, grants: bool = True) -> None:
        """`token`: the shared secret ('' -> this user's token file); `server_key`: the server's Z85 public key
        ('' -> this user's key file). `wait_for_key`: a key file that does not exist yet (a server still
        starting) is a warning here instead of CacheServerRefused; calls are refused until it appears.
        `checksum` (KVB_CACHE_SERVER_CHECKSUM): stores through shared memory carry a digest of their bytes,
        and every object read out of shared memory is checked against its writer's digest. `frame_bytes`: inline
        bytes travel in frames of at most this size (0: each object in one frame, as before issue 47). `grants`: a
        lone store asks for pages lent ahead of the next one, which then takes one round trip (False: every lone
        store is prepare and commit, as before issue 47)."""
        if not isinstance(priority, int) or not 0 <= priority <= 9:
            raise ValueError(f"CacheClient(priority=...) must be an int from 0 to 9, got {priority!r}")
        if instance_id is not None and (not isinstance(instance_id, str) or not 0 < len(instance_id) <= 128):
            # the wire format takes a string: anything else was a malformed hello the server logged while
            # the caller saw only "no answer to hello ... not reachable"
            raise ValueError(f"CacheClient(instance_id=...) must be a string of 1 to 128 characters, got "
                             f"{type(instance_id).__name__} {instance_id!r}")
        if not isinstance(url, str) or not url.startswith(("tcp://", "ipc://")):
            raise ValueError(f"CacheClient(url=...) must be tcp://HOST:PORT or ipc:///path, got {url!r}")
        if not isinstance(frame_bytes, int) or not (frame_bytes == 0 or frame_bytes >= protocol.MIN_INLINE_FRAME_BYTES):
            raise ValueError(f"CacheClient(frame_bytes=...) must be 0 (one frame per object) or at least "
                             f"{protocol.MIN_INLINE_FRAME_BYTES}, got {frame_bytes!r}")
        self.url = url
        self.frame_bytes = frame_bytes
        self.grants = grants
        self.instance_id = instance_id or uuid.uuid4().hex
        self.priority = priority
        self.timeout_s = timeout_s
        self.use_shm = use_shm
        self.label = label
        self.checksum = checksum
        self._closing = threading.Event()
        self._segment: Segment | None = None
        self._writes_via_shm = False   # the segment is mapped and this client's writer lock is held on it
        self._grant: protocol.PrepareReply | None = None   # pages lent ahead of the next lone store (issue 47)
        self._grant_lock = threading.Lock()
        self.counters = {"timeouts": 0, "refusals": 0, "reconnects": 0, "torn_copies": 0, "inline_retrieves": 0,
                         "shm_retrieves": 0, "checksum_mismatches": 0, "unchecked_reads": 0, "granted_stores": 0}
        self._session = Session(url, self.instance_id, priority=priority, label=label, token=token,
                                server_key=server_key, timeout_s=timeout_s, counters=self.counters,
                                on_hello=self._attach)
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="kvb-cache-heartbeat", daemon=True)
        try:
            self._session.ensure_hello()
        except CacheServerUnavailable as exc:
            log.warning("cache server %s not reachable yet (%s); requests are misses until it answers", url, exc)
        except NoServerKey as exc:
            if not wait_for_key:
                self.close()
                raise
            log.warning("%s; requests are refused until the key appears", exc)
        except BaseException:
            self.close()
            raise
        self._heartbeat.start()

    # -- public API ------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._session.connected

    @property
    def tier_names(self) -> list[str]:
        hello = self._session.hello
        return list(hello.tier_names) if hello else ["L1", "L2"]

    @property
    def server_id(self) -> str:
        hello = self._session.hello
        return hello.server_id if hello else ""

    @property
    def shared_memory(self) -> bool:
        return self._segment is not None

    def ping(self) -> protocol.PingReply:
        return self._call(Kind.PING, None, protocol.PingReply)

    def status(self) -> dict:
        """Each server module's report_status() under its module_name (and "server": the server's facts)."""
        return self._call(Kind.STATUS, None, None)

    def server_module_call(self, request: protocol.ServerModuleCallRequest) -> Future:
        return self._module_call(Kind.SERVER_MODULE_CALL, request)

    def server_module_affinity_call(self, request: protocol.ServerModuleCallRequest) -> Future:
        return self._module_call(Kind.SERVER_MODULE_AFFINITY_CALL, request)

    def lookup(self, hashes: list[bytes], namespace: str | None = None, chunk_tokens: int = 0,
               purpose: str = "prompt") -> LookupResult:
        reply = self._call(Kind.LOOKUP, protocol.Lookup(list(hashes), namespace, chunk_tokens, purpose),
                           protocol.LookupReply)
        return LookupResult(reply.n_hit, list(reply.tiers))

    def probe_miss(self, keys: list[bytes], probes: list[bytes] = ()) -> protocol.ProbeMissReply:
        """Why a restore missed `keys` (the server's eviction ring, pending writes, namespaces; `probes`: the
        prompt's keys under other namespaces): one round trip, raising as every call does."""
        return self._call(Kind.PROBE_MISS, protocol.ProbeMiss([bytes(k) for k in keys], [bytes(k) for k in probes]),
                          protocol.ProbeMissReply)

    def recent_evictions(self, limit: int = 100) -> list:
        """The server's newest `limit` evictions (kvbridge.store.history.Eviction), newest first."""
        reply = self._call(Kind.RECENT_EVICTIONS, protocol.RecentEvictions(limit), protocol.RecentEvictionsReply)
        return [entry.to_eviction() for entry in reply.evictions]

    def retrieve(self, key: bytes, namespace: str | None = None, zero_copy: bool = True) -> Retrieved | None:
        """The object, or None. zero_copy: a contiguous shared-memory object is returned as a view
        under a lease (check intact(), then release()); otherwise it is copied out and checked here."""
        segment = self._segment
        reply, data = self._call(Kind.RETRIEVE, protocol.Retrieve(key, namespace, segment is not None, self.frame_bytes),
                                 protocol.RetrieveReply, with_data=True)
        return self._received(reply, protocol.join_frames(data) if data else b"", segment, zero_copy)

    def retrieve_many(self, keys: list[bytes], namespace: str | None = None,
                      zero_copy: bool = True) -> list[Retrieved | None]:
        """retrieve() for several keys in one round trip (a restore's chunks and its tail). Each key is
        asked once (the server refuses repeats); a repeated key's later places are misses (one lease,
        released once)."""
        segment = self._segment
        unique = list(dict.fromkeys(bytes(k) for k in keys))
        reply, data = self._call(Kind.RETRIEVE_MANY,
                                 protocol.RetrieveMany(unique, namespace, segment is not None, self.frame_bytes),
                                 protocol.RetrieveManyReply, with_data=True)
        found, at = {}, 0
        for key, item in zip(unique, reply.items):
            blob = b""
            if item.found and not item.lease_id:   # its bytes: the next item.frames data frames
                frames = data[at:at + item.frames]
                blob = protocol.join_frames(frames) if frames else b""
                at += item.frames
            found[key] = self._received(item, blob, segment, zero_copy)
        seen: set[bytes] = set()
        answers = []
        for key in (bytes(k) for k in keys):
            answers.append(None if key in seen else found[key])
            seen.add(key)
        return answers

    def _received(self, reply: protocol.RetrieveReply, data, segment: Segment | None,
                  zero_copy: bool) -> Retrieved | None:
        if not reply.found:
            return None
        meta = reply.meta.to_meta()
        if not reply.lease_id:
            self.counters["inline_retrieves"] += 1
            return Retrieved(data, meta, reply.tier)
        self.counters["shm_retrieves"] += 1
        found = Retrieved(None, meta, reply.tier, reply.lease_id, tuple(reply.pages), reply.generation, reply.checksum)
        if segment is None or segment is not self._segment:
            self.release([found])
            return None
        view = segment.view(list(reply.pages), reply.size) if zero_copy else None
        if view is not None:
            found.blob = view
            found.segment = segment
            return found
        blob = segment.read(list(reply.pages), reply.size)
        intact = segment.generation_ok(list(reply.pages), reply.generation)
        self.release([found])
        if not intact:
            self.counters["torn_copies"] += 1
            return None
        if not self._checksum_ok(found, blob):
            return None
        found.blob, found.lease_id = blob, 0
        return found

    def _checksum_ok(self, found: Retrieved, copied) -> bool:
        """With checksums on: do the copied bytes match their writer's digest? (counted either way)"""
        if not self.checksum:
            return True
        if not found.checksum:
            self.counters["unchecked_reads"] += 1   # its writer gave no digest (checksums off there)
            return True
        if object_checksum(copied) == found.checksum:
            return True
        self.counters["checksum_mismatches"] += 1
        log.warning("an object read from shared memory does not match its writer's checksum: counted a miss")
        return False

    def intact(self, found: Retrieved) -> bool:
        """After copying out of a zero-copy view: were the pages still this object's?"""
        segment = getattr(found, "segment", None)
        if not found.lease_id or segment is None:
            return True
        ok = segment.generation_ok(list(found.pages), found.generation)
        if not ok:
            self.counters["torn_copies"] += 1
            return False
        return found.blob is None or self._checksum_ok(found, found.blob)

    def release(self, objects: list[Retrieved]) -> None:
        """End the read leases of these objects (sent without waiting for the answer)."""
        ids = [o.lease_id for o in objects if o.lease_id]
        for o in objects:
            o.lease_id = 0
            if hasattr(o, "segment"):
                o.blob = None
        if ids:
            self._send(Kind.RELEASE, protocol.Release(ids))

    def store(self, key: bytes, blob, meta: ObjectMeta) -> tuple[bool, str]:
        """(stored, reason): through shared memory (prepare, copy, commit) or inline.

        Returns once the server has the object (the commit answered): an engine killed right after
        loses nothing it was told was stored. A write revoked under CRITICAL pressure is (False,
        "revoked"), and the server frees its pages itself."""
        wire = protocol.WireMeta.of(meta)
        segment = self._segment if self._writes_via_shm else None
        if segment is None:
            reply = self._call(Kind.STORE_INLINE, protocol.StoreInline(key, wire), protocol.StoreReply,
                               data=self._store_frames(blob))
            return reply.stored or reply.reason == "exists", reply.reason   # already there counts as stored
        grant = self._take_grant(segment, len(blob))
        if grant is not None:
            done = self._store_granted(segment, grant, key, blob, wire)
            if done is not None:
                return done
        prepared = self._call(Kind.STORE_PREPARE, protocol.StorePrepare(key, len(blob), wire, self._digest(blob)),
                              protocol.PrepareReply)
        if not prepared.accepted:
            return prepared.reason == "exists", prepared.reason
        try:
            segment.write(list(prepared.pages), blob)
        except BaseException:
            self._send(Kind.RELEASE, protocol.Release([prepared.lease_id]))
            raise
        committed = self._call(Kind.STORE_COMMIT, protocol.StoreCommit(prepared.lease_id, self._grant_wanted(len(blob))),
                               protocol.StoreReply)
        self._keep_grant(committed.grant)
        return committed.stored, committed.reason

    # A lone store is two round trips (prepare, commit) around its copy. With a grant, pages the server lent
    # ahead (asked for in the commit before), it is the copy and one round trip that names the object and
    # brings the next grant. A server from before issue 47 gives none; one under pressure gives none.
    def _grant_wanted(self, size: int) -> int:
        with self._grant_lock:
            return 0 if self._grant is not None or not self.grants else size

    def _take_grant(self, segment: Segment, size: int) -> protocol.PrepareReply | None:
        """The grant when it fits `size` bytes (it is then this call's alone); one too small is given back."""
        if not self.grants:
            return None
        with self._grant_lock:
            grant, self._grant = self._grant, None
        if grant is None or len(grant.pages) * segment.page_bytes >= size:
            return grant
        self._send(Kind.RELEASE, protocol.Release([grant.lease_id]))
        return None

    def _keep_grant(self, grant: protocol.PrepareReply | None) -> None:
        if grant is None or not grant.accepted:
            return
        with self._grant_lock:
            spare = self._grant is not None
            if not spare:
                self._grant = grant
        if spare:   # another thread's store brought one first: one grant per client
            self._send(Kind.RELEASE, protocol.Release([grant.lease_id]))

    def _store_granted(self, segment: Segment, grant: protocol.PrepareReply, key: bytes, blob,
                       wire: protocol.WireMeta) -> tuple[bool, str] | None:
        """The store through a grant: (stored, reason), or None when the grant was revoked (store the usual way)."""
        pages = list(grant.pages)[:-(-len(blob) // segment.page_bytes)]
        try:
            segment.write(pages, blob)
            reply = self._call(Kind.STORE_GRANTED, protocol.StoreGranted(grant.lease_id, key, len(blob), wire,
                                                                         self._digest(blob), len(blob)),
                               protocol.StoreReply)
        except BaseException:
            self._send(Kind.RELEASE, protocol.Release([grant.lease_id]))
            raise
        if reply.reason == "revoked":
            self._send(Kind.RELEASE, protocol.Release([grant.lease_id]))
            return None
        self.counters["granted_stores"] += 1
        if reply.reason in ("exists", "busy"):
            self._keep_grant(grant)   # not used up: still this client's
        else:
            self._keep_grant(reply.grant)
        return reply.stored, reply.reason

    def _store_frames(self, blob) -> tuple:
        """An inline store's data frames: cut like a retrieve's when the server takes several (its hello says
        so), never more than a request may carry; whole for a server from before issue 47."""
        hello = self._session.hello
        if not (self.frame_bytes and hello is not None and hello.frame_bytes):
            return (blob,)
        most = protocol.MAX_REQUEST_FRAMES - 1   # the envelope is the first frame
        return protocol.cut_frames(blob, max(self.frame_bytes, -(-len(blob) // most)))

    def _digest(self, blob) -> bytes:
        return object_checksum(blob) if self.checksum else b""

    def store_many(self, items: list[tuple[bytes, object, ObjectMeta]]) -> list[tuple[bool, str]]:
        """store() for a prompt's objects: one prepare round trip for all of them, one commit for all."""
        segment = self._segment if self._writes_via_shm else None
        if segment is None or not items:
            return [self.store(key, blob, meta) for key, blob, meta in items]
        request = protocol.StorePrepareMany([protocol.StorePrepare(key, len(blob), protocol.WireMeta.of(meta),
                                                                   self._digest(blob))
                                             for key, blob, meta in items])
        prepared = self._call(Kind.STORE_PREPARE_MANY, request, protocol.PrepareManyReply).items
        leases: list[int] = []
        results: list[tuple[bool, str]] = []
        written: list[int] = []   # indexes into results of the objects written into pages
        try:
            for (key, blob, meta), answer in zip(items, prepared):
                if answer.accepted:
                    segment.write(list(answer.pages), blob)
                    leases.append(answer.lease_id)
                    written.append(len(results))
                    results.append((True, ""))
                else:
                    results.append((answer.reason == "exists", answer.reason))
        except BaseException:
            unused = [a.lease_id for a in prepared if a.accepted and a.lease_id not in leases]
            self._send(Kind.RELEASE, protocol.Release(unused + leases))
            raise
        if leases:
            committed = self._call(Kind.STORE_COMMIT_MANY, protocol.StoreCommitMany(leases), protocol.CommitManyReply)
            for index, stored in zip(written, committed.stored):
                if not stored:
                    results[index] = (False, "revoked")
        return results

    def clear(self, tier: str) -> None:
        self._call(Kind.CLEAR, protocol.Clear(tier), None)

    def flush(self) -> int:
        return self._call(Kind.FLUSH, None, protocol.FlushReply).written

    def close(self) -> None:
        """Stop the threads and close the socket; leases still held are released by the server's reaper."""
        if self._closing.is_set():
            return
        session = self._session
        if session.hello is not None:   # the server drops this client's state (leases, its row) at once
            self._send(Kind.GOODBYE, None)
            # releases and the goodbye are not waited for: let them go out before the socket closes
            session.conn.settle(min(self.timeout_s, CLOSE_SETTLE_S), still_up=lambda: session.hello is not None)
        self._closing.set()
        if self._heartbeat.is_alive():
            self._heartbeat.join(timeout=5)
        session.conn.close()
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def __enter__(self) -> "CacheClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- calls -----------------------------------------------------------------------------------
    def _module_call(self, kind: str, request: protocol.ServerModuleCallRequest) -> Future:
        outer: Future = Future()

        def finish(inner: Future) -> None:
            try:
                reply, _ = inner.result()
            except NotAuthenticated as exc:   # the socket thread runs this: no back-off bookkeeping here
                outer.set_exception(ServerNotAuthenticated(f"cache server {self.url}: {exc}"))
                return
            except BaseException as exc:
                outer.set_exception(exc)
                return
            if not reply.success:
                outer.set_result(protocol.ServerModuleCallResponse(False, b"", reply.error))
            else:
                outer.set_result(protocol.decode_reply_body(reply, protocol.ServerModuleCallResponse))

        try:
            self._session.ensure_hello()
            self._send(kind, request).add_done_callback(finish)
        except BaseException as exc:
            outer.set_exception(exc)
        return outer

    def _attach(self, answer: protocol.HelloReply) -> None:
        """Map the server's pool when it is on this host (the nonce proves it); else bytes go inline."""
        old, self._segment = self._segment, None
        with self._grant_lock:
            self._grant = None   # a grant is a lease of the server that gave it; hello again: it is gone
        if old is not None and str(old.path) == answer.shm_path and old.nonce == answer.shm_nonce:
            self._segment = old
            return
        if old is not None:
            old.close()
        self._writes_via_shm = False
        if not (self.use_shm and answer.shm_path):
            return
        try:
            self._segment = Segment.attach(answer.shm_path, answer.shm_nonce)
        except SegmentUnavailable as exc:
            log.info("cache server's shared memory not usable here (%s); bytes travel inline", exc)
            return
        try:   # the server lends pages for writing only to a writer whose lock it sees
            hold_writer_lock(self._segment.fileno(), self.instance_id)
            self._writes_via_shm = True
        except WriterLockUnavailable as exc:
            self._writes_via_shm = False
            log.info("stores to cache server %s travel inline: %s", self.url, exc)

    def _call(self, kind: str, body: Any, reply_type: Any, data: tuple = (), with_data: bool = False):
        """Send, wait, decode (kvbridge.cache_server.session: hello, back-off, refusals)."""
        return self._session.call(kind, body, reply_type, data, with_data)

    def _send(self, kind: str, body: Any, data: tuple = ()) -> Future:
        """Hand a request to the connection without waiting for the answer."""
        return self._session.send(kind, body, data)

    def _heartbeat_loop(self) -> None:
        """Ping at the server's heartbeat interval so an idle engine is not reaped (no busy polling)."""
        while True:
            hello = self._session.hello
            interval = hello.heartbeat_s if hello and hello.heartbeat_s else 30.0
            if self._closing.wait(interval):
                return
            try:
                self.ping()
            except (CacheServerUnavailable, CacheServerError, CacheServerRefused):
                pass
