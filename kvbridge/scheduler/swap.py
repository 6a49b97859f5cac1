"""The store as the scheduler's swap space and long-term memory, in CachedEngine's own object format.

A sequence's KV leaves llama.cpp as `llama_state_seq_get_data` bytes and is cut into content-addressed
chunk and tail objects by ChunkKV (the same objects CachedEngine's lmcache mode stores, under the
same namespace), so what the scheduler stores a restart or another process restores, and the other
way round. Three uses:

- swap-out: a preempted sequence's whole context is stored and its objects pinned until it resumes
  (the store's pressure may not evict them); `swap_out` says whether the store really holds all of it.
  Pins keep objects from eviction, not from being replaced: another request sharing the prefix up to
  the last whole chunk writes the same tail key, and the resumed request then restores the common
  part and recomputes the rest (token ids are confirmed, so never wrong KV);
- swap-in and admission: the longest stored prefix of a context is restored into a sequence;
- a prompt's KV is stored after its prefill on a background thread (off the TTFT path).
"""
from __future__ import annotations

import logging
import queue
import threading
from contextlib import ExitStack
from typing import Sequence

from kvbridge.backends.base import SeqState
from kvbridge.engine.chunks import ChunkKV, ForeignState
from kvbridge.engine.hashing import make_hasher, tail_key
from kvbridge.formats.llama_state import KVGeometry
from kvbridge.settings import Settings

log = logging.getLogger(__name__)


class SwapSpace:
    def __init__(self, store, settings: Settings, namespace: str, geometry: KVGeometry, write_queue: int = 16) -> None:
        self.store = store
        self.hasher = make_hasher(settings.chunk_size, namespace, settings.prefer_lmcache_hasher)
        self.seed = getattr(self.hasher, "seed", b"")
        self.kv = ChunkKV(store, namespace, self.seed, settings.chunk_size, geometry)
        self.kv.prefault_scratch = False
        self._jobs: queue.Queue = queue.Queue(maxsize=write_queue)
        self._writer = threading.Thread(target=self._write_loop, name="kvbridge-sched-store", daemon=True)
        self._writer.start()
        self.skipped_writes = 0

    def hashes(self, tokens: Sequence[int]) -> list[bytes]:
        return self.hasher.chunk_hashes(tokens)

    # -- swap -----------------------------------------------------------------------------------------
    def swap_out(self, data, tokens: list[int]) -> tuple[bool, ExitStack]:
        """Store a context's KV and pin its objects; (whether all of it can come back, the pins)."""
        hashes = self.hashes(tokens)
        # A prompt store still queued would write this context's tail key with the shorter prompt's
        # tail after us (same key: the tail after the last whole chunk), so the swap lands last.
        self.drain()
        pins = ExitStack()
        pins.enter_context(self.store.pinned(self._keys(hashes)))
        try:
            self.kv.store_prompt(SeqState(data=data, n_tokens=len(tokens), token_ids=tuple(tokens)), tokens, hashes)
        except ForeignState as exc:   # cannot happen with our own sequence; recompute rather than trust it
            log.warning("swap-out not stored: %s", exc)
            return False, pins
        whole = len(tokens) // self.kv.chunk_size
        found = self.store.lookup(hashes[:whole], namespace=self.kv.namespace).n_hit == whole
        tail = whole * self.kv.chunk_size >= len(tokens) or \
            self.store.contains(tail_key(hashes[whole - 1] if whole else self.seed), namespace=self.kv.namespace)
        return found and tail, pins

    def restore(self, tokens: list[int]):
        """The longest stored prefix of `tokens` (at most all but the last): a RestorePlan whose state is
        set when matched_tokens > 0."""
        return self.kv.plan_restore(tokens, self.hashes(tokens))

    # -- prompts --------------------------------------------------------------------------------------
    def store_behind(self, data, tokens: list[int]) -> bool:
        """Queue a prompt's KV (already copied out of llama.cpp) for storing; False when the queue is full."""
        try:
            self._jobs.put_nowait((bytes(data), list(tokens)))
            return True
        except queue.Full:
            self.skipped_writes += 1
            return False

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                data, tokens = job
                self.kv.store_prompt(SeqState(data=data, n_tokens=len(tokens), token_ids=tuple(tokens)), tokens,
                                     self.hashes(tokens))
            except Exception:   # a failed store costs a later miss, never the scheduler's loop
                log.exception("storing a prompt's KV failed")
            finally:
                self._jobs.task_done()

    def drain(self) -> None:
        self._jobs.join()

    def close(self) -> None:
        self._jobs.put(None)
        self._writer.join(timeout=30)
        self.kv.close()

    def _keys(self, hashes: list[bytes]) -> list[bytes]:
        return list(hashes) + [tail_key(prev) for prev in [self.seed, *hashes]]
