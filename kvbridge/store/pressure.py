"""Pressure levels from a free fraction and watermarks: the one rule the cache server's page pool
and the scheduler's KV budget both apply.

Below each watermark (a fraction of the capacity that is free) a budget is under that level of
pressure; each user decides what the levels mean for it (the pool evicts and refuses low-priority
writes, the scheduler evicts cold prefixes, stops admitting and preempts).
"""
from __future__ import annotations

import enum


class PressureLevel(enum.IntEnum):
    OK = 0
    SOFT = 1
    HARD = 2
    CRITICAL = 3


def pressure_level(free_ratio: float, *, soft: float, hard: float, critical: float) -> PressureLevel:
    """The level for `free_ratio` (0..1 of the capacity free) against watermarks critical <= hard <= soft."""
    if free_ratio < critical:
        return PressureLevel.CRITICAL
    if free_ratio < hard:
        return PressureLevel.HARD
    if free_ratio < soft:
        return PressureLevel.SOFT
    return PressureLevel.OK
