"""Counters and latency series, recorded in one place (the engine) and read by the GUI, CLI and bench.

Series are kept whole (a testbed run is thousands of requests, not millions), so the median and
p95 are exact. Deliberately left out: histograms, time windows, exporters (Prometheus etc.).
"""
from __future__ import annotations

import math
import threading
from collections import Counter, defaultdict
from typing import Iterable

HIT_PREFIX = "hits_"   # counters named "hits_L1", "hits_L2" ... (the engine's names) feed hit_rates()
MISS_COUNTER = "misses"


def percentile(values: Iterable[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); q in [0, 100]; NaN when empty."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must lie in [0, 100], got {q}")
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Iterable[float]) -> dict[str, float]:
    """count, mean, median, p95, min, max of one series (NaN figures when it is empty)."""
    ordered = sorted(values)
    if not ordered:
        return {"count": 0, "mean": math.nan, "median": math.nan, "p95": math.nan,
                "min": math.nan, "max": math.nan}
    return {
        "count": len(ordered),
        "mean": sum(ordered) / len(ordered),
        "median": percentile(ordered, 50.0),
        "p95": percentile(ordered, 95.0),
        "min": ordered[0],
        "max": ordered[-1],
    }


class Metrics:
    """Thread-safe counters (`inc`) and millisecond series (`record`), e.g. "ttft_ms", "restore_ms"."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self._series: defaultdict[str, list[float]] = defaultdict(list)

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def record(self, name: str, ms: float) -> None:
        with self._lock:
            self._series[name].append(float(ms))

    def count(self, name: str) -> int:
        with self._lock:
            return self._counters[name]

    def series(self, name: str) -> list[float]:
        with self._lock:
            return list(self._series.get(name, ()))

    def summary(self, name: str) -> dict[str, float]:
        return summarize(self.series(name))

    def hit_rates(self) -> dict[str, float]:
        """Share of lookups served by each tier, from counters "hits_<tier>" and "misses"."""
        with self._lock:
            hits = {name[len(HIT_PREFIX):]: n for name, n in self._counters.items() if name.startswith(HIT_PREFIX)}
            total = sum(hits.values()) + self._counters[MISS_COUNTER]
        return {tier: (n / total if total else 0.0) for tier, n in sorted(hits.items())}

    def reset(self) -> None:
        with self._lock:
            self._counters.clear()
            self._series.clear()

    def snapshot(self) -> dict:
        """Plain data: {"counters": {...}, "series": {name: summary}, "hit_rates": {...}}."""
        with self._lock:
            counters = dict(self._counters)
            series = {name: list(values) for name, values in self._series.items()}
        return {
            "counters": counters,
            "series": {name: summarize(values) for name, values in series.items()},
            "hit_rates": self.hit_rates(),
        }
