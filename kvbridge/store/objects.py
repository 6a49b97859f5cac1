"""What the store holds: an opaque blob filed under a content key, plus small metadata.

The metadata travels with every object so a hash hit can be confirmed before it is trusted
(token count and a digest of the chunk's token ids) and so a foreign namespace is recognised.
It is persisted as JSON, never pickle.

Errors. Every storage fault is a StoreFault: CorruptObject (a check failed; the object is dropped),
ObjectVanished (another process removed it), UnstorableObject (it cannot be written in a tier's
format). Tiers raise them, the TieredStore catches them and counts a miss or a skipped write, so
they reach a caller of get/put/lookup never; TieredStore.clear raises StoreFault when the disk
cannot be listed. Programming errors are not storage faults and propagate as they are: a bad key
or metadata is a ValueError, metadata of the wrong type a TypeError.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

MAX_KEY_BYTES = 64
KINDS = ("chunk", "tail", "snapshot", "index", "passage")  # index: shadow engines keep token ids only;
#                                                             passage: blend mode (kvbridge.blend.passages)
TIER_NONE = "none"   # the tier name shown for a miss


class StoreFault(Exception):
    """An internal storage problem; the store turns it into a counted miss, never a user-facing error."""


class CorruptObject(StoreFault):
    """A stored object failed a check (magic, version, checksum, length, key); it has been dropped."""


class ObjectVanished(StoreFault):
    """The index knew the object but its file is gone (another process evicted or cleared it)."""


class UnstorableObject(StoreFault):
    """The object cannot be expressed in a tier's format (e.g. metadata over the L2 header's limit)."""


def check_key(key: bytes) -> bytes:
    """Keys are content hashes: non-empty bytes, at most 64 long."""
    if isinstance(key, (bytearray, memoryview)):
        key = bytes(key)
    if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"store keys are 1..{MAX_KEY_BYTES} bytes (a chunk hash), got {key!r:.80}")
    return key


@dataclass(frozen=True)
class ObjectMeta:
    """Small facts about a stored blob; `last_used` is refreshed by the store on every hit."""

    namespace: str
    n_tokens: int
    tokens_digest: bytes
    kind: str = "chunk"
    note: str = ""
    created: float = field(default_factory=time.time)
    last_used: float = 0.0
    codec: str = "raw"    # how the tier it was read from stores the payload (kvbridge.store.serde)
    lossy: str = ""       # the lossy codec the payload once passed through ("" = exact KV); sticky

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ObjectMeta.kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.n_tokens, int) or self.n_tokens < 0:
            raise ValueError(f"ObjectMeta.n_tokens must be an int >= 0, got {self.n_tokens!r}")
        if not isinstance(self.tokens_digest, bytes) or len(self.tokens_digest) > MAX_KEY_BYTES:
            raise ValueError("ObjectMeta.tokens_digest must be bytes (kvbridge.engine.hashing.tokens_digest: 16)")
        if not self.last_used:
            object.__setattr__(self, "last_used", self.created)

    def to_json(self) -> bytes:
        record = asdict(self)
        record["tokens_digest"] = self.tokens_digest.hex()
        return json.dumps(record, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> "ObjectMeta":
        """Strict decode; anything unexpected raises CorruptObject."""
        try:
            record = json.loads(data.decode("utf-8"))
            return cls(
                namespace=str(record["namespace"]),
                n_tokens=int(record["n_tokens"]),
                tokens_digest=bytes.fromhex(record["tokens_digest"]),
                kind=str(record["kind"]),
                note=str(record["note"]),
                created=float(record["created"]),
                last_used=float(record["last_used"]),
                codec=str(record.get("codec", "raw")),     # objects written before codecs existed
                lossy=str(record.get("lossy", "")),
            )
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
            raise CorruptObject(f"unreadable metadata: {exc}") from exc


@dataclass(frozen=True)
class StoredObject:
    """A get() result: the blob, its metadata and the tier it was found in ("L1", "L2").

    A remote store may hand out a blob that views memory it only borrows (the cache server's
    shared pages under a lease): then `intact()` says, after the caller copied out of it, whether
    the copy is whole (False: a torn copy, use nothing of it), and `release()` returns the loan.
    The embedded store's objects are plain bytes and have neither.
    """

    blob: Any
    meta: ObjectMeta
    tier: str
    intact: Callable[[], bool] | None = field(default=None, compare=False, repr=False)
    release: Callable[[], None] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class LookupResult:
    """How many LEADING hashes are stored, and the tier of each of those."""

    n_hit: int
    tiers: list[str]

