"""L3: objects in a Redis or Valkey server, or a Redis Cluster, shared by every host that names it.

    KVB_L3_URL=redis://127.0.0.1:6379/0     (rediss://, unix:///path, valkey://, redis-cluster://h:p,h:p)

Layout. One value per object under `<KVB_L3_PREFIX>:obj:<key hex>`, written with a single SET (so
a reader sees a whole old value, a whole new one or none): the same checked header as an L2 file
(kvbridge.store.diskformat with the magic b"KVB-L3\\r\\n": format version, key, metadata with the
namespace and the codec, payload length and blake3), then the payload as the tier's codec
(KVB_L3_SERDE) made it. Optional expiry KVB_L3_TTL. Objects spread over a cluster's masters by key
(no hash tags). A value that fails a check is a counted miss and is deleted.

What this process knows. The server is shared and evicts on its own (maxmemory + allkeys-lru), so
the tier never assumes an object it wrote is still there, and never lists the server at start: its
index holds the objects this process wrote or found. A lookup of hashes nobody here knows is one
pipelined round trip (GETRANGE of each header plus STRLEN: one trip to a standalone server, one per
master holding any of the keys in a cluster); a get of an object evicted since is a counted miss.

Namespaces. Beside the objects, one hash `<KVB_L3_PREFIX>:namespaces` maps each namespace to the bytes
ever written under it (HINCRBY in the same pipelined round trip as the object's SET; refreshed to the
TTL when there is one), so a process that never wrote anything learns which namespaces L3 holds
(a miss's probe names "stored under another namespace" from it). It counts writes, not what is still
there: Redis evicts on its own, and a probe of the actual keys decides.

Faults (kvbridge.store.redis_link). Every call is bounded by KVB_L3_TIMEOUT; a server that cannot be
reached is marked down and skipped while a background prober retries it. Nothing here raises to the
user: get() raises StoreFault subclasses (the store counts them), put() returns False.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

from kvbridge.store.diskformat import FIXED_BYTES, Header, UnsupportedVersion, decode_object, encode_header, header_length, parse_header
from kvbridge.store.objects import CorruptObject, ObjectMeta, ObjectVanished, StoreFault, UnstorableObject
from kvbridge.store.redis_link import L3Refused, RedisLink, redact
from kvbridge.store.serde.tier import TierCodec
from kvbridge.store.tiers import Tier

log = logging.getLogger(__name__)

VALUE_MAGIC = b"KVB-L3\r\n"
HEAD_PROBE_BYTES = 2048          # one GETRANGE reads a whole header unless its metadata is unusually long
CENSUS_LIMIT = 100_000           # the GUI's count of objects under the prefix stops here
NO_CAPACITY_LIMIT = 1 << 62      # the server's maxmemory is the limit, not ours
REGISTRY_TTL_S = 2.0             # a read of the namespace registry is reused this long (a burst of misses)


@dataclass
class _Entry:
    size: int
    meta: ObjectMeta
    last_used: float


class RedisTier(RedisLink, Tier):
    """A Tier on Redis/Valkey (standalone or cluster). Never raises for faults: see the module doc.

    The value format and the index of what this process knows are here; the client, the breaker
    and the fault counters are RedisLink's (kvbridge.store.redis_link)."""

    persistent = True   # outlives this process: puts write through to it
    remote = True       # shared by hosts, slower than disk: the store writes it behind the request

    def __init__(self, url: str, *, password: str | None = None, prefix: str = "kvb", timeout: float = 2.0,
                 ttl: float = 0.0, codec: TierCodec | None = None, name: str = "L3",
                 password_env: str = "", capacity: int = NO_CAPACITY_LIMIT,
                 client_factory: Callable[[], Any] | None = None) -> None:
        # capacity bounds what this process's policy tracks; by default none: the server's maxmemory decides
        super().__init__(name, capacity)
        self._init_link(url, password, timeout, password_env, client_factory)
        self.location = redact(url)
        self.prefix = prefix
        self.ttl_ms = int(ttl * 1000) if ttl > 0 else None
        self.codec = codec if codec is not None else TierCodec()
        self._index: dict[bytes, _Entry] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._registry: tuple[float, dict[str, int]] | None = None   # (monotonic time read, namespaces)

    @classmethod
    def from_settings(cls, settings, environ: dict | None = None) -> "RedisTier":
        import os

        environ = os.environ if environ is None else environ
        password = environ.get(settings.l3_password_env) if settings.l3_password_env else None
        if settings.l3_password_env and not password:
            log.warning("KVB_L3_PASSWORD_ENV names %s, which is not set: connecting to L3 without a password",
                        settings.l3_password_env)
        codec = TierCodec.named(settings.l3_serde, settings.zstd_level, setting="KVB_L3_SERDE")
        return cls(settings.l3_url, password=password, prefix=settings.l3_prefix, timeout=settings.l3_timeout,
                   ttl=settings.l3_ttl, codec=codec, password_env=settings.l3_password_env)

    # -- keys ------------------------------------------------------------------------------------
    def redis_key(self, key: bytes) -> bytes:
        return f"{self.prefix}:obj:{key.hex()}".encode("ascii")

    def key_pattern(self) -> str:
        return f"{self.prefix}:obj:*"

    def registry_key(self) -> bytes:
        """The hash of namespaces -> bytes written under them (see the module doc)."""
        return f"{self.prefix}:namespaces".encode("ascii")

    # -- index -----------------------------------------------------------------------------------
    def _set(self, key: bytes, size: int, meta: ObjectMeta) -> None:
        with self._lock:
            old = self._index.get(key)
            self._bytes += size - (old.size if old else 0)
            self._index[key] = _Entry(size, meta, time.time())

    def _forget(self, key: bytes) -> None:
        with self._lock:
            old = self._index.pop(key, None)
            if old:
                self._bytes -= old.size

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def meta(self, key: bytes) -> ObjectMeta | None:
        with self._lock:
            entry = self._index.get(key)
        return entry.meta if entry else None

    def size(self, key: bytes) -> int | None:
        with self._lock:
            entry = self._index.get(key)
        return entry.size if entry else None

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    def entries(self) -> list[tuple[bytes, int, float]]:
        """What this process knows of (empty at start: the server is never listed, objects are found by lookup)."""
        with self._lock:
            return [(key, entry.size, entry.last_used) for key, entry in self._index.items()]

    # -- reading ---------------------------------------------------------------------------------
    def get(self, key: bytes) -> tuple[Any, ObjectMeta] | None:
        if not self.contains(key):
            return None
        found = self.get_many([key])[0]
        if isinstance(found, StoreFault):
            raise found
        return found

    def get_many(self, keys: Sequence[bytes]) -> list[tuple[Any, ObjectMeta] | StoreFault | None]:
        """Each object, or the StoreFault reading it raised; one round trip (per master in a cluster)."""
        if not keys:
            return []

        def fetch(client):
            pipe = self._pipeline(client)
            for key in keys:
                pipe.get(self.redis_key(key))
            return pipe.execute(raise_on_error=False)

        try:
            values = self._call("get", fetch)
        except StoreFault as fault:
            return [fault for _ in keys]
        return [self._decode_value(key, value) for key, value in zip(keys, values)]

    def _decode_value(self, key: bytes, value: Any) -> tuple[Any, ObjectMeta] | StoreFault:
        if isinstance(value, Exception):
            return L3Refused(f"L3 get: {value}")
        if value is None:
            self._forget(key)
            return ObjectVanished(f"{self.redis_key(key).decode()} is gone (evicted, expired or removed)")
        try:
            stored, meta = decode_object(value, key, VALUE_MAGIC)
            blob = TierCodec.decode(stored, meta)
        except CorruptObject as fault:
            return self._drop_bad(key, fault)
        with self._lock:
            entry = self._index.get(key)
            if entry is not None:
                entry.last_used = time.time()
        if self.size(key) != len(stored):
            self._set(key, len(stored), meta)
        return blob, meta

    def _drop_bad(self, key: bytes, fault: CorruptObject, found_by_lookup: bool = False) -> CorruptObject:
        """Delete a value that failed a check (a get's fault is counted by the store, a lookup's here)."""
        if isinstance(fault, UnsupportedVersion) and fault.newer:
            self._forget(key)
            return fault    # a newer KVBridge's object: it can still use it
        self.corrupt_found += found_by_lookup
        log.warning("L3: dropping bad object %s: %s", self.redis_key(key).decode(), fault)
        self.remove(key)
        return fault

    def discover(self, key: bytes) -> int | None:
        return self.discover_many([key])[0]

    def discover_many(self, keys: Sequence[bytes]) -> list[int | None]:
        """Index whichever of these objects the server holds (another host may have stored them); sizes or None."""
        with self._lock:
            unknown = [key for key in keys if key not in self._index]
        if unknown:
            try:
                self._probe(unknown)
            except StoreFault as fault:
                log.debug("L3 lookup skipped: %s", fault)
        return [self.size(key) for key in keys]

    def _probe(self, keys: list[bytes]) -> None:
        def heads(client):
            pipe = self._pipeline(client)
            for key in keys:
                name = self.redis_key(key)
                pipe.strlen(name)
                pipe.getrange(name, 0, HEAD_PROBE_BYTES - 1)
            return pipe.execute(raise_on_error=False)

        replies = self._call("lookup", heads)
        for at, key in enumerate(keys):
            total, head = replies[2 * at], replies[2 * at + 1]
            if isinstance(total, Exception) or isinstance(head, Exception) or not total:
                continue
            try:
                header = self._header(key, head, total)
            except CorruptObject as fault:
                self._drop_bad(key, fault, found_by_lookup=True)
                continue
            except StoreFault:
                continue
            if header is not None:
                self._set(key, header.payload_len, header.meta)

    def _header(self, key: bytes, head: bytes, total: int) -> Header | None:
        needed = header_length(head[:FIXED_BYTES], VALUE_MAGIC)
        if needed > len(head):   # metadata longer than the probe: read the rest of the header
            head = self._call("lookup", lambda client: client.getrange(self.redis_key(key), 0, needed - 1))
        header = parse_header(head, total, VALUE_MAGIC)
        if header.key != key:
            raise CorruptObject("the value holds another key")
        return header

    # -- writing ---------------------------------------------------------------------------------
    def put(self, key: bytes, blob: Any, meta: ObjectMeta) -> bool:
        try:
            stored, meta = self.codec.encode(blob, meta)
            value = b"".join((encode_header(key, meta, stored, VALUE_MAGIC), stored))
        except UnstorableObject as fault:
            log.warning("L3: object not stored: %s", fault)
            return False
        size = memoryview(stored).nbytes

        def write(client):
            pipe = self._pipeline(client)   # one round trip: the object and its namespace's registry entry
            pipe.set(self.redis_key(key), value, px=self.ttl_ms)
            pipe.hincrby(self.registry_key(), meta.namespace, size)
            if self.ttl_ms:
                pipe.pexpire(self.registry_key(), self.ttl_ms)
            return pipe.execute()

        try:
            self._call("put", write)
        except StoreFault as fault:
            log.debug("L3: object not stored: %s", fault)
            return False
        self._set(key, size, meta)
        return True

    def remove(self, key: bytes) -> None:
        self._forget(key)
        try:
            self._call("remove", lambda client: client.delete(self.redis_key(key)))
        except StoreFault as fault:
            log.debug("L3: %s not removed: %s", key.hex()[:16], fault)

    def clear(self, keep: Collection[bytes] = ()) -> None:
        """Delete every KVBridge object under the prefix (every host's), except `keep`; StoreFault when unreachable."""
        keep_names = {self.redis_key(key) for key in keep}

        def delete_all(client):
            removed = 0
            batch: list[bytes] = []
            for name in client.scan_iter(match=self.key_pattern(), count=1000):
                if name not in keep_names:
                    batch.append(name)
                if len(batch) >= 500:
                    removed += self._delete(client, batch)
                    batch = []
            return removed + self._delete(client, batch)

        removed = self._call("clear", delete_all)
        if not keep:   # every object is gone, so no namespace is held any more
            self._call("clear", lambda client: client.delete(self.registry_key()))
            self._registry = None
        with self._lock:
            self._index = {key: entry for key, entry in self._index.items() if key in keep}
            self._bytes = sum(entry.size for entry in self._index.values())
        log.info("L3: removed %d objects under %s:", removed, self.prefix)

    def _delete(self, client: Any, names: list[bytes]) -> int:
        if not names:
            return 0
        pipe = self._pipeline(client)   # one DEL per key: a cluster refuses multi-key DEL across slots
        for name in names:
            pipe.delete(name)
        return sum(n for n in pipe.execute(raise_on_error=False) if isinstance(n, int))

    def namespaces_stored(self) -> dict[str, int]:
        """{namespace: bytes}: what this process knows of, and the registry on the server (bytes written
        under each namespace by every host); read at most once per REGISTRY_TTL_S, skipped while down."""
        held = self.bytes_by_namespace()
        now = time.monotonic()
        if self._registry is None or now - self._registry[0] >= REGISTRY_TTL_S:
            try:
                raw = self._call("namespaces", lambda client: client.hgetall(self.registry_key()))
                self._registry = (now, {_text(name): int(n) for name, n in (raw or {}).items()})
            except (StoreFault, ValueError) as fault:
                log.debug("L3 namespace registry not read: %s", fault)
                return held
        for namespace, size in self._registry[1].items():
            held[namespace] = max(held.get(namespace, 0), size)
        return held

    # -- state -----------------------------------------------------------------------------------
    def health(self) -> dict:
        """What the GUI and stats show without a network call: reachable or down, and the fault counters."""
        return {
            "state": "down" if self._breaker.is_down else "up",
            "reason": self._breaker.reason,
            "retry_in_s": round(self._breaker.retry_in(), 1),
            "url": self.location,
            "prefix": self.prefix,
            "codec": self.codec.label(),
            "ttl_s": (self.ttl_ms or 0) / 1000,
            "cluster": self.cluster,
            **{name: self.counts[name] for name in ("skipped_down", "timeouts", "connection_errors",
                                                     "auth_errors", "writes_refused", "server_errors")},
        }

    def census(self) -> dict:
        """Objects and bytes under the prefix on the server (all hosts'); a network call, bounded by CENSUS_LIMIT.

        Raises StoreFault when L3 cannot be reached.
        """
        def count(client):
            names = []
            for name in client.scan_iter(match=self.key_pattern(), count=1000):
                names.append(name)
                if len(names) >= CENSUS_LIMIT:
                    break
            total = 0
            for start in range(0, len(names), 1000):
                pipe = self._pipeline(client)
                for name in names[start:start + 1000]:
                    pipe.strlen(name)
                total += sum(n for n in pipe.execute(raise_on_error=False) if isinstance(n, int))
            return {"objects": len(names), "bytes": total, "capped": len(names) >= CENSUS_LIMIT}

        return self._call("census", count)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
