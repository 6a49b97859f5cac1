"""Writes that run behind the request: one thread, a bounded queue, nothing waits for it but flush().

The store hands it the copies meant for slow tiers (L3 on the network, and the L2 copy of an
object promoted from L3), so a request's time-to-first-token never includes them. When the queue
is full the write is skipped and the caller counts it: a cache that stores a little less is better
than a request that waits for the network.

While a request is on its way to its answer (`hold()`, CachedEngine around each request) the writer
starts no new job: on a machine with few cores a 40 MB L2 write and its fsync running beside a
prefill took a core from llama.cpp (a warm suffix prefill 50 % slower, Docs/Research.md §15). A hold
lasts at most MAX_HOLD_S, and drain() and close() end it, so nothing waits for it forever.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)
MAX_HOLD_S = 30.0
BACKGROUND_NICE = 19   # a writer thread's CPU priority (Linux: per thread): it runs when the cores are free


def run_in_background() -> None:
    """Lower the calling thread's CPU priority, so a write behind a request (an L2 copy, an L3 put, the
    cache server's disk writer) does not take a core from the next request's prefill: a hold only
    stops a writer from *starting* a job, and a 40 MB write with its fsync that began just before
    a request made that request's suffix prefill 10-16 ms slower (Docs/Research.md §15). Where
    threads have no priority of their own (not Linux), it does nothing."""
    import os

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass


class BehindWriter:
    """Runs write(job) for each submitted job, in order, on one daemon thread started on first use."""

    def __init__(self, write: Callable[[Any], None], capacity: int, name: str = "kvbridge-behind-writer") -> None:
        self._write = write
        self.capacity = max(1, int(capacity))
        self._name = name
        self._jobs: deque = deque()
        self._busy = 0                   # jobs taken off the queue and not finished yet
        self._running: list = []         # those jobs themselves (what `queued` also looks at)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._holds = 0                  # requests in flight that want the writer quiet
        self._held_since = 0.0
        self._draining = 0

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._jobs) + self._busy

    def queued(self, match: Callable[[Any], bool]) -> bool:
        """Whether a job for which match(job) is true waits in the queue or is being written now."""
        with self._cond:
            return any(match(job) for job in self._running) or any(match(job) for job in self._jobs)

    def latest(self, match: Callable[[Any], bool]) -> Any | None:
        """The newest job for which match(job) is true, queued or being written now; None when there is none.

        A reader uses it to serve an object from the bytes a queued write holds (TieredStore's in-flight
        reads): the newest queued job is what the tier will hold once the queue has run."""
        with self._cond:
            for job in reversed(self._jobs):
                if match(job):
                    return job
            for job in reversed(self._running):
                if match(job):
                    return job
            return None

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

    @contextmanager
    def hold(self) -> Iterator[None]:
        """No new job starts inside this (a job already running finishes); nests across threads."""
        with self._cond:
            if not self._holds:
                self._held_since = time.monotonic()
            self._holds += 1
        try:
            yield
        finally:
            with self._cond:
                self._holds -= 1
                self._cond.notify_all()

    def _held(self) -> bool:
        return bool(self._holds) and not self._draining and time.monotonic() - self._held_since < MAX_HOLD_S

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued job ran (a hold does not stop them); False when `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._draining += 1
            self._cond.notify_all()
            try:
                while self._jobs or self._busy:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._draining -= 1

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
        run_in_background()
        while True:
            with self._cond:
                while (not self._jobs or self._held()) and not self._closed:
                    # a hold is re-checked at least once a second, so MAX_HOLD_S ends it without a notify
                    self._cond.wait(1.0 if self._jobs else None)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy += 1
                self._running.append(job)
            try:
                self._write(job)
            except Exception:   # a bug in one write must not stop the ones behind it
                log.exception("%s: a queued write failed", self._name)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._running.remove(job)
                    self._cond.notify_all()
