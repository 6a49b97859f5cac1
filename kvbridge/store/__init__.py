"""The content-addressed tiered KV store: L1 (RAM) then L2 (disk), one interface, one LRU policy.

    from kvbridge.store import TieredStore, ObjectMeta
    store = TieredStore.from_settings(settings, namespace=ns)
    store.put(chunk_hash, kv_bytes, ObjectMeta(ns, n_tokens=256, tokens_digest=hashing.tokens_digest(ids)))
    hit = store.lookup(chunk_hashes)          # LookupResult(n_hit, tiers)
    obj = store.get(chunk_hash)               # StoredObject(blob, meta, tier) or None

Modules, in reading order: objects (what is stored), policy (LRU by bytes with pins), tiers (the
interface and L1), diskformat (the L2 file), disk (L2), tiered (TieredStore: construction and reading,
with tiered_writing and tiered_upkeep), redis_tier and redis_link (L3: the tier, its connection),
opening (open_store: the embedded store, or a registered remote one when KVB_STORE_URL is set).

Errors: a storage fault never escapes get/put/lookup; it is a counted miss or skipped write in
stats(). The one storage exception callers may see is StoreFault (from clear(), when the disk
cannot be listed); its subclasses CorruptObject, ObjectVanished and UnstorableObject are what the
tiers raise to the store. Bad arguments (a key that is not a hash) are ValueError/TypeError: bugs.
"""
from kvbridge.store.disk import DiskTier
from kvbridge.store.objects import (
    KINDS,
    TIER_NONE,
    CorruptObject,
    LookupResult,
    ObjectMeta,
    ObjectVanished,
    StoredObject,
    StoreFault,
    UnstorableObject,
)
from kvbridge.store.opening import open_store
from kvbridge.store.policy import LRUPolicy
from kvbridge.store.tiered import TieredStore
from kvbridge.store.tiers import MemoryTier, Tier

__all__ = [
    "KINDS",
    "TIER_NONE",
    "CorruptObject",
    "DiskTier",
    "LookupResult",
    "LRUPolicy",
    "MemoryTier",
    "ObjectMeta",
    "ObjectVanished",
    "open_store",
    "StoredObject",
    "StoreFault",
    "Tier",
    "TieredStore",
    "UnstorableObject",
]
