"""InstanceClock: when each client instance was first and last seen (the server's client table and
the storage module, a liveness target, both keep one)."""
from __future__ import annotations

import threading
import time


class InstanceClock:
    """A module's view of client instances; stale ones are what reap_stale_instances returns.

    An instance is stale once silent for reap_timeout_s; one that has been seen only once (its
    registration) is given registration_grace_s instead, if that is longer (an engine may take a
    while to load its model between hello and its first request).
    """

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, float, int]] = {}   # id -> (first, last, touches)

    def touch(self, instance_id: str) -> None:
        now = self._clock()
        with self._lock:
            first, _, touches = self._seen.get(instance_id, (now, now, 0))
            self._seen[instance_id] = (first, now, touches + 1)

    def stale(self, reap_timeout_s: float, registration_grace_s: float) -> list[str]:
        now = self._clock()
        with self._lock:
            return [iid for iid, (first, last, touches) in self._seen.items()
                    if now - last > (reap_timeout_s if touches > 1 else max(reap_timeout_s, registration_grace_s))]

    def seen(self, instance_id: str) -> tuple[float, float, int] | None:
        """(first seen, last seen, touches) on this clock, or None for an instance it does not know."""
        with self._lock:
            return self._seen.get(instance_id)

    def now(self) -> float:
        return self._clock()

    def forget(self, instance_id: str) -> None:
        with self._lock:
            self._seen.pop(instance_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)
