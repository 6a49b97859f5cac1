"""Which page of the L1 pool is where, and how much pressure that is: the pool's bookkeeping of pages.

Every page is in exactly one state: FREE, in a committed OBJECT, PENDING (reserved by a write lease)
or QUARANTINED (named by a revoked or expired lease whose client may still touch it). `holds` counts,
per page, the zombie leases still naming it; a page leaving an object or a write while held goes to
quarantine instead of the free list, and back to FREE when its last hold ends. The allocator
prefers one contiguous run (best fit) so a reader gets a zero-copy view, and scatters only when no
run is long enough, taking the shortest runs first so long runs stay whole.

Watermarks turn the free fraction into a PressureLevel. Not thread-safe: PagedPool holds its lock.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbridge.store.pressure import PressureLevel, pressure_level

# page states, as page_map() reports them (the GUI draws these)
FREE, OBJECT, LEASED_OBJECT, PENDING, QUARANTINED = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class Watermarks:
    """Fractions of pages that are FREE; below each one the pool is under that pressure."""

    soft_free: float = 0.20
    hard_free: float = 0.10
    critical_free: float = 0.05
    target_free: float = 0.30   # what evict_to_target restores

    def __post_init__(self) -> None:
        if not 0 <= self.critical_free <= self.hard_free <= self.soft_free <= self.target_free <= 1:
            raise ValueError(f"watermarks must satisfy 0 <= critical <= hard <= soft <= target <= 1, got {self}")

    def level(self, free_ratio: float) -> PressureLevel:
        return pressure_level(free_ratio, soft=self.soft_free, hard=self.hard_free, critical=self.critical_free)


class PageTable:
    def __init__(self, n_pages: int) -> None:
        self.total = n_pages
        self.state = np.zeros(n_pages, dtype=np.uint8)   # FREE / OBJECT / PENDING / QUARANTINED
        self.holds = np.zeros(n_pages, dtype=np.int64)   # zombie leases still naming each page

    def count(self, state: int) -> int:
        return int(np.count_nonzero(self.state == state))

    def counts(self) -> list[int]:
        """Pages per state, indexed by the state constants."""
        return np.bincount(self.state, minlength=QUARANTINED + 1).tolist()

    def mark(self, pages, state: int) -> None:
        self.state[pages] = state

    def allocate(self, n: int) -> list[int] | None:
        """n free pages: the shortest free run that holds them all (lowest first on a tie), else pieces of runs."""
        free = np.flatnonzero(self.state == FREE)
        if len(free) < n:
            return None
        breaks = np.flatnonzero(np.diff(free) != 1) + 1
        starts = np.concatenate(([0], breaks))
        lengths = np.diff(np.concatenate((starts, [len(free)])))
        fitting = np.flatnonzero(lengths >= n)
        if fitting.size:
            best = fitting[np.argmin(lengths[fitting])]
            first = int(free[starts[best]])
            return list(range(first, first + n))
        pages: list[int] = []
        for run in np.argsort(lengths, kind="stable"):
            pages += free[starts[run]:starts[run] + lengths[run]][:n - len(pages)].tolist()
            if len(pages) == n:
                return pages
        raise AssertionError("free pages counted but not found")

    def release(self, pages) -> None:
        """Pages leave an object or a write: free, or quarantined while a zombie lease still names them."""
        self.state[pages] = np.where(self.holds[pages] > 0, QUARANTINED, FREE)

    def hold(self, pages, quarantine: bool) -> None:
        """A lease became a zombie; a dead write's pages go to quarantine at once."""
        np.add.at(self.holds, pages, 1)
        if quarantine:
            self.state[pages] = QUARANTINED

    def unhold(self, pages) -> None:
        """A zombie lease ended: quarantined pages nobody names any more are free again."""
        np.add.at(self.holds, pages, -1)
        released = [p for p in pages if self.holds[p] == 0 and self.state[p] == QUARANTINED]
        self.state[released] = FREE
