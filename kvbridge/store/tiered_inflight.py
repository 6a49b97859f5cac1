"""TieredStore's in-flight reads: an object whose write has not landed yet is read, not missed (issue 47).

Place in the flow: ... answer -> put -> (copies for remote tiers wait in the write-behind queue) ... the
next request's lookup / get -> **here** -> restore. Without it a follow-up sent the moment an answer
arrives missed every object still in the queue; and since CachedEngine holds the queue quiet for the
length of a request, a follow-up missed them for certain, however long it took to answer.

Two cases, both bounded and both off with KVB_INFLIGHT_WAIT_MS=0 (the old behaviour: a miss):
- a write of this store still queued or running behind a request (BehindWriter.latest): served from the
  bytes the job holds, at once, with no wait: the very bytes the tier will hold (the newest job wins,
  as it will in the tier). Counted `inflight_reads`. A lossy tier's codec has not run on them yet: what is
  served is the exact KV the put was given, never worse than what the tier will hold.
- another writer's write of the key into a shared tier (a live writer's temp file in the L2 directory:
  another process, or another thread of this one): waited for, polling every POLL_S, at most
  KVB_INFLIGHT_WAIT_MS per lookup or get_many call in all. A write that fails (its temp file gone and no
  object) ends the wait at once (`inflight_failed`); one that takes longer is a miss at the bound
  (`inflight_timeouts`). Counted `inflight_waits`, `inflight_waited_ms`.

Deliberately left out: a remote tier's in-flight writes of other hosts (Redis has no temp file to see) and
an object another thread is still *preparing* (saving and splitting a state) before its put: nothing of it
is in the store yet. The engine reads what happened with take_inflight() (metrics live in the engine).
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

from kvbridge.store.behind import BehindWriter
from kvbridge.store.objects import StoredObject

POLL_S = 0.005   # how often a wait looks for the other writer's object (a rename: no event to wait on)
INFLIGHT_COUNTS = ("inflight_reads", "inflight_waits", "inflight_waited_ms", "inflight_timeouts", "inflight_failed")


@dataclass
class WaitBound:
    """One call's bound on its waits (a lookup or get_many waits at most this long in all)."""

    until: float          # time.monotonic()
    waited: bool = False  # a wait ran in this call: keys asked before it may have landed since


class TierInflight:
    """Reads of queued writes and bounded waits for other writers (a part of TieredStore)."""

    _levels: list
    _lock: threading.RLock
    _counts: Counter[str]
    _hits: Counter[str]
    _behind: BehindWriter
    inflight_wait_s: float
    _inflight_taken: Counter[str]

    def _queued_object(self, key: bytes, expected: str | None) -> StoredObject | None:
        """The newest write of `key` still queued behind a request (or being written), as the object it
        stores; None when there is none, in-flight reads are off, or it is another namespace's."""
        if self.inflight_wait_s <= 0:
            return None
        job = self._behind.latest(lambda job: job[1] == key)
        if job is None:
            return None
        index, _, blob, meta, _ = job
        if expected is not None and meta.namespace != expected:
            return None
        return StoredObject(blob, meta, self._levels[index].tier.name)

    def _served_queued(self, found: StoredObject) -> StoredObject:
        with self._lock:
            self._counts["inflight_reads"] += 1
            self._hits[found.tier] += 1
        return found

    def _wait_bound(self) -> WaitBound:
        return WaitBound(time.monotonic() + self.inflight_wait_s)

    def _await_writer(self, key: bytes, bound: WaitBound) -> int | None:
        """The level that holds `key` once another writer's write of it landed; None when no writer is
        writing it, its write failed, or the call's bound passed first."""
        if self.inflight_wait_s <= 0:
            return None
        writing = [index for index, level in enumerate(self._levels) if level.tier.writing(key)]
        if not writing:
            if not bound.waited:
                return None
            # landed while this call waited for an earlier key: one more look at the local tiers (not a
            # remote one: that would be a round trip)
            return self._landed([index for index, level in enumerate(self._levels) if not level.tier.remote], key)
        bound.waited = True
        deadline = bound.until
        started = time.monotonic()
        while True:
            # who still writes is asked before looking for the object: a writer that renamed its file
            # between the two looks is then found by the look, never taken for a failed write
            still = [index for index in writing if self._levels[index].tier.writing(key)]
            found = self._landed(writing, key)
            now = time.monotonic()
            if found is not None or not still or now >= deadline:
                break
            writing = still
            time.sleep(min(POLL_S, max(0.0, deadline - now)))
        with self._lock:
            self._counts["inflight_waits"] += 1
            self._counts["inflight_waited_ms"] += round((time.monotonic() - started) * 1000)
            if found is None:
                self._counts["inflight_timeouts" if still else "inflight_failed"] += 1
        return found

    def _landed(self, indexes: list[int], key: bytes) -> int | None:
        for index in indexes:
            level = self._levels[index]
            if level.tier.discover(key) is None:
                continue
            with self._lock:
                if self._sync_locked(level, key) is not None:
                    return index
        return None

    def take_inflight(self) -> dict[str, int]:
        """The in-flight counts since the last call (the engine adds them to its metrics)."""
        with self._lock:
            now = {name: self._counts[name] for name in INFLIGHT_COUNTS}
            taken = {name: now[name] - self._inflight_taken[name] for name in INFLIGHT_COUNTS}
            self._inflight_taken.update(taken)
        return {name: count for name, count in taken.items() if count}
