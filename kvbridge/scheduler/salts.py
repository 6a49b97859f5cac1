"""Cache salts: a namespace each, and a bounded table of their SequenceStores.

A cache salt (a tenant of serve, or a client's `cache_salt`) is chosen by whoever sends the request, so
the state kept per salt must be bounded. Each salt's KV lives under its own namespace (the salt's digest
in it, so in every key's seed; the salt itself appears nowhere). A salt's SequenceStore costs a hasher
and a table entry: the writer thread and the restore buffer are shared by every one
(kvbridge.scheduler.sequence_store `SequenceStoreShared`). Past `KVB_SCHED_MAX_SALTS` the least recently used salt that no queued, running or
swapped request uses is forgotten; its stored KV stays in the store, and its next request makes its
SequenceStore again and finds it there. No request is refused for bringing a new salt: when every known salt
is in use the table grows past the bound until they finish.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Callable, Iterable

from kvbridge.scheduler.sequence_store import SequenceStore


def salt_namespace(namespace: str, salt: str) -> str:
    """The namespace of `salt`'s KV: the unsalted one ("" is the GUI's and CLI's) or one seeded by its digest."""
    if not salt:
        return namespace
    return f"{namespace}|cache_salt={hashlib.sha256(salt.encode()).hexdigest()[:32]}"


class SaltStores:
    """The SequenceStore of each cache salt, made on first use, at most `limit` kept (the unsalted one always)."""

    def __init__(self, make_store: Callable[[str], SequenceStore], limit: int) -> None:
        self._make = make_store
        self.limit = max(1, int(limit))
        self._stores: OrderedDict[str, SequenceStore] = OrderedDict({"": make_store("")})
        self._lock = threading.Lock()   # submits (blend checks) and status readers come from other threads
        self.reclaimed = 0

    def get(self, salt: str, in_use: Callable[[], Iterable[str]] = tuple) -> SequenceStore:
        """`salt`'s SequenceStore (the most recently used from now on); making a new one may forget an idle salt's."""
        with self._lock:
            sequences = self._stores.get(salt)
            if sequences is None:
                sequences = self._stores[salt] = self._make(salt)
                self._reclaim(set(in_use()) | {salt})
            self._stores.move_to_end(salt)
            return sequences

    def _reclaim(self, busy: set[str]) -> None:
        idle = [salt for salt in self._stores if salt and salt not in busy]   # least recently used first
        for salt in idle[:max(0, len(self._stores) - self.limit)]:
            self._stores.pop(salt).close()   # the shared writer and buffer stay: only the salt's store goes
            self.reclaimed += 1

    def items(self) -> list[tuple[str, SequenceStore]]:
        with self._lock:
            return list(self._stores.items())

    def __len__(self) -> int:
        return len(self._stores)

    def close(self) -> None:
        with self._lock:
            for sequences in self._stores.values():
                sequences.close()
            self._stores.clear()
