"""S3: objects in an S3 bucket (SeaweedFS, AWS S3, R2, MinIO, Garage, Ceph RGW), shared by every host naming it.

    KVB_S3_URL=http://127.0.0.1:8333  KVB_S3_BUCKET=kvbridge  KVB_S3_PREFIX=kvb  KVB_S3_BYTES=64GiB

Layout, under `<prefix>/` in the bucket:

    obj/<key hex>                                   the object: the checked header of an L2 file (magic
                                                    b"KVB-S3\\r\\n", version, key, metadata, blake3), then the
                                                    payload as the KVB_S3_SERDE codec made it; one PUT, so a
                                                    reader sees a whole old object, a whole new one or none
    idx/<13-digit ms>-<key hex>-<size>-<ns>-<n>     a zero-byte marker beside each object: when it was last
                                                    written or used, its payload size, its namespace's short
                                                    hash and token count
    ns/<ns>                                         the namespace's full text (written once per namespace)

Lookups. Never a HEAD per chunk: one ListObjectsV2 of `idx/` (StartAfter = the newest marker seen minus
SKEW_S, for writers whose clocks lag or whose marker landed late) tells this process every object written
or used since its last look, with sizes, namespaces and last-use times, one round trip per 1,000 markers.
A fresh process lists once at start (in the background; a lookup meanwhile waits for it) and so finds
everything there with nothing in memory. A lookup of keys nobody here knows lists again (lookups queued
behind a listing that started after they asked share it). A namespace first seen in a marker costs one GET
of its ns/ text, once per process. The marker's metadata is a hint: a get reads the object's own checked
header and the store checks its namespace again.

Use times and eviction. A hit rewrites the key's marker with the current time (at most once per
TOUCH_EVERY_S per key, behind the read) and deletes the old one: the durable last-use time. The budget
KVB_S3_BYTES covers everything under the prefix. How hosts agree: there is no coordinator; every host
sees the same markers, orders objects by their newest marker, and when the total is over the budget
(checked after each listing by the upkeep thread) deletes the least recently used objects and their
markers until it is under. Deletes are idempotent, so two hosts sweeping at once delete the same
objects; a host that saw a few more recent writes deletes a few more (at most what was written between
their listings). A race costs a miss, never wrong data: a host reading an object another host just
evicted gets NoSuchKey (a counted vanished miss, and the orphan marker is deleted); a marker another host
wrote for an object this host deletes meanwhile counts in the budget until a read or a sweep deletes it
(over-counting costs an early eviction, never a wrong answer). The store's own
per-process LRU (capacity() is the budget) evicts what this process knows as for every tier.

Faults (kvbridge.store.s3_link): every call bounded by KVB_S3_TIMEOUT; a dead endpoint is marked down
and skipped while a prober retries. get() raises StoreFault subclasses, put() returns False.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Collection, Sequence

from kvbridge.errors import BadSettings
from kvbridge.store.diskformat import UnsupportedVersion, decode_object, encode_header
from kvbridge.store.objects import CorruptObject, ObjectMeta, ObjectVanished, StoreFault, UnstorableObject
from kvbridge.store.s3_link import S3Link, S3Missing
from kvbridge.store.s3_markers import TOUCH_EVERY_S, S3Markers, _Entry
from kvbridge.store.serde.tier import TierCodec
from kvbridge.store.tiers import Tier

log = logging.getLogger(__name__)

OBJECT_MAGIC = b"KVB-S3\r\n"
FETCH_THREADS = 16       # parallel GETs of one get_many
DELETE_BATCH = 1000      # DeleteObjects takes at most 1,000 names


class S3Tier(S3Markers, S3Link, Tier):
    """A Tier on an S3 bucket. Never raises for faults: see the module doc.

    The object format, the index and reads and writes are here; the markers, listings and the budget are
    S3Markers' (kvbridge.store.s3_markers), the client and the breaker S3Link's (kvbridge.store.s3_link)."""

    persistent = True   # outlives every process
    remote = True       # shared by hosts, slower than disk: the store writes it behind the request

    def __init__(self, url: str, bucket: str, *, access_key: str, secret_key: str, prefix: str = "kvb",
                 region: str = "us-east-1", capacity: int = 64 << 30, timeout: float = 5.0,
                 codec: TierCodec | None = None, name: str = "S3",
                 key_envs: tuple[str, str] = ("", ""), start: bool = True,
                 touch_every_s: float = TOUCH_EVERY_S) -> None:
        super().__init__(name, capacity)
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._init_link(url, region, access_key, secret_key, timeout, key_envs)
        self.location = f"{url}/{bucket}/{self.prefix}/"
        self.codec = codec if codec is not None else TierCodec()
        self._index: dict[bytes, _Entry] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._list_lock = threading.Lock()       # one listing at a time; a lookup meanwhile waits for it
        self._cursor = ""                        # the newest marker name seen
        self._list_started = 0.0
        self._namespaces: dict[str, str] = {}    # tag -> namespace text
        self._ns_written: set[str] = set()
        self.others: dict[str, int] = {}         # markers whose namespace text is missing: tag -> count
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix=f"kvbridge-{name}-fetch")
        self._stop = threading.Event()
        self._upkeep: threading.Thread | None = None
        self.evicted_by_budget = 0
        self.touch_every_s = touch_every_s
        if start:
            self._upkeep = threading.Thread(target=self._upkeep_loop, name=f"kvbridge-{name}-upkeep", daemon=True)
            self._list_lock.acquire()            # the first listing holds it from now: lookups wait for it
            self._upkeep.start()

    @classmethod
    def from_settings(cls, settings, environ: dict | None = None) -> "S3Tier":
        """The tier KVB_S3_* describe; BadSettings when a key variable they name is not set."""
        environ = os.environ if environ is None else environ
        keys = []
        for setting, var in (("KVB_S3_ACCESS_KEY_ENV", settings.s3_access_key_env),
                             ("KVB_S3_SECRET_KEY_ENV", settings.s3_secret_key_env)):
            if not var or not environ.get(var):
                raise BadSettings(f"{setting} names {var or 'no variable'}, which is not set: export the key in that "
                                  f"variable (KVBridge never falls back to a default credential chain)")
            keys.append(environ[var])
        codec = TierCodec.named(settings.s3_serde, settings.zstd_level, setting="KVB_S3_SERDE")
        return cls(settings.s3_url, settings.s3_bucket, access_key=keys[0], secret_key=keys[1],
                   prefix=settings.s3_prefix, region=settings.s3_region, capacity=settings.s3_bytes,
                   timeout=settings.s3_timeout, codec=codec,
                   key_envs=(settings.s3_access_key_env, settings.s3_secret_key_env))

    # -- names -----------------------------------------------------------------------------------
    def s3_key(self, key: bytes) -> str:
        return f"{self.prefix}/obj/{key.hex()}"

    # -- index -----------------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        with self._lock:
            entry = self._index.get(key)
            return entry is not None and entry.meta is not None

    def meta(self, key: bytes) -> ObjectMeta | None:
        with self._lock:
            entry = self._index.get(key)
        return entry.meta if entry else None

    def size(self, key: bytes) -> int | None:
        with self._lock:
            entry = self._index.get(key)
        return entry.size if entry and entry.meta is not None else None

    def keys(self) -> list[bytes]:
        with self._lock:
            return [key for key, entry in self._index.items() if entry.meta is not None]

    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    def entries(self) -> list[tuple[bytes, int, float]]:
        with self._lock:
            return [(key, e.size, e.last_used) for key, e in self._index.items() if e.meta is not None]

    def _set(self, key: bytes, size: int, meta: ObjectMeta | None, last_used: float, marker: str | None) -> None:
        with self._lock:
            old = self._index.get(key)
            self._bytes += size - (old.size if old else 0)
            markers = (old.markers if old else []) + ([marker] if marker and (not old or marker not in old.markers) else [])
            entry = _Entry(size, meta if meta is not None else (old.meta if old else None),
                           max(last_used, old.last_used if old else 0.0), markers, old.touched if old else 0.0)
            self._index[key] = entry

    def _forget(self, key: bytes) -> list[str]:
        with self._lock:
            old = self._index.pop(key, None)
            if old:
                self._bytes -= old.size
            return old.markers if old else []

    def discover(self, key: bytes) -> int | None:
        return self.discover_many([key])[0]

    def discover_many(self, keys: Sequence[bytes]) -> list[int | None]:
        """Sizes of these objects; keys nobody here knows are looked for in one listing of new markers."""
        with self._lock:
            unknown = any(key not in self._index for key in keys)
        if unknown:
            try:
                self.refresh()
            except StoreFault as fault:
                log.debug("S3 lookup skipped: %s", fault)
        return [self.size(key) for key in keys]

    # -- reading ---------------------------------------------------------------------------------
    def get(self, key: bytes) -> tuple[Any, ObjectMeta] | None:
        if not self.contains(key):
            return None
        found = self.get_many([key])[0]
        if isinstance(found, StoreFault):
            raise found
        return found

    def get_many(self, keys: Sequence[bytes]) -> list[tuple[Any, ObjectMeta] | StoreFault | None]:
        """Each object (GETs in parallel), None for keys no marker names, or the StoreFault reading it raised."""
        if not keys:
            return []
        if not all(self.contains(key) for key in keys):
            self.discover_many(keys)
        asked = [key for key in keys if self.contains(key)]
        if asked:
            self._sent_here.n = self.calls_on_this_thread() + 1   # parallel: one round trip's time
        results = dict(zip(asked, self._pool.map(self._fetch, asked)))
        return [results.get(key) for key in keys]

    def _fetch(self, key: bytes) -> tuple[Any, ObjectMeta] | StoreFault:
        try:
            value = self._call("get", lambda client: client.get_object(Bucket=self.bucket, Key=self.s3_key(key))
                               ["Body"].read(), count=False)
        except S3Missing:
            self._delete_names(self._forget(key))     # its marker outlived it (another host's eviction)
            return ObjectVanished(f"{self.s3_key(key)} is gone (evicted or removed by another host)")
        except StoreFault as fault:
            return fault
        try:
            stored, meta = decode_object(value, key, OBJECT_MAGIC)
            blob = TierCodec.decode(stored, meta)
        except CorruptObject as fault:
            if isinstance(fault, UnsupportedVersion) and fault.newer:
                return fault      # a newer KVBridge's object: it can still use it
            log.warning("S3: dropping bad object %s: %s", self.s3_key(key), fault)
            self.remove(key)
            return fault
        now = time.time()
        self._set(key, len(stored), meta, now, None)
        self._touch_later(key, len(stored), meta, now)
        return blob, meta

    # -- writing ---------------------------------------------------------------------------------
    def put(self, key: bytes, blob: Any, meta: ObjectMeta) -> bool:
        try:
            stored, meta = self.codec.encode(blob, meta)
            value = b"".join((encode_header(key, meta, stored, OBJECT_MAGIC), stored))
        except UnstorableObject as fault:
            log.warning("S3: object not stored: %s", fault)
            return False
        size = memoryview(stored).nbytes
        try:
            self._write_namespace(meta.namespace)
            self._call("put", lambda client: client.put_object(Bucket=self.bucket, Key=self.s3_key(key), Body=value))
        except StoreFault as fault:
            log.debug("S3: object not stored: %s", fault)
            return False
        now = time.time()
        self._set(key, size, meta, now, None)
        self._write_marker(key, size, meta, now)
        return True

    def remove(self, key: bytes) -> None:
        markers = self._forget(key)
        self._delete_names([self.s3_key(key), *markers])

    def _delete_names(self, names: list[str]) -> int:
        """DeleteObjects in batches (idempotent: a name already gone is no error); names deleted."""
        deleted = 0
        for start in range(0, len(names), DELETE_BATCH):
            batch = [{"Key": name} for name in names[start:start + DELETE_BATCH]]
            try:
                self._call("delete", lambda client: client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}))
                deleted += len(batch)
            except StoreFault as fault:
                log.debug("S3: %d names not deleted: %s", len(batch), fault)
        return deleted

    def clear(self, keep: Collection[bytes] = ()) -> None:
        """Delete every KVBridge object under the prefix (every host's), except `keep`; StoreFault when unreachable."""
        kept_hex = {key.hex() for key in keep}
        names = []
        for part in ("obj/", "idx/") + (("ns/",) if not keep else ()):
            for name in self._list_names(f"{self.prefix}/{part}"):
                tail = name.rpartition("/")[2]
                key_hex = tail if part == "obj/" else tail.split("-")[1] if part == "idx/" and tail.count("-") == 4 else ""
                if key_hex not in kept_hex:
                    names.append(name)
        self._delete_names(names)
        with self._lock:
            self._index = {key: entry for key, entry in self._index.items() if key in keep}
            self._bytes = sum(entry.size for entry in self._index.values())
        if not keep:
            self._ns_written.clear()
        log.info("S3: removed %d names under %s/", len(names), self.prefix)

    # -- state -----------------------------------------------------------------------------------
    def namespaces_stored(self) -> dict[str, int]:
        return self.bytes_by_namespace()

    def health(self) -> dict:
        """What the GUI and stats show without a network call."""
        return {
            "state": "down" if self._breaker.is_down else "up",
            "reason": self._breaker.reason,
            "retry_in_s": round(self._breaker.retry_in(), 1),
            "url": self.url, "bucket": self.bucket, "prefix": self.prefix, "codec": self.codec.label(),
            "objects_under": f"{self.bucket}/{self.prefix}/obj/",    # the GUI's store panel says where
            "evicted_by_budget": self.evicted_by_budget,
            **{name: self.counts[name] for name in ("skipped_down", "timeouts", "connection_errors",
                                                     "auth_errors", "server_errors")},
        }

    def close(self) -> None:
        self._stop.set()
        self.close_link()
        if self._upkeep is not None and self._upkeep is not threading.current_thread():
            self._upkeep.join(timeout=self.timeout * 2 + 1)
        self._pool.shutdown(wait=True, cancel_futures=True)
