"""The KV budget in blocks: which cells of llama.cpp's unified cache each sequence holds, and who shares them.

llama.cpp keeps the real cells; this ledger is the scheduler's account of them, in blocks of
KVB_SCHED_BLOCK_TOKENS cells (the walk-through's pages). Cells are made in *extents*: the run of
positions one sequence prefilled or decoded itself. A sequence that shares a prefix (llama.cpp's
`seq_cp`) holds the first k cells of each extent along that prefix, never a copy. Since sharing
always takes a prefix, an extent's live cells are its first max(k) over its holders, and its blocks
are those cells rounded up to whole blocks (the last block of an extent may be partly empty, as a
page is). A block's reference count is the number of sequences holding its extent.

Deliberately left out: llama.cpp's physical cell placement (it may fragment; the scheduler treats a
refused decode as pressure) and copy-on-write (a shared prefix is never written again: positions
only grow).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from kvbridge.store.pressure import PressureLevel, pressure_level

# How short the budget is, from free blocks against the watermarks (free fractions), by the store's
# one rule: SOFT evicts cold cached prefixes, HARD also stops admitting, CRITICAL also preempts.
Pressure = PressureLevel


@dataclass
class Extent:
    """Cells one sequence made itself; `holders` maps each holder to how many of its first cells it uses."""

    id: int
    owner: str                                   # who made it: "req-7", "prefix-2" (for the block map)
    holders: dict[str, int] = field(default_factory=dict)

    @property
    def cells(self) -> int:
        return max(self.holders.values(), default=0)


@dataclass
class Holding:
    """What one sequence holds: (extent, cells used) in position order; its length is the sum."""

    holder: str
    path: list[list] = field(default_factory=list)   # [[Extent, k], ...]

    @property
    def n_tokens(self) -> int:
        return sum(k for _, k in self.path)


class BlockLedger:
    """Blocks per extent, free blocks, pressure; not thread-safe (the scheduler's loop owns it)."""

    def __init__(self, total_cells: int, block_tokens: int, soft: float, hard: float, critical: float) -> None:
        self.block_tokens = max(1, int(block_tokens))
        self.total_blocks = max(1, int(total_cells) // self.block_tokens)
        self.soft, self.hard, self.critical = soft, hard, critical
        self._extents: dict[int, Extent] = {}
        self._ids = itertools.count(1)

    # -- holdings ---------------------------------------------------------------------------------
    def share(self, source: Holding, holder: str, n_tokens: int) -> Holding:
        """A new holding of the first n_tokens of `source` (the cells llama.cpp's seq_cp shares)."""
        held = Holding(holder)
        left = n_tokens
        for extent, k in source.path:
            if left <= 0:
                break
            take = min(k, left)
            extent.holders[holder] = max(extent.holders.get(holder, 0), take)
            held.path.append([extent, take])
            left -= take
        return held

    def grow(self, held: Holding, n_new: int, owner: str) -> None:
        """n_new cells appended to the holding (a prefill or a decode step of its own)."""
        if n_new <= 0:
            return
        last = held.path[-1] if held.path else None
        if last is not None and last[0].owner == owner and last[1] == last[0].cells \
                and set(last[0].holders) == {held.holder}:
            last[1] += n_new                      # still the only one writing this extent
            last[0].holders[held.holder] = last[1]
            return
        extent = Extent(next(self._ids), owner, {held.holder: n_new})
        self._extents[extent.id] = extent
        held.path.append([extent, n_new])

    def release(self, held: Holding) -> None:
        """The holding's cells are gone from its sequence (seq_rm); extents nobody holds are freed."""
        for extent, _ in held.path:
            extent.holders.pop(held.holder, None)
            if not extent.holders:
                self._extents.pop(extent.id, None)
        held.path = []

    # -- numbers ----------------------------------------------------------------------------------
    def blocks_for(self, n_cells: int) -> int:
        return math.ceil(n_cells / self.block_tokens) if n_cells > 0 else 0

    def used_blocks(self) -> int:
        return sum(self.blocks_for(extent.cells) for extent in self._extents.values())

    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks()

    def grow_cost(self, held: Holding | None, n_new: int, owner: str) -> int:
        """Blocks that appending n_new cells would take (the last block of an own extent may have room)."""
        if held is not None and held.path:
            extent, k = held.path[-1]
            if extent.owner == owner and k == extent.cells and set(extent.holders) == {held.holder}:
                return self.blocks_for(k + n_new) - self.blocks_for(k)
        return self.blocks_for(n_new)

    def pressure(self, extra_blocks: int = 0) -> Pressure:
        """The level now, or after taking `extra_blocks` more."""
        free = (self.free_blocks() - extra_blocks) / self.total_blocks
        return pressure_level(free, soft=self.soft, hard=self.hard, critical=self.critical)

    def snapshot(self) -> dict:
        """Blocks by owner, the shared extents with their reference counts, and every extent in the order
        it was made (the lab's block map)."""
        by_owner: dict[str, int] = {}
        shared, extents = [], []
        for extent in sorted(self._extents.values(), key=lambda e: e.id):
            blocks = self.blocks_for(extent.cells)
            by_owner[extent.owner] = by_owner.get(extent.owner, 0) + blocks
            extents.append({"owner": extent.owner, "blocks": blocks, "cells": extent.cells,
                            "holders": sorted(extent.holders)})
            if len(extent.holders) > 1:
                shared.append({"owner": extent.owner, "blocks": blocks, "refs": len(extent.holders),
                               "holders": sorted(extent.holders)})
        used = sum(by_owner.values())
        return {"total": self.total_blocks, "used": used, "free": self.total_blocks - used,
                "block_tokens": self.block_tokens, "by_owner": by_owner, "shared": shared, "extents": extents,
                "refs": sum(len(extent.holders) for extent in self._extents.values())}
