"""TieredStore's memory of what it dropped, and what it says about keys a lookup missed.

Place in the flow: ... lookup finds fewer chunks than the prompt has -> kvbridge.engine.misses asks
**TieredStore.probe_miss(keys, probes)** -> the cause (evicted, lease_busy, tier_down, other_namespace
or none_stored). One call, no payload read: the eviction ring (kvbridge.store.history, filled by
tiered_writing and tiered_upkeep), the write-behind queue, the tiers' indexes, and for the probes the
same discovery a lookup makes (one pipelined round trip to L3, a header read per L2 file).

Which namespaces the tiers hold is asked of every tier (L3 keeps a registry on the server, so a fresh
process learns it), at most once per NAMESPACES_TTL_S: a burst of misses costs one listing.
TierHistory is a part of TieredStore (kvbridge.store.tiered), whose constructor sets the state below.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace
from typing import Sequence

from kvbridge.store.behind import BehindWriter
from kvbridge.store.history import Eviction, EvictionRing, MissProbe
from kvbridge.store.objects import check_key
from kvbridge.store.tiered_writing import Level

NAMESPACES_TTL_S = 2.0   # how long a listing of the tiers' namespaces is reused


class TierHistory:
    """probe_miss and recent_evictions (a part of TieredStore)."""

    _levels: list[Level]
    _lock: threading.RLock
    _counts: Counter[str]
    _behind: BehindWriter
    history: EvictionRing
    _namespaces_cache: tuple[float, dict[str, int]] | None

    def recent_evictions(self, limit: int = 100) -> list[Eviction]:
        """The newest `limit` evictions, newest first (the GUI and `kvbridge explain --evictions`)."""
        return self.history.recent(limit)

    def probe_miss(self, keys: Sequence[bytes], probes: Sequence[bytes] = ()) -> MissProbe:
        """What this store knows about `keys` (the first keys a restore missed) and `probes` (the prompt's
        keys under other namespaces); see MissProbe. round_trips: the calls this probe sent to remote tiers (L3's
        pipelined lookup, its namespace registry), 0 when it stayed in this process."""
        sent = self._remote_calls()
        keys = [check_key(key) for key in keys]
        probes = [check_key(key) for key in probes]
        history: list[Eviction | None] = []
        with self._lock:
            for key in keys:
                entry = self.history.latest(key)
                if entry is not None:   # gone is about now: a copy may have been written back since
                    entry = replace(entry, gone=not any(key in level.policy for level in self._levels))
                history.append(entry)
        pending = [self._behind.queued(lambda job, key=key: job[1] == key) for key in keys]
        found = [""] * len(probes)
        if probes:
            holders = self._holders(probes)   # the lookup's discovery: L2 files, one pipelined call to L3
            found = [self._levels[index].tier.name if index is not None else "" for index in holders]
        down = {level.tier.name: level.tier.why_down() or "unavailable" for level in self._levels
                if not level.tier.available()}
        if keys:   # a probe without keys only asks for the namespaces (an engine's start): not a miss
            self._count_probe()
        namespaces = self.namespaces_held()
        return MissProbe(history=history, pending=pending, found=found, namespaces=namespaces,
                         down=down, round_trips=self._remote_calls() - sent)

    def _remote_calls(self) -> int:
        """Round trips this thread has sent to the tiers (counted by each tier per thread, so another thread's
        writes behind are not this probe's)."""
        return sum(level.tier.calls_on_this_thread() for level in self._levels)

    def namespaces_held(self) -> dict[str, int]:
        """{namespace: bytes} over every tier (L3: its registry on the server too), reused for NAMESPACES_TTL_S."""
        now = time.monotonic()
        cached = self._namespaces_cache
        if cached is not None and now - cached[0] < NAMESPACES_TTL_S:
            return dict(cached[1])
        held: dict[str, int] = {}
        for level in self._levels:
            for namespace, size in level.tier.namespaces_stored().items():
                held[namespace] = held.get(namespace, 0) + size
        self._namespaces_cache = (now, held)
        return dict(held)

    def _count_probe(self) -> None:
        with self._lock:
            self._counts["miss_probes"] += 1
