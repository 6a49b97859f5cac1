"""The one eviction policy: least recently used, capacity in bytes, pinned objects never chosen.

Kept apart from the tiers (as LMCache keeps `update_on_hit/update_on_put/get_evict_candidates`
apart from its backends), so every tier evicts the same way. The store owns one policy per tier
and guards it with its lock; the policy itself is not thread-safe and does no I/O.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Iterable


class LRUPolicy:
    """Tracks object sizes in recency order (oldest first) and picks victims to get under capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, int(capacity))
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        self._pins: Counter[bytes] = Counter()
        self.bytes_used = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def fits(self, size: int) -> bool:
        """Whether an object of this size can ever be held (it is not larger than the whole tier)."""
        return size <= self.capacity

    def seed(self, entries: Iterable[tuple[bytes, int, float]]) -> None:
        """Load (key, size, last_used) found at start, e.g. a disk index; oldest becomes first victim."""
        for key, size, _ in sorted(entries, key=lambda entry: entry[2]):
            self.on_put(key, size)

    def size_of(self, key: bytes) -> int | None:
        """The size it tracks for key, None when absent."""
        return self._sizes.get(key)

    def on_put(self, key: bytes, size: int) -> None:
        """A new or replaced object: it becomes the most recently used."""
        self.bytes_used += size - self._sizes.pop(key, 0)
        self._sizes[key] = size

    def on_hit(self, key: bytes) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        self.bytes_used -= self._sizes.pop(key, 0)

    def clear(self) -> None:
        self._sizes.clear()
        self.bytes_used = 0

    def pin(self, key: bytes) -> None:
        """Pins nest: each pin() needs its own unpin(). A key may be pinned before it is present."""
        self._pins[key] += 1

    def unpin(self, key: bytes) -> None:
        self._pins[key] -= 1
        if self._pins[key] <= 0:
            del self._pins[key]

    def is_pinned(self, key: bytes) -> bool:
        return key in self._pins

    def pinned_keys(self) -> set[bytes]:
        return set(self._pins)

    def victims(self) -> list[bytes]:
        """Unpinned keys, least recently used first, whose removal brings the tier within capacity.

        When pinned objects alone exceed the capacity this returns every unpinned key and the tier
        stays over capacity until the pins are released (the next put trims it).
        """
        excess = self.bytes_used - self.capacity
        chosen: list[bytes] = []
        for key, size in self._sizes.items():
            if excess <= 0:
                break
            if key in self._pins:
                continue
            chosen.append(key)
            excess -= size
        return chosen

    def keys_oldest_first(self) -> list[bytes]:
        return list(self._sizes)
