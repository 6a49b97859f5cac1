"""The content-addressed tiered KV store: L1 (RAM) then L2 (disk), one interface, one LRU policy.

    from kvbridge.store import TieredStore, ObjectMeta
    store = TieredStore.from_settings(settings, namespace=ns)
    store.put(chunk_hash, kv_bytes, ObjectMeta(ns, n_tokens=256, tokens_digest=hashing.tokens_digest(ids)))
    hit = store.lookup(chunk_hashes)          # LookupResult(n_hit, tiers)
    obj = store.get(chunk_hash)               # StoredObject(blob, meta, tier) or None

Modules, in reading order: objects (what is stored), policy (LRU by bytes with pins), tiers (the
interface and L1), diskformat (the L2 file), disk (L2), tiered (TieredStore).
"""
from kvbridge.store.disk import DiskTier
from kvbridge.store.objects import (
    KINDS,
    TIER_NONE,
    LookupResult,
    ObjectMeta,
    StoredObject,
)
from kvbridge.store.policy import LRUPolicy
from kvbridge.store.tiered import TieredStore
from kvbridge.store.tiers import MemoryTier, Tier

__all__ = [
    "KINDS",
    "TIER_NONE",
    "DiskTier",
    "LookupResult",
    "LRUPolicy",
    "MemoryTier",
    "ObjectMeta",
    "StoredObject",
    "Tier",
    "TieredStore",
]
