"""PagedPool's grants (issue 47): pages lent to a writer ahead of its next store, so a lone store is one copy
and one round trip (store_granted) instead of two round trips around the copy (prepare, commit).

A part of PagedPool (kvbridge.cache_server.pool), whose constructor sets the state declared below; every
method here takes the pool's lock. A grant is a write lease whose key is GRANT_KEY until it is committed
under the object's key; everything else about write leases (expiry, revocation, orphans, quarantine)
applies to it unchanged.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import TYPE_CHECKING, Any

from kvbridge.cache_server.pages import OBJECT, PENDING, PageTable, PressureLevel
from kvbridge.store.objects import ObjectMeta, check_key

if TYPE_CHECKING:
    from kvbridge.cache_server.pool import WriteLease
    from kvbridge.cache_server.shm import Segment

GRANT_KEY = b""   # the key of a grant: a write lease whose object is named only when it is committed


class PoolGrants:
    """Grants (a part of PagedPool)."""

    segment: "Segment"
    watermarks: Any
    _lock: threading.Lock
    _total: int
    _pages: PageTable
    _objects: dict
    _leases: dict
    _generation: int
    _bytes_used: int
    _counts: Counter[str]

    def grant_write(self, size: int, client_id: str, priority: int) -> WriteLease | None:
        """Free pages for `size` bytes under a write lease with no key yet, so the writer's next store copies
        first and names the object in one round trip (commit_granted). None unless the pages are free and the
        pool stays out of pressure with them gone: a grant never evicts, and under pressure writers pay the
        two round trips again. A grant is a write lease in everything else (it expires, is revoked under
        CRITICAL pressure, is orphaned with a silent client)."""
        from kvbridge.cache_server.pool import WriteLease, pages_needed   # pool imports this module

        n = pages_needed(size, self.segment.page_bytes)
        with self._lock:
            if n == 0 or self.watermarks.level((self._free_count() - n) / self._total) > PressureLevel.OK:
                return None
            pages = self._pages.allocate(n)
            if pages is None:
                return None
            self._pages.mark(pages, PENDING)
            lease = self._new_lease(client_id, True, GRANT_KEY, pages, size, 0, priority)
            self._counts["grants"] += 1
            return WriteLease(lease.lease_id, GRANT_KEY, tuple(pages), size, 0)

    def commit_granted(self, lease_id: int, client_id: str, key: bytes, size: int, meta: ObjectMeta,
                       checksum: bytes = b"") -> str:
        """The object the writer copied into its grant's first pages, made visible under `key`: "stored";
        "exists" or "busy" (refused as prepare_write refuses; the grant stays the writer's for its next
        store); "revoked" (the grant expired or was revoked: the writer releases it). The grant's pages past
        the object are freed."""
        from kvbridge.cache_server.pool import UnknownLease, _Object, pages_needed   # pool imports this module

        key = check_key(key)
        if not isinstance(meta, ObjectMeta):
            raise TypeError(f"meta must be an ObjectMeta, got {type(meta).__name__}")
        with self._lock:
            lease = self._owned(lease_id, client_id)
            if not lease.writing or lease.key != GRANT_KEY:
                raise UnknownLease(f"lease {lease_id} is not a grant")
            if lease.zombie:
                return "revoked"
            n = pages_needed(size, self.segment.page_bytes)
            if not 0 <= size or n > len(lease.pages):
                raise ValueError(f"an object of {size} bytes does not fit grant {lease_id} ({len(lease.pages)} pages)")
            refusal = self._replaces(key, meta)
            if refusal:
                self._counts[f"refused_{refusal}"] += 1
                return refusal
            del self._leases[lease_id]
            pages, spare = lease.pages[:n], lease.pages[n:]
            if spare:
                self._free_pages(spare)
            self._generation += 1
            self._pages.mark(pages, OBJECT)
            self.segment.set_generation(pages, self._generation)
            self._objects[key] = _Object(pages, size, meta, self._generation, checksum=bytes(checksum))
            self._bytes_used += size
            return "stored"

