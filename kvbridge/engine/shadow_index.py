"""ShadowIndex: for shadow engines (the engine keeps its KV), the prompt's chunk hashes and tails as token ids.

Place in the flow: chunk hashes -> **predict** (how much of this prompt a full-KV engine would restore,
next to the engine's own cached-token count) ... generate -> **record** (the prompt's chunks and tails,
as ChunkKV files them, holding token ids only: kind "index").
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from kvbridge.engine.chunks import TAIL_DEPTH, common_prefix_length
from kvbridge.engine.hashing import tail_key, tokens_digest
from kvbridge.engine.misses import MissExplainer
from kvbridge.engine.restore_plan import owned
from kvbridge.store import ObjectMeta, TieredStore


class ShadowIndex:
    """For shadow engines: the same hashes and tails, holding token ids only, to predict reuse."""

    def __init__(self, store: TieredStore, namespace: str, seed: bytes, chunk_size: int):
        self.store = store
        self.namespace = namespace
        self.seed = seed
        self.chunk_size = chunk_size
        self.misses = MissExplainer(store, namespace, seed, chunk_size)   # why a prediction stops short

    def predict(self, tokens: Sequence[int], hashes: Sequence[bytes]) -> tuple[int, int, str]:
        """(chunks hit, predicted reusable tokens, tier) for a prompt."""
        found = self.store.lookup(list(hashes), namespace=self.namespace)
        k = found.n_hit
        tier = found.tiers[-1] if k else "none"
        # a cache server lends the object (a read lease on shared memory): read it, then give it back
        obj = owned(self.store.get(tail_key(hashes[k - 1] if k else self.seed), namespace=self.namespace))
        extra = 0
        if obj is not None and obj.meta.kind == "index":
            ids = np.frombuffer(obj.blob, dtype="<u4")
            extra = common_prefix_length(ids, tokens[k * self.chunk_size:])
            tier = self.store.slower(tier, obj.tier)
        return k, k * self.chunk_size + extra, tier

    def record(self, tokens: Sequence[int], hashes: Sequence[bytes]) -> int:
        c = self.chunk_size
        n = len(tokens)
        n_full = n // c
        stored = 0
        for i in range(n_full):
            if not self.store.contains(hashes[i]):
                stored += self._put(hashes[i], tokens[i * c:(i + 1) * c])
        for j in range(n_full, max(n_full - TAIL_DEPTH, -1), -1):
            if j * c < n:
                stored += self._put(tail_key(hashes[j - 1] if j else self.seed), tokens[j * c:n])
        return stored

    def _put(self, key: bytes, ids: Sequence[int]) -> int:
        meta = ObjectMeta(namespace=self.namespace, n_tokens=len(ids), tokens_digest=tokens_digest(ids), kind="index")
        return 0 if self.store.put(key, np.asarray(ids, dtype="<u4").tobytes(), meta) is False else 1
