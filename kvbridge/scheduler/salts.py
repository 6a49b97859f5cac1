"""Cache salts: a namespace each, and a bounded table of their store spaces.

A cache salt (a tenant of serve, or a client's `cache_salt`) is chosen by whoever sends the request, so
the state kept per salt must be bounded. Each salt's KV lives under its own namespace (the salt's digest
in it, so in every key's seed; the salt itself appears nowhere). A salt's space costs a hasher and a
table entry: the writer thread and the restore buffer are shared by every space (kvbridge.scheduler.swap
`SwapShared`). Past `KVB_SCHED_MAX_SALTS` the least recently used salt that no queued, running or
swapped request uses is forgotten; its stored KV stays in the store, and its next request makes the
space again and finds it there. No request is refused for bringing a new salt: when every known salt
is in use the table grows past the bound until they finish.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Callable, Iterable

from kvbridge.scheduler.swap import SwapSpace


def salt_namespace(namespace: str, salt: str) -> str:
    """The namespace of `salt`'s KV: the unsalted one ("" is the GUI's and CLI's) or one seeded by its digest."""
    if not salt:
        return namespace
    return f"{namespace}|cache_salt={hashlib.sha256(salt.encode()).hexdigest()[:32]}"


class SaltSpaces:
    """The store space of each cache salt, made on first use, at most `limit` kept (the unsalted one always)."""

    def __init__(self, make_space: Callable[[str], SwapSpace], limit: int) -> None:
        self._make = make_space
        self.limit = max(1, int(limit))
        self._spaces: OrderedDict[str, SwapSpace] = OrderedDict({"": make_space("")})
        self._lock = threading.Lock()   # submits (blend checks) and status readers come from other threads
        self.reclaimed = 0

    def get(self, salt: str, in_use: Callable[[], Iterable[str]] = tuple) -> SwapSpace:
        """`salt`'s space (the most recently used from now on); making a new one may forget an idle salt's."""
        with self._lock:
            space = self._spaces.get(salt)
            if space is None:
                space = self._spaces[salt] = self._make(salt)
                self._reclaim(set(in_use()) | {salt})
            self._spaces.move_to_end(salt)
            return space

    def _reclaim(self, busy: set[str]) -> None:
        idle = [salt for salt in self._spaces if salt and salt not in busy]   # least recently used first
        for salt in idle[:max(0, len(self._spaces) - self.limit)]:
            self._spaces.pop(salt).close()   # the shared writer and buffer stay: only the space goes
            self.reclaimed += 1

    def items(self) -> list[tuple[str, SwapSpace]]:
        with self._lock:
            return list(self._spaces.items())

    def __len__(self) -> int:
        return len(self._spaces)

    def close(self) -> None:
        with self._lock:
            for space in self._spaces.values():
                space.close()
            self._spaces.clear()
