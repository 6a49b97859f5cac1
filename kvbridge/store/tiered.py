"""TieredStore: an ordered list of tiers (L1 RAM, L2 disk, later L3), each paired with an LRU policy.

Flow: the engine hashes a prompt into chunk keys, asks `lookup` how many leading chunks are stored,
`get`s them (an L2 hit is promoted into L1) and restores them; after generating it `put`s the new
chunks. A put goes into the first tier that can hold it and also into every persistent tier
(write-through), so a restart finds it; the engine calls put off the TTFT path, so the disk
write costs no latency a user sees. An L1 eviction demotes the object to L2 unless L2 has it.

A storage fault is a miss, counted in stats() and logged, never an exception: the caller then
recomputes. get/put/lookup/contains/flush raise no storage error at all (a full disk is a skipped
write, a bad file a counted miss); clear() raises StoreFault when the disk cannot even be listed.
Bad arguments are ValueError/TypeError (bugs, not faults).

Thread-safe: one lock guards the policies and counters; payload I/O (disk reads, writes) runs
outside it, protected by pinning so an object being read is never evicted. Each tier is thread-safe
on its own and is the truth about what it holds; after any tier call that may have changed a key
the store copies that key's size from the tier into the policy under its lock (`_sync_locked`), so
the last thread to touch a key leaves policy and tier agreeing, however their calls interleaved.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterable, Iterator, Sequence

from kvbridge.settings import Settings, env_name
from kvbridge.errors import BadSettings
from kvbridge.store.disk import DiskTier
from kvbridge.store.objects import (
    TIER_NONE,
    CorruptObject,
    LookupResult,
    ObjectMeta,
    ObjectVanished,
    StoredObject,
    StoreFault,
    check_key,
)
from kvbridge.store.policy import LRUPolicy
from kvbridge.store.tiers import MemoryTier, Tier

log = logging.getLogger(__name__)


@dataclass
class _Level:
    tier: Tier
    policy: LRUPolicy


class TieredStore:
    """Content-addressed objects across tiers. `namespace`, when set, is the one expected by default."""

    shared = False   # tiers of this process (L2 files excepted): an engine restart may empty L1

    def __init__(self, tiers: Sequence[Tier], namespace: str | None = None) -> None:
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names) or TIER_NONE in names:
            raise ValueError(f"tier names must be unique and not {TIER_NONE!r}: {names}")
        self.namespace = namespace
        self._levels = [_Level(tier, LRUPolicy(tier.capacity())) for tier in tiers]
        self._lock = threading.RLock()
        self._counts: Counter[str] = Counter()
        self._hits: Counter[str] = Counter()
        self._evictions: Counter[str] = Counter()
        self._doomed: dict[str, set[bytes]] = {tier.name: set() for tier in tiers}  # cleared while pinned
        self._all_persistent = all(tier.persistent for tier in tiers)
        for index, level in enumerate(self._levels):
            level.policy.seed(level.tier.entries())
            with self._lock:
                demoted = self._evict_locked(index)  # the capacity may have been lowered since last run
            self._demote_all(index + 1, demoted)

    @classmethod
    def from_settings(cls, settings: Settings, namespace: str | None = None, *, with_l1: bool = True,
                      owner: str = "embedded") -> "TieredStore":
        """[L1 (KVB_L1_BYTES)] + [L2 (KVB_L2_DIR, KVB_L2_BYTES) when KVB_L2_ENABLED].

        with_l1=False, owner="cache-server": the tiers below the cache server's shared-memory L1.

        An unusable KVB_L2_DIR is a BadSettings error, not a silent fallback to L1 only: a user who
        asked for a persistent cache should learn at start that they are not getting one.
        """
        tiers: list[Tier] = [MemoryTier(settings.l1_bytes)] if with_l1 else []
        if settings.l2_enabled:
            try:
                tiers.append(DiskTier(settings.l2_dir, settings.l2_bytes, owner=owner))
            except OSError as exc:
                raise BadSettings(
                    f"{env_name('l2_dir')}={settings.l2_dir!s} cannot be used for the L2 cache: "
                    f"{exc.strerror or exc}. Point {env_name('l2_dir')} at a writable directory, "
                    f"or set {env_name('l2_enabled')}=false to run with L1 only."
                ) from None
        return cls(tiers, namespace=namespace)

    @property
    def tiers(self) -> list[Tier]:
        return [level.tier for level in self._levels]

    @property
    def tier_names(self) -> list[str]:
        """The tiers' names, fastest first: the one source of tier names and order for the engine,
        the GUI and the charts (a new tier, e.g. a remote L3, appears everywhere by being in the list)."""
        return [level.tier.name for level in self._levels]

    def slower(self, tier_a: str, tier_b: str) -> str:
        """The slower of two tier names by the store's order ("none", no tier, counts as the fastest)."""
        order = {name: i for i, name in enumerate(self.tier_names, start=1)}
        return tier_a if order.get(tier_a, 0) >= order.get(tier_b, 0) else tier_b

    # -- reading ---------------------------------------------------------------------------------
    def lookup(self, hashes: Iterable[bytes], namespace: str | None = None) -> LookupResult:
        """How many LEADING hashes are stored (in the expected namespace), and in which tier each.

        Index only, no payload reads: a later get() can still miss (a file removed by another
        process), and the caller treats that as a shorter hit.
        """
        expected = self.namespace if namespace is None else namespace
        tiers: list[str] = []
        for key in hashes:
            key = check_key(key)
            index = self._holder(key, pin=False)
            if index is None:
                break
            meta = self._levels[index].tier.meta(key)
            if meta is None:
                break  # removed between the two calls
            if expected is not None and meta.namespace != expected:
                self._count("foreign")
                break
            tiers.append(self._levels[index].tier.name)
        with self._lock:
            self._counts["lookups"] += 1
        return LookupResult(len(tiers), tiers)

    def contains(self, key: bytes, namespace: str | None = None) -> bool:
        return self.lookup([key], namespace).n_hit == 1

    def get(self, key: bytes, namespace: str | None = None) -> StoredObject | None:
        """The object from the fastest tier holding it, or None (a counted miss)."""
        key = check_key(key)
        expected = self.namespace if namespace is None else namespace
        index = self._holder(key, pin=True)
        if index is None:
            return self._miss()
        level = self._levels[index]
        try:
            found = self._read(level, key)
        finally:
            with self._lock:
                self._unpin_locked(level, key)
        if found is None:
            return self._miss()
        blob, meta = found
        if expected is not None and meta.namespace != expected:
            self._count("foreign")
            return self._miss()
        with self._lock:
            self._hits[level.tier.name] += 1
            self._sync_locked(level, key)  # a hit makes it most recent (and picks up a changed size)
            for other in self._levels[index + 1:]:
                # Recent in the copies below too, so L2 does not evict what L1 keeps serving
                # (L1 would later demote it back with a full rewrite).
                other.policy.on_hit(key)
        if index > 0 and self._put_into(0, key, blob, meta):
            self._count("promotions")
        return StoredObject(blob, replace(meta, last_used=time.time()), level.tier.name)

    def get_many(self, keys: list[bytes], namespace: str | None = None) -> list[StoredObject | None]:
        """get() for each key (a remote store answers these in one round trip)."""
        return [self.get(key, namespace) for key in keys]

    def _holder(self, key: bytes, pin: bool) -> int | None:
        """Index of the fastest level holding key (pinned there if asked), discovering shared files."""
        with self._lock:
            for index, level in enumerate(self._levels):
                if key in level.policy:
                    if pin:
                        level.policy.pin(key)
                    return index
        for index, level in enumerate(self._levels):
            if level.tier.discover(key) is None:  # I/O outside the lock: a header read
                continue
            with self._lock:
                if self._sync_locked(level, key) is None:
                    continue  # removed again meanwhile (a clear, an eviction)
                self._counts["discovered"] += 1
                if pin:
                    level.policy.pin(key)
            return index
        return None

    def _read(self, level: _Level, key: bytes) -> tuple[bytes, ObjectMeta] | None:
        """tier.get with every storage fault turned into a counted miss."""
        try:
            found = level.tier.get(key)
        except CorruptObject:
            found, reason = None, "corrupt"  # the tier logged what was wrong and dropped it
        except ObjectVanished:
            found, reason = None, "vanished"
        except StoreFault as fault:
            log.warning("%s: read failed for %s: %s", level.tier.name, key.hex()[:16], fault)
            found, reason = None, "read_errors"
        else:
            reason = "" if found is not None else "vanished"
        if found is None:
            with self._lock:
                self._counts[reason] += 1
                self._sync_locked(level, key)  # dropped, or replaced meanwhile by a good copy
        return found

    def _miss(self) -> None:
        self._count("misses")
        return None

    # -- writing ---------------------------------------------------------------------------------
    def put(self, key: bytes, blob: bytes, meta: ObjectMeta) -> bool:
        """Store or replace. False when no tier took it (too large, disk full): counted, not raised."""
        key = check_key(key)
        if not isinstance(blob, bytes) and not (isinstance(blob, memoryview) and self._all_persistent):
            blob = bytes(blob)   # a RAM tier keeps what it is given, so it must own it; a disk tier only writes it out
        if not isinstance(meta, ObjectMeta):
            raise TypeError(f"meta must be an ObjectMeta, got {type(meta).__name__}")
        self._count("puts")
        stored = False
        for index, level in enumerate(self._levels):
            if stored and not level.tier.persistent:
                continue  # already in a faster tier; only persistent tiers get a write-through copy
            if self._put_into(index, key, blob, meta):
                stored = True
        if not stored:
            self._count("put_failures")
        return stored

    def put_many(self, items: list[tuple[bytes, bytes, ObjectMeta]]) -> list[bool]:
        """put() for each (key, blob, meta) (a remote store stores them in one round trip)."""
        return [self.put(key, blob, meta) for key, blob, meta in items]

    def _put_into(self, index: int, key: bytes, blob: bytes, meta: ObjectMeta) -> bool:
        level = self._levels[index]
        if not level.policy.fits(len(blob)):
            return False
        if not level.tier.put(key, blob, meta):  # I/O outside the lock
            self._count("write_errors")
            return False
        with self._lock:
            if self._sync_locked(level, key) is None:
                return False  # a concurrent clear() or eviction removed it in the meantime
            self._doomed[level.tier.name].discard(key)  # new content after a clear is wanted
            demoted = self._evict_locked(index)
        self._demote_all(index + 1, demoted)
        return True

    def _evict_locked(self, index: int) -> list[tuple[bytes, bytes, ObjectMeta]]:
        """Evict LRU victims until the level fits; return those the next level should receive."""
        level = self._levels[index]
        below = self._levels[index + 1] if index + 1 < len(self._levels) else None
        demoted = []
        for key in level.policy.victims():
            if below is not None and key not in below.policy:
                # Reads the payload under the lock: free for RAM; a future tier below disk should
                # hand victims out by path instead.
                found = self._read(level, key)
                if found is not None:
                    demoted.append((key, *found))
            level.tier.remove(key)
            if self._sync_locked(level, key) is None:  # else its file would not go (logged): kept
                self._evictions[level.tier.name] += 1
        return demoted

    def _sync_locked(self, level: _Level, key: bytes) -> int | None:
        """Copy the tier's truth about key into the policy (as most recent); its size, None when absent."""
        size = level.tier.size(key)
        if size is None:
            level.policy.on_remove(key)
        else:
            level.policy.on_put(key, size)
        return size

    def _unpin_locked(self, level: _Level, key: bytes) -> None:
        """Release one pin; the last one on an object cleared while pinned deletes it now."""
        level.policy.unpin(key)
        doomed = self._doomed[level.tier.name]
        if key in doomed and not level.policy.is_pinned(key):
            doomed.discard(key)
            level.tier.remove(key)
            self._sync_locked(level, key)

    def _demote_all(self, index: int, demoted: list[tuple[bytes, bytes, ObjectMeta]]) -> None:
        if index >= len(self._levels):
            return
        for key, blob, meta in demoted:
            if self._put_into(index, key, blob, meta):
                self._count("demotions")

    @contextmanager
    def pinned(self, keys: Iterable[bytes]) -> Iterator[None]:
        """Keep these objects from being evicted (from any tier) while the block runs."""
        keys = [check_key(key) for key in keys]
        with self._lock:
            for level in self._levels:
                for key in keys:
                    level.policy.pin(key)
        try:
            yield
        finally:
            with self._lock:
                for level in self._levels:
                    for key in keys:
                        self._unpin_locked(level, key)

    # -- housekeeping ----------------------------------------------------------------------------
    def clear(self, tier_name: str) -> None:
        """Empty one tier ("L1", "L2"); L2 loses every object file in its directory.

        An object pinned at that moment (a restore is reading it) is deleted when its last pin is
        released, not before: the reader that pinned it gets its data, as the pin promised. Until
        then it is still served; stats()["clear_deferred"] counts these. A put of such an object
        after the clear keeps the new copy. Raises StoreFault when the disk cannot be listed.
        """
        level = self._level_named(tier_name)
        with self._lock:
            pinned = {key for key in level.policy.pinned_keys() if level.tier.contains(key)}
            try:
                level.tier.clear(keep=pinned)
            finally:
                present = {key: size for key, size, _ in level.tier.entries()}
                for key in level.policy.keys_oldest_first():
                    if key not in present:
                        level.policy.on_remove(key)
                for key, size in present.items():
                    if key not in level.policy:
                        level.policy.on_put(key, size)
            deferred = pinned & present.keys()
            self._doomed[level.tier.name] |= deferred
            self._counts["clear_deferred"] += len(deferred)

    def flush(self) -> int:
        """Write every object held only in non-persistent tiers to the persistent ones; returns how many."""
        persistent = [index for index, level in enumerate(self._levels) if level.tier.persistent]
        written = 0
        for level in self._levels:
            if level.tier.persistent:
                continue
            for key in level.tier.keys():
                with self._lock:
                    missing = [index for index in persistent if key not in self._levels[index].policy]
                found = self._read(level, key) if missing else None
                if found is None:
                    continue
                for index in missing:
                    written += self._put_into(index, key, *found)
        return written

    def close(self) -> None:
        """Release memory held by the tiers (L1 empties); what is on disk stays. Idempotent."""
        with self._lock:
            for level in self._levels:
                level.tier.close()
                if not level.tier.persistent:
                    level.policy.clear()
                    self._doomed[level.tier.name].clear()

    def stats(self) -> dict:
        """Plain numbers for the GUI and CLI: per tier, then hit/miss/fault counters."""
        with self._lock:
            tiers = {
                level.tier.name: {
                    "objects": len(level.policy),
                    "bytes": level.policy.bytes_used,
                    "capacity": level.policy.capacity,
                    "hits": self._hits[level.tier.name],
                    "evictions": self._evictions[level.tier.name],
                    "location": level.tier.location,
                }
                for level in self._levels
            }
            counts = self._counts
            return {
                "namespace": self.namespace,
                "tiers": tiers,
                "hits": {name: self._hits[name] for name in tiers},
                "misses": counts["misses"],
                "evictions": sum(self._evictions.values()),
                "corrupt": counts["corrupt"] + sum(level.tier.corrupt_found for level in self._levels),
                "temp_files_removed": sum(level.tier.temp_files_removed for level in self._levels),
                "foreign": counts["foreign"],
                "vanished": counts["vanished"],
                "read_errors": counts["read_errors"],
                "puts": counts["puts"],
                "put_failures": counts["put_failures"],
                "write_errors": counts["write_errors"],
                "promotions": counts["promotions"],
                "demotions": counts["demotions"],
                "discovered": counts["discovered"],
                "clear_deferred": counts["clear_deferred"],
                "lookups": counts["lookups"],
            }

    def _level_named(self, tier_name: str) -> _Level:
        for level in self._levels:
            if level.tier.name == tier_name:
                return level
        known = ", ".join(level.tier.name for level in self._levels)
        raise ValueError(f"unknown tier {tier_name!r}; this store has: {known}")

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1
