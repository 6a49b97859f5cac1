"""The one buffer a restore assembles a sequence's state into, and what it holds now.

A restore cuts a state out of chunk and tail objects into one contiguous buffer (40-50 MB for a 2k-token
SmolLM2 prompt) that the engine then loads. A fresh buffer per restore costs a page fault per 4 KiB, so
the buffer is kept and reused; the state last assembled in it can even be handed over again when the
same prefix is asked for next (a "hot" restore). Several readers of the store may share one buffer when
only one of them restores at a time: the scheduler's cache salts do (kvbridge.scheduler.salts), so a
new salt costs no buffer and no thread of its own. What the buffer holds is known by its tokens *and*
the namespace they were stored under: another salt's namespace is another tenant's KV, never hot here.

Not thread-safe: its users take turns (one request at a time on the scheduler's loop, one in CachedEngine).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Sequence

import numpy as np


class AssemblyBuffer:
    """A reusable byte buffer, the (namespace, tokens) whose whole state it holds, and a copy thread."""

    def __init__(self) -> None:
        self.data: np.ndarray | None = None
        self._tokens: np.ndarray | None = None
        self._namespace = ""
        self.lossy: set[str] = set()
        # a second thread for the copies: numpy releases the GIL while it copies
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvb-assemble")

    def tokens_held(self, namespace: str) -> np.ndarray | None:
        """The tokens whose state the buffer holds under `namespace`, or None (nothing, or another namespace's)."""
        return self._tokens if namespace == self._namespace else None

    def room(self, size: int) -> np.ndarray:
        """The buffer, grown to at least `size` bytes; whatever it held is forgotten (it is written over)."""
        self.forget()
        if self.data is None or len(self.data) < size:
            self.data = np.empty(size, dtype=np.uint8)
        return self.data

    def holds(self, namespace: str, tokens: Sequence[int], lossy: set[str]) -> None:
        """The buffer now holds the whole state of `tokens` under `namespace`."""
        self._namespace, self._tokens, self.lossy = namespace, np.asarray(tokens, dtype=np.int64), set(lossy)

    def forget(self) -> None:
        self._namespace, self._tokens, self.lossy = "", None, set()

    def reserve(self, size: int) -> None:
        """Grow and touch the buffer now, off the TTFT path, so a later restore does not pay a page fault
        per 4 KiB (30-90 ms for 40 MB, once); the state it holds moves along."""
        if self.data is None or len(self.data) < size:
            grown = np.empty(size, dtype=np.uint8)
            grown.fill(0)
            if self.data is not None and self._tokens is not None:
                grown[:len(self.data)] = self.data
            self.data = grown

    def run_jobs(self, jobs: Sequence[Callable[[], None]]) -> None:
        """Half the copy jobs on the copy thread, half here; returns only when both halves are done.

        On every path, a failure included: a job still running after we return would keep writing
        into the buffer that the next restore hands to the engine.
        """
        other = self._pool.submit(_run_all, jobs[1::2])
        try:
            _run_all(jobs[0::2])
        finally:
            wait([other])
        other.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.data = None
        self.forget()


def _run_all(jobs) -> None:
    for job in jobs:
        job()
