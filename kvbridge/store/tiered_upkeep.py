"""TieredStore's upkeep: clear a tier, flush to the persistent tiers, drain and close, and the stats.

Place in the flow: beside it, not in it. The GUI, the CLI and serve's /metrics call these between
requests: `clear` (one tier, pinned objects deferred until their last pin goes), `flush` (objects
held only in RAM written to the persistent tiers), `drain`/`close` (the write-behind queue), `stats`
and `bytes_by_namespace` (plain numbers). TierUpkeep is a part of TieredStore (kvbridge.store.tiered),
whose constructor sets the state declared below.
"""
from __future__ import annotations

import threading
from collections import Counter

from kvbridge.store.behind import BehindWriter
from kvbridge.store.history import EvictionRing
from kvbridge.store.tiered_writing import Level


class TierUpkeep:
    """Housekeeping and numbers of the whole store (a part of TieredStore)."""

    namespace: str | None
    _levels: list[Level]
    _lock: threading.RLock
    _counts: Counter[str]
    _hits: Counter[str]
    _evictions: Counter[str]
    _doomed: dict[str, set[bytes]]
    _behind: BehindWriter
    history: EvictionRing

    # -- housekeeping ----------------------------------------------------------------------------
    def clear(self, tier_name: str) -> None:
        """Empty one tier ("L1", "L2", "L3"); L2 loses every object file in its directory, L3 every
        KVBridge key under its prefix on the server (every host's).

        An object pinned at that moment (a restore is reading it) is deleted when its last pin is
        released, not before: the reader that pinned it gets its data, as the pin promised. Until
        then it is still served; stats()["clear_deferred"] counts these. A put of such an object
        after the clear keeps the new copy. Raises StoreFault when the disk cannot be listed.
        """
        level = self._level_named(tier_name)
        if level.tier.remote:
            # The network part runs outside the lock, so a slow or dead L3 holds no other store call
            # (the tier bounds it by its own timeout; an unreachable L3 raises StoreFault at once).
            with self._lock:
                pinned = {key for key in level.policy.pinned_keys() if level.tier.contains(key)}
                before = self._known_locked(level)
            try:
                level.tier.clear(keep=pinned)
            finally:
                with self._lock:
                    self._resync_after_clear_locked(level, pinned, before)
            return
        with self._lock:
            pinned = {key for key in level.policy.pinned_keys() if level.tier.contains(key)}
            before = self._known_locked(level)
            try:
                level.tier.clear(keep=pinned)
            finally:
                self._resync_after_clear_locked(level, pinned, before)

    def _known_locked(self, level: Level) -> dict:
        """{key: (meta, size)} of what the level holds, so a clear can name each object it dropped."""
        return {key: (level.tier.meta(key), level.policy.size_of(key) or 0) for key in level.policy.keys_oldest_first()}

    def _resync_after_clear_locked(self, level: Level, pinned: set[bytes], before: dict | None = None) -> None:
        """The policy follows what the tier holds after a clear; pinned survivors go when unpinned."""
        present = {key: size for key, size, _ in level.tier.entries()}
        for key in level.policy.keys_oldest_first():
            if key not in present:
                level.policy.on_remove(key)
        for key, (meta, size) in (before or {}).items():
            if key not in present:
                self._record_eviction_locked(level, key, meta, size, "clear",
                                             gone=not self._held_elsewhere(level, key))
        for key, size in present.items():
            if key not in level.policy:
                level.policy.on_put(key, size)
        deferred = pinned & present.keys()
        self._doomed[level.tier.name] |= deferred
        self._counts["clear_deferred"] += len(deferred)

    def flush(self) -> int:
        """Write every object held only in non-persistent tiers to the persistent ones; returns how many."""
        self._behind.drain()
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

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until the writes queued behind requests are done; False when `timeout_s` passed first."""
        return self._behind.drain(timeout_s)

    def close(self) -> None:
        """Finish queued remote writes (bounded), release memory held by the tiers (L1 empties); what is
        on disk and in L3 stays. Idempotent."""
        dropped = self._behind.close(timeout_s=10.0)
        with self._lock:
            self._counts["behind_dropped"] += dropped
            for level in self._levels:
                level.tier.close()
                if not level.tier.persistent:
                    level.policy.clear()
                    self._doomed[level.tier.name].clear()

    def bytes_by_namespace(self) -> dict[str, dict[str, int]]:
        """{namespace: {tier name: bytes}} of every object the tiers hold (a remote tier: those this process
        knows of). The per-tenant "bytes held" of serve's /metrics."""
        held: dict[str, dict[str, int]] = {}
        for tier in self.tiers:
            for namespace, size in tier.bytes_by_namespace().items():
                held.setdefault(namespace, {})[tier.name] = size
        return held

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
                    **({"codec": level.tier.codec.label()} if getattr(level.tier, "codec", None) is not None else {}),
                    **({"remote": level.tier.health()} if level.tier.remote else {}),
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
                "remote_errors": counts["remote_errors"],
                "puts": counts["puts"],
                "put_failures": counts["put_failures"],
                "write_errors": counts["write_errors"],
                "promotions": counts["promotions"],
                "demotions": counts["demotions"],
                "discovered": counts["discovered"],
                "clear_deferred": counts["clear_deferred"],
                "lookups": counts["lookups"],
                "written_behind": counts["written_behind"],
                "behind_dropped": counts["behind_dropped"],
                "behind_queue": self._behind.pending,
                "evictions_recorded": self.history.recorded,   # into the ring (kvbridge.store.history)
                "miss_probes": counts["miss_probes"],
            }

    def _level_named(self, tier_name: str) -> Level:
        for level in self._levels:
            if level.tier.name == tier_name:
                return level
        known = ", ".join(level.tier.name for level in self._levels)
        raise ValueError(f"unknown tier {tier_name!r}; this store has: {known}")
