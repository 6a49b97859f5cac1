"""The S3 tier's markers: what is in the bucket and when each object was last used, from one listing.

Place in the flow: S3Tier.lookup -> **discover_many -> refresh()** -> one ListObjectsV2 of `<prefix>/idx/`
-> the tier's index; S3Tier.get -> a hit -> **_touch_later** (a new marker, behind the read); the upkeep
thread -> refresh() + **sweep()** (the budget). The layout and why are in kvbridge.store.s3_tier's doc;
this mixin holds the marker names, the listing, the namespace texts and the budget's sweep. It uses the
tier's index (_index, _lock, _set, _forget), its deletes and its link (_call).
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

from kvbridge.store.objects import ObjectMeta, StoreFault
from kvbridge.store.s3_link import S3Missing, S3Refused, S3Unavailable

log = logging.getLogger("kvbridge.store.s3_tier")

SKEW_S = 60.0            # a listing re-reads markers this much older than the newest it saw (late writers, clocks)
TOUCH_EVERY_S = 60.0     # a hit rewrites its marker (the durable use time) at most this often per key
UPKEEP_S = 15.0          # the background listing + budget sweep runs this often
LIST_PAGES_MOST = 1000   # one listing reads at most this many pages (1M markers)


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


class S3Markers:
    """The marker half of S3Tier (a mixin): marker names, listings, namespace texts, use times, the budget."""

    def _marker(self, key: bytes, when: float, size: int, meta: ObjectMeta) -> str:
        return f"{self.prefix}/idx/{int(when * 1000):013d}-{key.hex()}-{size}-{namespace_tag(meta.namespace)}-{meta.n_tokens}"

    def _parse_marker(self, name: str) -> tuple[bytes, float, int, str, int] | None:
        try:
            stamp, key_hex, size, tag, n_tokens = name.rpartition("/")[2].split("-")
            return bytes.fromhex(key_hex), int(stamp) / 1000, int(size), tag, int(n_tokens)
        except ValueError:
            return None

    # -- listing ---------------------------------------------------------------------------------
    def refresh(self, wait: bool = True, full: bool = False) -> int:
        """List the markers written since the last look (all of them when `full`); markers read.

        Callers that queue behind a listing started after they asked take its result instead of listing
        again, so a burst of lookups costs one round trip, and no lookup sees a listing older than itself.
        A full listing (the upkeep's) also forgets what other hosts deleted since, so the budget's sweep
        counts only what is there."""
        asked = time.monotonic()
        if not self._list_lock.acquire(blocking=wait, timeout=(self.timeout * 4) if wait else -1):
            return 0
        try:
            if self._list_started > asked and not full:
                return 0
            return self._list_markers(full)
        finally:
            self._list_lock.release()

    def _list_markers(self, full: bool = True) -> int:
        self._list_started = time.monotonic()
        started_wall = time.time()
        prefix = f"{self.prefix}/idx/"
        start_after = ""
        if self._cursor and not full:
            parsed = self._parse_marker(self._cursor)
            if parsed is not None:
                start_after = f"{prefix}{max(0, int((parsed[1] - SKEW_S) * 1000)):013d}"
        seen, token, complete = 0, None, False
        seen_keys: set[bytes] = set()
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
                seen_keys.add(key)
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
                complete = True
                break
        if full and complete:   # gone since: deleted by another host (used before this listing began)
            with self._lock:
                gone = [key for key, entry in self._index.items()
                        if key not in seen_keys and entry.last_used < started_wall]
            for key in gone:
                self._forget(key)
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

    def _touch_later(self, key: bytes, size: int, meta: ObjectMeta, now: float) -> None:
        """Rewrite the key's marker with the time of this hit (at most once per TOUCH_EVERY_S), behind the read."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or now - max(entry.touched, self._newest_marker_time(entry)) < self.touch_every_s:
                return
            entry.touched = now
        try:
            self._pool.submit(self._write_marker, key, size, meta, now)
        except RuntimeError:   # the tier is closing: this use time is not recorded, nothing else is lost
            pass

    def _newest_marker_time(self, entry: _Entry) -> float:
        times = [parsed[1] for parsed in map(self._parse_marker, entry.markers) if parsed]
        return max(times, default=0.0)

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
                self.refresh(full=True)
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
            self._trip("server_errors", message)     # down, named by setting; the prober tries again
            raise S3Unavailable(message) from None

    def census(self) -> dict:
        """Objects and bytes under the prefix (every host's), from a listing of the new markers; StoreFault when
        S3 cannot be reached. For the GUI's store panel, as L3's census()."""
        self.refresh()
        with self._lock:
            return {"objects": len(self._index), "bytes": self._bytes, "capped": False}

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the first listing (tests and benches); True when it finished."""
        bound = timeout if timeout is not None else self.timeout * 4
        if self._list_lock.acquire(timeout=bound):
            self._list_lock.release()
            return True
        return False
