"""Who is told what KV the scheduler holds: the resident runs after each step, the stored prompts after
each write (a KV-event publisher, kvbridge.kv_events, is such a listener).

Only unsalted (cache salt "") exact KV is told: a tenant's or a `cache_salt` request's prompt must not
show up in a stream other tenants may read, and blended cells are not what their tokens would compute.
A listener has two methods, both called on the scheduler's threads and expected to return at once (it
queues inside):
- `resident(runs)`: from the loop's thread, after a step in which the whole chunks resident in
  llama.cpp changed; `runs` = every such token run now resident (a running request's context[:kv_tokens],
  a cached prefix's tokens), whole, as tuples; the listener cuts them to whole chunks. [] at close.
- `stored(tokens, n_chunks)`: from the writer's thread, after the first n_chunks whole chunks of an
  unsalted prompt (or swapped-out context) were written and found in the store.
What changed is told by a cheap key per step, (holder, whole chunks) for each resident run, compared with
the last one: the runs themselves are built only when it differs. A listener that raises is logged and
counted (`listener_faults`), never the loop's fault.
"""
from __future__ import annotations

import logging
import threading
from typing import Sequence

from kvbridge.scheduler.requests import CachedPrefix, Request

log = logging.getLogger(__name__)


class KVListeners:
    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._listeners: tuple = ()      # replaced whole under the lock, read without it
        self._lock = threading.Lock()
        self._last_key: tuple | None = ()
        self.faults = 0

    def add(self, listener) -> None:
        """Register a listener; it is told the resident runs after the next step (a fresh view)."""
        with self._lock:
            self._listeners = (*self._listeners, listener)
            self._last_key = None

    def __bool__(self) -> bool:
        return bool(self._listeners)

    def after_step(self, running: Sequence[Request], prefixes: Sequence[CachedPrefix]) -> None:
        """On the loop's thread, after a step: tell the resident runs when their whole chunks changed."""
        listeners = self._listeners
        if not listeners:
            return
        c = self.chunk_size
        requests = [r for r in running if not r.salt and not r.blend and r.kv_tokens >= c]
        cached = [p for p in prefixes if not p.salt and len(p.tokens) >= c]
        key = tuple((r.holder, r.kv_tokens // c) for r in requests) + tuple((p.holder, len(p.tokens) // c)
                                                                             for p in cached)
        if key == self._last_key:
            return
        self._last_key = key
        runs = [tuple(r.context[:r.kv_tokens]) for r in requests] + [tuple(p.tokens) for p in cached]
        self._tell(listeners, "resident", runs)

    def stored(self, tokens: tuple[int, ...], n_chunks: int) -> None:
        """From the writer's thread: the first n_chunks whole chunks of an unsalted run are in the store."""
        self._tell(self._listeners, "stored", tokens, n_chunks)

    def close(self) -> None:
        """The scheduler closes: nothing is resident any more."""
        self._tell(self._listeners, "resident", [])

    def _tell(self, listeners, method: str, *args) -> None:
        for listener in listeners:
            try:
                getattr(listener, method)(*args)
            except Exception:   # a listener's bug: logged and counted, the scheduler goes on
                self.faults += 1
                log.exception("a kv listener's %s() failed", method)
