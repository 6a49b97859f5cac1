"""Writes that run behind the request: one thread, a bounded queue, nothing waits for it but flush().

The store hands it the copies meant for slow tiers (L3 on the network, and the L2 copy of an
object promoted from L3), so a request's time-to-first-token never includes them. When the queue
is full the write is skipped and the caller counts it: a cache that stores a little less is better
than a request that waits for the network.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable

log = logging.getLogger(__name__)


class BehindWriter:
    """Runs write(job) for each submitted job, in order, on one daemon thread started on first use."""

    def __init__(self, write: Callable[[Any], None], capacity: int, name: str = "kvbridge-behind-writer") -> None:
        self._write = write
        self.capacity = max(1, int(capacity))
        self._name = name
        self._jobs: deque = deque()
        self._busy = 0                   # jobs taken off the queue and not finished yet
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._jobs) + self._busy

    def submit(self, job: Any) -> bool:
        """Queue a job; False when the queue is full or the writer is closed (the job is dropped)."""
        with self._cond:
            if self._closed or len(self._jobs) >= self.capacity:
                return False
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return True

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued job ran; False when `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout_s: float = 30.0) -> int:
        """Finish what is queued (up to `timeout_s`), then stop; returns how many jobs were dropped."""
        self.drain(timeout_s)
        with self._cond:
            self._closed = True
            dropped = len(self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=max(1.0, timeout_s))
        if dropped:
            log.warning("%s: %d writes still queued at close were dropped", self._name, dropped)
        return dropped

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy += 1
            try:
                self._write(job)
            except Exception:   # a bug in one write must not stop the ones behind it
                log.exception("%s: a queued write failed", self._name)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()
