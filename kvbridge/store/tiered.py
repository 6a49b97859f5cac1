"""TieredStore: an ordered list of tiers (L1 RAM, L2 disk, L3 Redis), each paired with an LRU policy.

Flow: the engine hashes a prompt into chunk keys, asks `lookup` how many leading chunks are stored,
`get`s them (an L2 hit is promoted into L1) and restores them; after generating it `put`s the new
chunks. A put goes into the first tier that can hold it and also into every persistent tier
(write-through), so a restart finds it; the engine calls put off the TTFT path, so the disk
write costs no latency a user sees. An L1 eviction demotes the object to L2 unless L2 has it.

Remote tiers (L3) are written behind the request: their copies (a put's write-through, a demotion,
and the L2 copy of an object promoted from L3) go to one background writer with a bounded queue
(KVB_L3_WRITE_QUEUE); a full queue skips the write and counts it (`behind_dropped`). flush() waits
for it. A lookup asks every tier about the hashes no tier here knows in one call per tier
(`discover_many`: one round trip to a remote tier); get_many reads a remote tier's objects in one.
A hit in a slower tier is promoted into every faster one: RAM at once, persistent tiers behind.
An object whose write has not landed yet is read, not missed (tiered_inflight): from the bytes its queued
write holds, or after a bounded wait (KVB_INFLIGHT_WAIT_MS) for another writer's write into shared L2.

A storage fault is a miss, counted in stats() and logged, never an exception: the caller then
recomputes. get/put/lookup/contains/flush raise no storage error at all (a full disk is a skipped
write, a bad file a counted miss); clear() raises StoreFault when the disk cannot even be listed.
Bad arguments are ValueError/TypeError (bugs, not faults).

Modules: tiered (this one: the store, construction and reading), tiered_writing (put, write-behind,
eviction with demotion, pins), tiered_upkeep (clear, flush, close, stats), tiered_history (the
eviction ring's use: probe_miss, recent_evictions), tiered_inflight (reads of writes not landed yet).

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
from dataclasses import replace
from typing import Iterable, Sequence

from kvbridge.settings import Settings, env_name
from kvbridge.errors import BadSettings
from kvbridge.store.behind import BehindWriter
from kvbridge.store.disk import DiskTier
from kvbridge.store.history import MIN_HISTORY, EvictionRing
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
from kvbridge.store.serde.tier import TierCodec
from kvbridge.store.tiered_history import TierHistory
from kvbridge.store.tiered_inflight import TierInflight
from kvbridge.store.tiered_upkeep import TierUpkeep
from kvbridge.store.tiered_writing import Level, TierWrites
from kvbridge.store.tiers import MemoryTier, Tier

log = logging.getLogger(__name__)


class TieredStore(TierWrites, TierUpkeep, TierHistory, TierInflight):
    """Content-addressed objects across tiers. `namespace`, when set, is the one expected by default.

    Construction and reading are here; writing, eviction and pins are TierWrites' (tiered_writing),
    clear, flush, close and stats TierUpkeep's (tiered_upkeep)."""

    shared = False   # tiers of this process (L2 files excepted): an engine restart may empty L1

    def __init__(self, tiers: Sequence[Tier], namespace: str | None = None, write_queue: int = 64,
                 history: EvictionRing | int = MIN_HISTORY, inflight_wait_ms: int = 250) -> None:
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names) or TIER_NONE in names:
            raise ValueError(f"tier names must be unique and not {TIER_NONE!r}: {names}")
        self.namespace = namespace
        # every object leaving a tier (kvbridge.store.history); a cache server hands in its own ring to share
        self.history = history if isinstance(history, EvictionRing) else EvictionRing(history)
        self._namespaces_cache: tuple[float, dict[str, int]] | None = None   # TierHistory.namespaces_held
        self._levels = [Level(tier, LRUPolicy(tier.capacity())) for tier in tiers]
        self._lock = threading.RLock()
        self._counts: Counter[str] = Counter()
        self._hits: Counter[str] = Counter()
        self._evictions: Counter[str] = Counter()
        self._doomed: dict[str, set[bytes]] = {tier.name: set() for tier in tiers}  # cleared while pinned
        self._all_persistent = all(tier.persistent for tier in tiers)
        self._any_remote = any(tier.remote for tier in tiers)
        self._behind = BehindWriter(self._write_behind, write_queue, name="kvbridge-store-behind")
        if inflight_wait_ms < 0:
            raise ValueError(f"inflight_wait_ms must be 0 (off) or more, got {inflight_wait_ms}")
        self.inflight_wait_s = inflight_wait_ms / 1000   # tiered_inflight: 0 turns in-flight reads off
        self._inflight_taken: Counter[str] = Counter()
        for index, level in enumerate(self._levels):
            level.policy.seed(level.tier.entries())
            with self._lock:
                demoted = self._evict_locked(index)  # the capacity may have been lowered since last run
            self._demote_all(index + 1, demoted)

    @classmethod
    def from_settings(cls, settings: Settings, namespace: str | None = None, *, with_l1: bool = True,
                      owner: str = "embedded", history: EvictionRing | None = None) -> "TieredStore":
        """[L1 (KVB_L1_BYTES)] + [L2 (KVB_L2_DIR, KVB_L2_BYTES, KVB_L2_SERDE) when KVB_L2_ENABLED]
        + [L3 (KVB_L3_URL and the other KVB_L3_ settings) when KVB_L3_URL is set]
        + [S3 (KVB_S3_URL, KVB_S3_*; kvbridge.store.s3_tier) when KVB_S3_URL is set, after L3 or before it by
        KVB_S3_ORDER]; the write-behind queue holds KVB_L3_WRITE_QUEUE + KVB_S3_WRITE_QUEUE objects.

        with_l1=False, owner="cache-server": the tiers below the cache server's shared-memory L1.
        An unreachable L3 is not an error here: it is marked down and retried (see redis_tier).

        An unusable KVB_L2_DIR is a BadSettings error, not a silent fallback to L1 only: a user who
        asked for a persistent cache should learn at start that they are not getting one.
        """
        tiers: list[Tier] = [MemoryTier(settings.l1_bytes)] if with_l1 else []
        if settings.l2_enabled:
            try:
                codec = TierCodec.named(settings.l2_serde, settings.zstd_level, setting=env_name("l2_serde"))
                tiers.append(DiskTier(settings.l2_dir, settings.l2_bytes, owner=owner, codec=codec))
            except OSError as exc:
                raise BadSettings(
                    f"{env_name('l2_dir')}={settings.l2_dir!s} cannot be used for the L2 cache: "
                    f"{exc.strerror or exc}. Point {env_name('l2_dir')} at a writable directory, "
                    f"or set {env_name('l2_enabled')}=false to run with L1 only."
                ) from None
        if settings.l3_url:
            from kvbridge.store.redis_tier import RedisTier   # redis-py is loaded only when L3 is used

            tiers.append(RedisTier.from_settings(settings))
        if settings.s3_url:
            from kvbridge.store.s3_tier import S3Tier   # boto3 is loaded only when S3 is used

            at = len(tiers) - 1 if settings.l3_url and settings.s3_order == "before-l3" else len(tiers)
            tiers.insert(at, S3Tier.from_settings(settings))
        write_queue = ((settings.l3_write_queue if settings.l3_url else 0)
                       + (settings.s3_write_queue if settings.s3_url else 0)) or settings.l3_write_queue
        return cls(tiers, namespace=namespace, write_queue=write_queue,
                   history=history if history is not None else settings.eviction_history,
                   inflight_wait_ms=settings.inflight_wait_ms)

    @property
    def tiers(self) -> list[Tier]:
        return [level.tier for level in self._levels]

    @property
    def tier_names(self) -> list[str]:
        """The tiers' names, fastest first: the one source of tier names and order for the engine,
        the GUI and the charts (a new tier, e.g. a remote L3, appears everywhere by being in the list)."""
        return [level.tier.name for level in self._levels]

    @property
    def lossy_codecs(self) -> list[str]:
        """Lossy codecs a tier here writes with (the engine puts them into its namespace)."""
        return sorted({tier.codec.name for tier in self.tiers
                       if getattr(tier, "codec", None) is not None and not tier.codec.lossless})

    def slower(self, tier_a: str, tier_b: str) -> str:
        """The slower of two tier names by the store's order ("none", no tier, counts as the fastest)."""
        order = {name: i for i, name in enumerate(self.tier_names, start=1)}
        return tier_a if order.get(tier_a, 0) >= order.get(tier_b, 0) else tier_b

    # -- reading ---------------------------------------------------------------------------------
    def lookup(self, hashes: Iterable[bytes], namespace: str | None = None, purpose: str = "prompt") -> LookupResult:
        """How many LEADING hashes are stored (in the expected namespace), and in which tier each.

        `purpose` is the cache server's (RemoteStore): the in-process store counts no hit rate of its own.

        Index only, no payload reads: a later get() can still miss (a file removed by another
        process), and the caller treats that as a shorter hit.
        """
        expected = self.namespace if namespace is None else namespace
        keys = [check_key(key) for key in hashes]
        holders = self._holders(keys)
        tiers: list[str] = []
        bound = self._wait_bound()   # one bound for every wait of this lookup (tiered_inflight)
        for key, index in zip(keys, holders):
            if index is None or not self._levels[index].tier.available():
                queued = self._queued_object(key, expected)   # its write still queued behind a request
                if queued is not None:
                    tiers.append(queued.tier)
                    continue
                index = self._await_writer(key, bound) if index is None else None
                if index is None:
                    break   # not stored, or in a remote tier marked down: its objects cannot be read now
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
            queued = self._queued_object(key, expected)
            return self._served_queued(queued) if queued is not None else self._miss()
        level = self._levels[index]
        try:
            found = self._read(level, key)
        finally:
            with self._lock:
                self._unpin_locked(level, key)
        return self._finish_get(index, key, found, expected)

    def _finish_get(self, index: int, key: bytes, found: tuple[bytes, ObjectMeta] | None,
                    expected: str | None) -> StoredObject | None:
        """Count a read of level `index` and promote a hit into the faster levels."""
        if found is None:
            return self._miss()
        level = self._levels[index]
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
        for faster in range(index):
            if self._levels[faster].tier.persistent:   # a disk copy of a remote hit: behind the request
                self._queue_write(faster, key, blob, meta, "promotions")
            elif self._put_into(faster, key, blob, meta):
                self._count("promotions")
        return StoredObject(blob, replace(meta, last_used=time.time()), level.tier.name)

    def get_many(self, keys: list[bytes], namespace: str | None = None) -> list[StoredObject | None]:
        """get() for each key; a remote tier's objects are read in one round trip, including the keys
        no tier here knew (another host's): a restore is one lookup and one read, whatever it holds."""
        keys = [check_key(key) for key in keys]
        expected = self.namespace if namespace is None else namespace
        holders = self._holders(keys, remote=False)   # local tiers (a file another process wrote) only
        queued: dict[int, StoredObject] = {}
        bound = self._wait_bound()
        for at in [at for at, index in enumerate(holders) if index is None]:
            found_queued = self._queued_object(keys[at], expected)
            if found_queued is not None:
                queued[at] = found_queued
            else:
                holders[at] = self._await_writer(keys[at], bound)
        unknown = [at for at, index in enumerate(holders) if index is None and at not in queued]
        with self._lock:
            for at, (key, index) in enumerate(zip(keys, holders)):
                if index is not None and key in self._levels[index].policy:
                    self._levels[index].policy.pin(key)
                elif index is not None:
                    holders[at] = None   # evicted or removed since
        remote = next((index for index, level in enumerate(self._levels)
                       if level.tier.remote and level.tier.available()), None)
        found: dict[int, tuple[bytes, ObjectMeta] | None] = {}
        for index, level in enumerate(self._levels):
            mine = [at for at, holder in enumerate(holders) if holder == index]
            asked = mine + (unknown if index == remote else [])
            if not asked:
                continue
            try:
                if level.tier.remote:
                    results = level.tier.get_many([keys[at] for at in asked])
                    for at, result in zip(asked, results):
                        if at in mine:
                            found[at] = self._read_result(level, keys[at], result)
                        elif isinstance(result, tuple):   # found by reading it: now indexed by the tier
                            with self._lock:
                                if self._sync_locked(level, keys[at]) is not None:
                                    self._counts["discovered"] += 1
                            holders[at], found[at] = index, result
                else:
                    for at in mine:
                        found[at] = self._read(level, keys[at])
            finally:
                with self._lock:
                    for at in mine:
                        self._unpin_locked(level, keys[at])
        return [self._served_queued(queued[at]) if at in queued
                else self._miss() if holder is None else self._finish_get(holder, key, found.get(at), expected)
                for at, (key, holder) in enumerate(zip(keys, holders))]

    def _holders(self, keys: list[bytes], remote: bool = True) -> list[int | None]:
        """For each key the fastest level holding it; keys no level knows are discovered in one call per
        tier (remote tiers too unless remote=False)."""
        with self._lock:
            holders = [next((index for index, level in enumerate(self._levels) if key in level.policy), None)
                       for key in keys]
        for index, level in enumerate(self._levels):
            missing = [at for at, holder in enumerate(holders) if holder is None]
            if not missing:
                break
            if level.tier.remote and not remote:
                continue
            sizes = level.tier.discover_many([keys[at] for at in missing])   # I/O outside the lock
            for at, size in zip(missing, sizes):
                if size is None:
                    continue
                with self._lock:
                    if self._sync_locked(level, keys[at]) is None:
                        continue   # removed again meanwhile
                    self._counts["discovered"] += 1
                holders[at] = index
        return holders

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

    def _read(self, level: Level, key: bytes) -> tuple[bytes, ObjectMeta] | None:
        """tier.get with every storage fault turned into a counted miss."""
        try:
            found = level.tier.get(key)
        except StoreFault as fault:
            found = fault
        return self._read_result(level, key, found)

    def _read_result(self, level: Level, key: bytes,
                     found: tuple[bytes, ObjectMeta] | StoreFault | None) -> tuple[bytes, ObjectMeta] | None:
        """A tier's answer for one key, a fault turned into a counted miss."""
        if isinstance(found, CorruptObject):
            reason = "corrupt"  # the tier logged what was wrong and dropped it
        elif isinstance(found, ObjectVanished) or found is None:
            reason = "vanished"
        elif isinstance(found, StoreFault):
            if level.tier.remote:   # down or slow: the tier counted and logged it once
                reason = "remote_errors"
            else:
                log.warning("%s: read failed for %s: %s", level.tier.name, key.hex()[:16], found)
                reason = "read_errors"
        else:
            return found
        with self._lock:
            self._counts[reason] += 1
            known = level.policy.size_of(key) if reason == "corrupt" else None
            if self._sync_locked(level, key) is None and known is not None:   # dropped by the tier
                self._record_eviction_locked(level, key, None, known, "corrupt",
                                             gone=not self._held_elsewhere(level, key))
        return None

    def _miss(self) -> None:
        self._count("misses")
        return None

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1
