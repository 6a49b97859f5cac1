"""The cache server's wire format: every message between a CacheClient and the server, in one place.

Transport: ZMQ, one DEALER per client and one ROUTER in the server. A request is a multipart message
`[envelope, *data]`, a reply `[reply, *data]`; both first frames are msgspec MessagePack. `data` is
present only where bytes travel inline (a store or retrieve without shared memory); it is its own
frame so neither side copies it into a msgpack buffer. An object's inline bytes are cut into frames
of at most INLINE_FRAME_BYTES where both sides know it (a retrieve's `frame_bytes`, a hello reply's
`frame_bytes` for stores); a peer from before that sends and gets each object whole, in one frame.

The envelope is decoded first (request id, instance id, kind) and the body by its kind afterwards,
so a body that does not decode, or an unknown kind, still gets an error reply with the request's id.
The first request of every client is `hello`, carrying PROTOCOL_VERSION and (when the server has one)
the shared secret; a server answers any other request from an instance it does not know with
code "hello_required", and the client says hello again (a restarted server knows nobody).

Public for plugin authors: ServerModuleCallRequest / ServerModuleCallResponse (the envelope calls).
"""
from __future__ import annotations

from typing import Any

import msgspec

from kvbridge.store.history import Eviction
from kvbridge.store.objects import ObjectMeta

PROTOCOL_VERSION = 1
# The most frames a request may have: the envelope and a few data frames (store_inline carries one).
# The server drops the rest of a longer message as it reads it (a whole-message bound; ZMQ_MAXMSGSIZE
# bounds each frame only).
MAX_REQUEST_FRAMES = 16
# Inline bytes travel in frames of at most this size (issue 47, Docs/Research.md §32). libzmq's CURVE
# encodes and decodes every frame through fresh buffers of the frame's size: a 6 MB chunk sent whole
# goes through main memory several times per side, 1 MiB pieces stay in the CPU's cache, and the
# sender encrypts the next piece while the receiver decrypts the last. 0 on the wire: one frame per
# object (clients and servers from before issue 47).
INLINE_FRAME_BYTES = 1 << 20
MIN_INLINE_FRAME_BYTES = 64 << 10   # smaller asks are refused: a reply of thousands of frames for nothing


class Kind:
    """Request kinds (the envelope's `kind`): the core requests every server answers."""

    HELLO = "hello"
    PING = "ping"
    GOODBYE = "goodbye"
    STATUS = "status"
    LOOKUP = "lookup"
    RETRIEVE = "retrieve"
    RETRIEVE_MANY = "retrieve_many"
    RELEASE = "release"
    STORE_PREPARE = "store_prepare"
    STORE_COMMIT = "store_commit"
    STORE_PREPARE_MANY = "store_prepare_many"
    STORE_COMMIT_MANY = "store_commit_many"
    STORE_INLINE = "store_inline"
    STORE_GRANTED = "store_granted"            # a store into pages granted ahead: one round trip (issue 47)
    CLEAR = "clear"
    FLUSH = "flush"
    SERVER_MODULE_CALL = "server_module_call"
    SERVER_MODULE_AFFINITY_CALL = "server_module_affinity_call"
    PROBE_MISS = "probe_miss"                  # why a restore missed: the keys' history, pending writes, namespaces
    RECENT_EVICTIONS = "recent_evictions"


class Code:
    """Machine-readable reasons in a failed reply (`error` holds the text for a person)."""

    HELLO_REQUIRED = "hello_required"
    UNAUTHORIZED = "unauthorized"
    VERSION = "version_mismatch"
    BAD_REQUEST = "bad_request"
    UNKNOWN_KIND = "unknown_kind"
    TOO_LARGE = "too_large"
    NOT_OWNER = "lease_not_owned"
    UNKNOWN_LEASE = "unknown_lease"
    INTERNAL = "internal_error"


# -- framing -----------------------------------------------------------------------------------


class Envelope(msgspec.Struct, array_like=True):
    request_id: int
    instance_id: str
    kind: str
    body: msgspec.Raw = msgspec.Raw(b"\xc0")   # msgpack nil: kinds without a body


class Reply(msgspec.Struct, array_like=True):
    request_id: int
    success: bool
    error: str = ""
    code: str = ""
    body: msgspec.Raw = msgspec.Raw(b"\xc0")


# -- bodies ------------------------------------------------------------------------------------


class WireMeta(msgspec.Struct, array_like=True):
    """ObjectMeta on the wire (kvbridge.store.objects.ObjectMeta is the one in memory)."""

    namespace: str
    n_tokens: int
    tokens_digest: bytes
    kind: str
    note: str = ""
    created: float = 0.0
    last_used: float = 0.0
    codec: str = "raw"
    lossy: str = ""

    @classmethod
    def of(cls, meta: ObjectMeta) -> "WireMeta":
        return cls(meta.namespace, meta.n_tokens, meta.tokens_digest, meta.kind, meta.note, meta.created,
                   meta.last_used, meta.codec, meta.lossy)

    def to_meta(self) -> ObjectMeta:
        """Raises ValueError when a field is out of range (ObjectMeta checks itself)."""
        return ObjectMeta(namespace=self.namespace, n_tokens=self.n_tokens, tokens_digest=self.tokens_digest,
                          kind=self.kind, note=self.note, created=self.created, last_used=self.last_used,
                          codec=self.codec, lossy=self.lossy)


class Hello(msgspec.Struct):
    protocol_version: int
    token: str = ""
    priority: int = 5
    pid: int = 0
    hostname: str = ""
    label: str = ""


class HelloReply(msgspec.Struct):
    protocol_version: int
    server_id: str
    tier_names: list[str]
    heartbeat_s: float                 # ping at least this often to stay alive (0: no reaper)
    lease_timeout_s: float
    shm_path: str = ""                 # empty: no shared memory; bytes travel inline
    shm_nonce: bytes = b""             # proves the client mapped this server's segment (same host)
    page_bytes: int = 0
    modules: list[str] = []
    frame_bytes: int = 0               # an inline store may cut its bytes into frames of this size (0: one frame)


class PingReply(msgspec.Struct):
    server_id: str
    server_time: float


class Lookup(msgspec.Struct):
    hashes: list[bytes]
    namespace: str | None = None
    chunk_tokens: int = 0              # tokens per hash, for the requested/hit token metrics
    purpose: str = "prompt"            # LOOKUP_PURPOSES: only "prompt" lookups feed the hit-rate series


# Why a client looks up (the cache server's metrics keep them apart, Docs/Prometheus.md): "prompt", a prompt's
# restore (the hit rate); "store", a writer asking what is held before or after it writes; "kv_events", KV-event
# rechecks of what the store still holds (Scheduler.stored_media, issue 34).
LOOKUP_PURPOSES = ("prompt", "store", "kv_events")
# what a probe_miss answer found first, in the miss explainer's order (the lookup module and /metrics count them)
PROBE_OUTCOMES = ("evicted", "pending", "down", "other_namespace", "nothing")


class LookupReply(msgspec.Struct):
    n_hit: int
    tiers: list[str]


class Retrieve(msgspec.Struct):
    key: bytes
    namespace: str | None = None
    via_shm: bool = True
    frame_bytes: int = 0               # inline bytes in frames of at most this size (0: the object in one frame)


class RetrieveReply(msgspec.Struct):
    found: bool
    tier: str = ""
    meta: WireMeta | None = None
    size: int = 0
    lease_id: int = 0                  # via shared memory: release it when the copy is done
    pages: list[int] = []
    generation: int = 0                # the pages' generation; any other value after the copy: torn
    checksum: bytes = b""              # the writer's digest of the bytes, when it gave one
    frames: int = 1                    # inline: the data frames holding the bytes, in order


class RetrieveMany(msgspec.Struct):
    """Several objects in one round trip (a restore's chunks and tail); each answered like a Retrieve."""

    keys: list[bytes]
    namespace: str | None = None
    via_shm: bool = True
    frame_bytes: int = 0               # as Retrieve.frame_bytes


class RetrieveManyReply(msgspec.Struct):
    items: list[RetrieveReply]         # in key order; the inline ones' bytes are the data frames, in order


class Release(msgspec.Struct):
    lease_ids: list[int]


class StorePrepare(msgspec.Struct):
    key: bytes
    size: int
    meta: WireMeta
    checksum: bytes = b""              # the writer's digest of the bytes (KVB_CACHE_SERVER_CHECKSUM); b"": none


class PrepareReply(msgspec.Struct):
    accepted: bool
    reason: str = ""                   # when not accepted: "exists", "busy", "too_large", "pressure", "no_space"
    lease_id: int = 0
    pages: list[int] = []
    generation: int = 0


class StoreCommit(msgspec.Struct):
    lease_id: int
    grant_next: int = 0                # and lend pages for this many bytes ahead of the next store (0: none)


class StorePrepareMany(msgspec.Struct):
    """A prompt's new objects in one round trip; each answered like a StorePrepare."""

    items: list[StorePrepare]


class PrepareManyReply(msgspec.Struct):
    items: list[PrepareReply]


class StoreCommitMany(msgspec.Struct):
    lease_ids: list[int]


class CommitManyReply(msgspec.Struct):
    stored: list[bool]


class StoreInline(msgspec.Struct):
    key: bytes
    meta: WireMeta                     # the bytes are the next frame(s), in order (several: HelloReply.frame_bytes)


class StoreReply(msgspec.Struct):
    stored: bool
    reason: str = ""
    grant: PrepareReply | None = None  # pages lent for the next store (asked for with grant_next), if given


class StoreGranted(msgspec.Struct):
    """A store whose bytes are already in the pages of a grant (a StoreReply.grant): named and committed in
    one round trip. Answered with a StoreReply: "exists"/"busy" leave the grant with the client; "revoked":
    the client releases it and stores the usual way."""

    lease_id: int
    key: bytes
    size: int
    meta: WireMeta
    checksum: bytes = b""
    grant_next: int = 0


class Clear(msgspec.Struct):
    tier: str


class FlushReply(msgspec.Struct):
    written: int


class WireEviction(msgspec.Struct, array_like=True):
    """kvbridge.store.history.Eviction on the wire."""

    key: bytes
    namespace: str
    tier: str
    reason: str
    at: float
    policy: str = ""
    for_key: bytes = b""
    for_kind: str = ""
    for_size: int = 0
    size: int = 0
    gone: bool = True

    @classmethod
    def of(cls, entry: Eviction) -> "WireEviction":
        return cls(entry.key, entry.namespace, entry.tier, entry.reason, entry.at, entry.policy, entry.for_key,
                   entry.for_kind, entry.for_size, entry.size, entry.gone)

    def to_eviction(self) -> Eviction:
        return Eviction(key=self.key, namespace=self.namespace, tier=self.tier, reason=self.reason, at=self.at,
                        policy=self.policy, for_key=self.for_key, for_kind=self.for_kind, for_size=self.for_size,
                        size=self.size, gone=self.gone)


class ProbeMiss(msgspec.Struct):
    """The first keys a restore missed, and the same prompt's keys under other namespaces (probes)."""

    keys: list[bytes]
    probes: list[bytes] = []


class ProbeMissReply(msgspec.Struct):
    """kvbridge.store.history.MissProbe: history/pending answer keys, found answers probes."""

    history: list[WireEviction | None]
    pending: list[bool]
    found: list[str]
    namespaces: dict[str, int] = {}
    down: dict[str, str] = {}


class RecentEvictions(msgspec.Struct):
    limit: int = 100


class RecentEvictionsReply(msgspec.Struct):
    evictions: list[WireEviction]            # newest first


class ServerModuleCallRequest(msgspec.Struct):
    """A call to a server module's `@server_module_handler` method: plugin-owned payload bytes."""

    method: str
    payload: bytes = b""


class ServerModuleCallResponse(msgspec.Struct):
    success: bool
    payload: bytes = b""
    error: str = ""


BODY_TYPES: dict[str, Any] = {
    Kind.HELLO: Hello,
    Kind.PING: None,
    Kind.GOODBYE: None,
    Kind.STATUS: None,
    Kind.LOOKUP: Lookup,
    Kind.RETRIEVE: Retrieve,
    Kind.RETRIEVE_MANY: RetrieveMany,
    Kind.RELEASE: Release,
    Kind.STORE_PREPARE: StorePrepare,
    Kind.STORE_COMMIT: StoreCommit,
    Kind.STORE_PREPARE_MANY: StorePrepareMany,
    Kind.STORE_COMMIT_MANY: StoreCommitMany,
    Kind.STORE_INLINE: StoreInline,
    Kind.STORE_GRANTED: StoreGranted,
    Kind.CLEAR: Clear,
    Kind.FLUSH: None,
    Kind.SERVER_MODULE_CALL: ServerModuleCallRequest,
    Kind.SERVER_MODULE_AFFINITY_CALL: ServerModuleCallRequest,
    Kind.PROBE_MISS: ProbeMiss,
    Kind.RECENT_EVICTIONS: RecentEvictions,
}

_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_body_decoders = {kind: msgspec.msgpack.Decoder(t) for kind, t in BODY_TYPES.items() if t is not None}


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def encode_request(request_id: int, instance_id: str, kind: str, body: Any = None) -> bytes:
    return _encoder.encode(Envelope(request_id, instance_id, kind, msgspec.Raw(_encoder.encode(body))))


def decode_envelope(frame: bytes | memoryview) -> Envelope:
    """Raises msgspec.DecodeError / ValidationError for a frame that is not an envelope."""
    return _envelope_decoder.decode(frame)


def decode_body(kind: str, raw: msgspec.Raw) -> Any:
    """The typed body of a known kind (None for kinds without one); KeyError for an unknown kind."""
    decoder = _body_decoders.get(kind)
    if decoder is None:
        if kind not in BODY_TYPES:
            raise KeyError(kind)
        return None
    return decoder.decode(raw)


def encode_reply(request_id: int, body: Any = None, *, error: str = "", code: str = "") -> bytes:
    return _encoder.encode(Reply(request_id, not error and not code, error, code, msgspec.Raw(_encoder.encode(body))))


def decode_reply(frame: bytes | memoryview) -> Reply:
    return _reply_decoder.decode(frame)


def cut_frames(blob, frame_bytes: int) -> tuple:
    """`blob` as views of at most `frame_bytes` bytes each, in order (no copy); 0: the blob whole."""
    if not frame_bytes or len(blob) <= frame_bytes:
        return (blob,)
    view = memoryview(blob).cast("B")
    return tuple(view[start:start + frame_bytes] for start in range(0, len(view), frame_bytes))


def join_frames(frames) -> Any:
    """Inline bytes sent in several frames as one bytes object (one copy); a single frame as it came."""
    return frames[0] if len(frames) == 1 else b"".join(frames)


def decode_reply_body(reply: Reply, body_type: Any) -> Any:
    """A reply's body as `body_type` (None: the plain msgpack value, e.g. a status dict)."""
    if body_type is None:
        return msgspec.msgpack.decode(reply.body)
    return msgspec.msgpack.decode(reply.body, type=body_type)
