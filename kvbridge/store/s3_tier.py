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
evicted gets NoSuchKey (a counted vanished miss, and the orphan marker is deleted). The store's own
per-process LRU (capacity() is the budget) evicts what this process knows as for every tier.

Faults (kvbridge.store.s3_link): every call bounded by KVB_S3_TIMEOUT; a dead endpoint is marked down
and skipped while a prober retries. get() raises StoreFault subclasses, put() returns False.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Collection, Sequence

from kvbridge.errors import BadSettings
from kvbridge.store.diskformat import UnsupportedVersion, decode_object, encode_header
from kvbridge.store.objects import CorruptObject, ObjectMeta, ObjectVanished, StoreFault, UnstorableObject
from kvbridge.store.s3_link import S3Link, S3Missing, S3Refused, S3Unavailable
from kvbridge.store.serde.tier import TierCodec
from kvbridge.store.tiers import Tier

log = logging.getLogger(__name__)

OBJECT_MAGIC = b"KVB-S3\r\n"
SKEW_S = 60.0            # a listing re-reads markers this much older than the newest it saw (late writers, clocks)
TOUCH_EVERY_S = 60.0     # a hit rewrites its marker (the durable use time) at most this often per key
UPKEEP_S = 15.0          # the background listing + budget sweep runs this often
LIST_PAGES_MOST = 1000   # one listing reads at most this many pages (1M markers)
FETCH_THREADS = 16       # parallel GETs of one get_many
DELETE_BATCH = 1000      # DeleteObjects takes at most 1,000 names


def namespace_tag(namespace: str) -> str:
    """The namespace's 16-hex-digit handle in marker names (its full text is under ns/<tag>)."""
    return hashlib.blake2b(namespace.encode("utf-8"), digest_size=8).hexdigest()


@dataclass
class _Entry:
    size: int
    meta: ObjectMeta | None       # None until its namespace's text is known
    last_used: float              # seconds (the newest marker's time, or this process's last use)
    markers: list[str]            # every marker name seen for the key (older ones are deleted on a touch)
    touched: float = 0.0          # when this process last wrote its marker


class S3Tier(S3Link, Tier):
    """A Tier on an S3 bucket. Never raises for faults: see the module doc."""

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

    def _marker(self, key: bytes, when: float, size: int, meta: ObjectMeta) -> str:
        return f"{self.prefix}/idx/{int(when * 1000):013d}-{key.hex()}-{size}-{namespace_tag(meta.namespace)}-{meta.n_tokens}"

    def _parse_marker(self, name: str) -> tuple[bytes, float, int, str, int] | None:
        try:
            stamp, key_hex, size, tag, n_tokens = name.rpartition("/")[2].split("-")
            return bytes.fromhex(key_hex), int(stamp) / 1000, int(size), tag, int(n_tokens)
        except ValueError:
            return None

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

    # -- listing ---------------------------------------------------------------------------------
    def refresh(self, wait: bool = True) -> int:
        """List the markers written since the last look (all of them the first time); markers read.

        Callers that queue behind a listing started after they asked take its result instead of listing
        again, so a burst of lookups costs one round trip, and no lookup sees a listing older than itself."""
        asked = time.monotonic()
        if not self._list_lock.acquire(blocking=wait, timeout=(self.timeout * 4) if wait else -1):
            return 0
        try:
            if self._list_started > asked:
                return 0
            return self._list_markers()
        finally:
            self._list_lock.release()

    def _list_markers(self) -> int:
        self._list_started = time.monotonic()
        prefix = f"{self.prefix}/idx/"
        start_after = ""
        if self._cursor:
            parsed = self._parse_marker(self._cursor)
            if parsed is not None:
                start_after = f"{prefix}{max(0, int((parsed[1] - SKEW_S) * 1000)):013d}"
        seen, token = 0, None
        unknown_tags: set[str] = set()
        for _ in range(LIST_PAGES_MOST):
            args = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": 1000}
            if token:
                args["ContinuationToken"] = token
            elif start_after:
                args["StartAfter"] = start_after
            page = self._call("list", lambda client: client.list_objects_v2(**args))
            for item in page.get("Contents", ()):
                name = item["Key"]
                parsed = self._parse_marker(name)
                if parsed is None:
                    continue
                key, when, size, tag, n_tokens = parsed
                seen += 1
                if name > self._cursor:
                    self._cursor = name
                namespace = self._namespaces.get(tag)
                if namespace is None:
                    unknown_tags.add(tag)
                meta = ObjectMeta(namespace, n_tokens, b"", created=when) if namespace is not None else None
                with self._lock:
                    known = self._index.get(key)
                if known is not None and known.meta is not None and known.meta.namespace == namespace:
                    meta = None   # keep the fuller metadata this process already has
                self._set(key, size, meta, when, name)
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                break
        if unknown_tags:
            self._learn_namespaces(unknown_tags)
        return seen

    def _learn_namespaces(self, tags: set[str]) -> None:
        """Read the full text of namespaces first seen in markers, then fill in their entries' metadata."""
        for tag in tags:
            try:
                body = self._call("namespace", lambda client: client.get_object(
                    Bucket=self.bucket, Key=f"{self.prefix}/ns/{tag}")["Body"].read())
                namespace = body.decode("utf-8")
            except (S3Missing, UnicodeDecodeError):
                self.others[tag] = self.others.get(tag, 0) + 1
                continue
            if namespace_tag(namespace) == tag:
                self._namespaces[tag] = namespace
        with self._lock:
            for key, entry in self._index.items():
                if entry.meta is None and entry.markers:
                    parsed = self._parse_marker(entry.markers[-1])
                    if parsed and parsed[3] in self._namespaces:
                        entry.meta = ObjectMeta(self._namespaces[parsed[3]], parsed[4], b"", created=parsed[1])
            self._bytes = sum(e.size for e in self._index.values())

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

    def _touch_later(self, key: bytes, size: int, meta: ObjectMeta, now: float) -> None:
        """Rewrite the key's marker with the time of this hit (at most once per TOUCH_EVERY_S), behind the read."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or now - max(entry.touched, self._newest_marker_time(entry)) < self.touch_every_s:
                return
            entry.touched = now
        self._pool.submit(self._write_marker, key, size, meta, now)

    def _newest_marker_time(self, entry: _Entry) -> float:
        times = [parsed[1] for parsed in map(self._parse_marker, entry.markers) if parsed]
        return max(times, default=0.0)

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

    def _write_namespace(self, namespace: str) -> None:
        tag = namespace_tag(namespace)
        if tag in self._ns_written:
            return
        self._call("put", lambda client: client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/ns/{tag}",
                                                           Body=namespace.encode("utf-8")))
        self._ns_written.add(tag)
        self._namespaces[tag] = namespace

    def _write_marker(self, key: bytes, size: int, meta: ObjectMeta, when: float) -> None:
        """The zero-byte marker with `when` as the key's last use; older markers of the key are deleted."""
        name = self._marker(key, when, size, meta)
        try:
            self._call("mark", lambda client: client.put_object(Bucket=self.bucket, Key=name, Body=b""))
        except StoreFault as fault:
            log.debug("S3: marker not written: %s", fault)
            return
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return            # removed meanwhile: the marker is an orphan the next sweep deletes
            old = [marker for marker in entry.markers if marker != name]
            entry.markers, entry.touched = [name], when
        self._delete_names(old)

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

    def _list_names(self, prefix: str) -> list[str]:
        names, token = [], None
        for _ in range(LIST_PAGES_MOST):
            args = {"Bucket": self.bucket, "Prefix": prefix, "MaxKeys": 1000}
            if token:
                args["ContinuationToken"] = token
            page = self._call("list", lambda client: client.list_objects_v2(**args))
            names += [item["Key"] for item in page.get("Contents", ())]
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                break
        return names

    # -- the budget ------------------------------------------------------------------------------
    def sweep(self) -> int:
        """Delete the least recently used objects (by their newest marker) while everything under the prefix is
        over the budget (capacity()); objects deleted. Every host runs it after its listings (module doc)."""
        with self._lock:
            total = self._bytes
            if total <= self._capacity:
                return 0
            oldest = sorted(self._index.items(), key=lambda item: item[1].last_used)
        doomed = []
        for key, entry in oldest:
            if total <= self._capacity:
                break
            doomed.append(key)
            total -= entry.size
        names = []
        for key in doomed:
            names += [self.s3_key(key), *self._forget(key)]
        self._delete_names(names)
        self.evicted_by_budget += len(doomed)
        if doomed:
            log.info("S3: %d objects over KVB_S3_BYTES=%d deleted (least recently used first)", len(doomed),
                     self._capacity)
        return len(doomed)

    def _upkeep_loop(self) -> None:
        """At start: make sure the bucket exists, then list everything (holding the listing lock from the
        constructor, so a lookup waits for it); then every UPKEEP_S a listing of what is new and a sweep."""
        try:
            self._ensure_bucket()
            self._list_markers()
        except StoreFault as fault:
            log.warning("S3: the first listing of %s failed: %s", self.location, fault)
        finally:
            self._list_lock.release()
        try:
            self.sweep()
        except StoreFault as fault:
            log.debug("S3: sweep skipped: %s", fault)
        while not self._stop.wait(UPKEEP_S):
            try:
                self.refresh()
                self.sweep()
            except StoreFault as fault:
                log.debug("S3: upkeep skipped: %s", fault)

    def _ensure_bucket(self) -> None:
        try:
            self._call("bucket", lambda client: client.head_bucket(Bucket=self.bucket))
            return
        except S3Missing:
            pass
        except S3Refused as fault:
            if "does not exist" not in str(fault):
                raise
        try:
            where = {} if self.region == "us-east-1" else {
                "CreateBucketConfiguration": {"LocationConstraint": self.region}}
            self._call("bucket", lambda client: client.create_bucket(Bucket=self.bucket, **where))
            log.info("S3: created bucket %s (KVB_S3_BUCKET) at %s", self.bucket, self.url)
        except StoreFault as fault:
            message = (f"bucket {self.bucket!r} (KVB_S3_BUCKET) does not exist at {self.url} and could not be "
                       f"created ({fault}); create it, or name an existing one in KVB_S3_BUCKET")
            self._breaker.failed(message)
            raise S3Unavailable(message) from None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the first listing (tests and benches); True when it finished."""
        bound = timeout if timeout is not None else self.timeout * 4
        if self._list_lock.acquire(timeout=bound):
            self._list_lock.release()
            return True
        return False

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
