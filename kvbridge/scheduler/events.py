"""What the scheduler did and holds, for the KV cache lab, serve's status and the tests: the event log,
the counters and the snapshot. Every part of the loop writes to one Journal; readers get copies
(`Scheduler.events()`, `Scheduler.snapshot()`), never the parts themselves.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass

EVENT_KINDS = ("admit", "share", "restore", "restore-failed", "evict", "preempt", "swap-out", "swap-in", "finish",
               "cancel", "fail")
COUNTER_NAMES = ("hits", "misses", "evictions", "preemptions", "swap_ins", "recomputed", "shared_tokens",
                 "restored_tokens", "restore_failed", "finished", "cancelled", "faults", "failed",
                 "blend_reused_tokens")


@dataclass(frozen=True)
class Event:
    t: float          # seconds since the scheduler started
    kind: str
    request: str      # the holder: "req-7", "prefix-9"
    detail: str = ""
    label: str = ""   # what the person who submitted it called it


class Journal:
    """The counters and the last 5000 events; written on the loop's thread, read under the scheduler's lock."""

    def __init__(self) -> None:
        self.counters = collections.Counter()
        self._events: collections.deque[Event] = collections.deque(maxlen=5000)
        self._started = time.perf_counter()
        self.notes: list[str] = []   # what this model changes in the scheduler's ways, for a person (the snapshot's)

    def event(self, kind: str, who, detail: str = "") -> None:
        """`who`: a Request or a CachedPrefix (its holder name and label go in the event)."""
        self._events.append(Event(time.perf_counter() - self._started, kind, who.holder, detail, who.label))

    def events(self) -> list[dict]:
        return [{"t": round(e.t, 4), "kind": e.kind, "request": e.request, "label": e.label, "detail": e.detail}
                for e in self._events]

    def counter_values(self) -> dict[str, int]:
        return {name: self.counters[name] for name in COUNTER_NAMES}


def snapshot(settings, ledger, queues, prefixes, free_seqs, journal: Journal) -> dict:
    """Blocks by owner (shared ones with reference counts), pressure, the three queues, the cached
    prefixes, the free sequence ids, counters."""
    return {
        "blocks": ledger.snapshot(),
        "pressure": ledger.pressure().name,
        "watermarks": {"soft": settings.sched_soft, "hard": settings.sched_hard, "critical": settings.sched_critical},
        "running": [r.describe() for r in queues.running],
        "waiting": [r.describe() for r in queues.waiting],
        "swapped": [r.describe() for r in queues.swapped],
        "prefixes": prefixes.describe(),
        "free_seqs": sorted(free_seqs),
        "counters": journal.counter_values(),
        "notes": list(journal.notes),
    }
