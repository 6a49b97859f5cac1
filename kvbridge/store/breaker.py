"""The circuit breaker of the remote tiers (L3 on Redis, S3): up, or down until a retry time that backs off.

Requests never probe: while a tier is down they skip it, and the tier's background prober tries at each retry
time, so a silent endpoint costs one request one timeout in all, not one per backoff period. The backoff runs
from FIRST_BACKOFF_S to MOST_BACKOFF_S, doubling. One rule for every remote tier (kvbridge.store.redis_link,
kvbridge.store.s3_link); `label` names the tier in its log lines.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)
FIRST_BACKOFF_S, MOST_BACKOFF_S = 1.0, 30.0


class Breaker:
    """Up, or down until a retry time that backs off; requests never probe (a prober thread does)."""

    def __init__(self, label: str = "a remote tier", clock: Callable[[], float] = time.monotonic) -> None:
        self.label = label
        self._clock = clock
        self._lock = threading.Lock()
        self.down_since: float | None = None
        self.reason = ""
        self._retry_at = 0.0
        self._delay = FIRST_BACKOFF_S

    @property
    def is_down(self) -> bool:
        return self.down_since is not None

    def allow(self) -> bool:
        with self._lock:
            return self.down_since is None

    def succeeded(self) -> None:
        with self._lock:
            if self.down_since is not None:
                log.info("%s is reachable again (down %.1f s)", self.label, self._clock() - self.down_since)
            self.down_since, self.reason, self._delay = None, "", FIRST_BACKOFF_S

    def failed(self, reason: str) -> None:
        with self._lock:
            now = self._clock()
            if self.down_since is None:
                self.down_since = now
                log.warning("%s marked down (%s); retrying in %.0f s, requests skip it meanwhile",
                            self.label, reason, self._delay)
            self.reason = reason
            self._retry_at = now + self._delay
            self._delay = min(self._delay * 2, MOST_BACKOFF_S)

    def retry_in(self) -> float:
        with self._lock:
            return max(0.0, self._retry_at - self._clock()) if self.down_since is not None else 0.0
