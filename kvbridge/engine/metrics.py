"""Counters and latency series, recorded in one place (the engine) and read by the GUI, CLI and bench.

Series are kept whole (a testbed run is thousands of requests, not millions), so the median and
p95 are exact. Deliberately left out: histograms, time windows, exporters (serve and the cache server
export their own Prometheus series; Docs/Prometheus.md).

Why prompts were recomputed is counted per request (the record's miss_reason, kvbridge.engine.misses) and in
prompt tokens; restored tokens are counted by the tier they came from (the record's hit_tiers), so a per-tier
hit rate is hit tokens of that tier over prompt tokens (`tier_hit_rates()`), the same ratio the Prometheus
recording rules compute (deploy/prometheus/rules.yml).
"""
from __future__ import annotations

import math
import threading
from collections import Counter, defaultdict
from typing import Iterable

HIT_PREFIX = "hits_"   # counters named "hits_L1", "hits_L2" ... (the engine's names) feed hit_rates()
MISS_COUNTER = "misses"
# lmcache requests, in prompt tokens: the engine counts these in CachedEngine._record_metrics
PROMPT_TOKENS = "prompt_tokens"          # prompt tokens of lmcache requests: tier_hit_rates()' denominator
HIT_TOKENS_PREFIX = "hit_tokens_"        # restored tokens by tier: "hit_tokens_L1", "hit_tokens_L2", ...
# every request with a cause (kvbridge.engine.misses.MISS_REASONS), a cold run's "cold" included
MISS_REASON_PREFIX = "miss_reason_"      # requests by cause: "miss_reason_evicted"
MISS_TOKENS_PREFIX = "miss_tokens_"      # the prompt tokens those requests computed instead: "miss_tokens_evicted"


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

    def tier_hit_rates(self) -> dict[str, float]:
        """{tier: restored tokens from that tier / prompt tokens} over lmcache requests ({} before any).

        The shares add up to the token hit rate; the rest of the prompt was computed (see `miss_reasons()`).
        """
        with self._lock:
            prompt = self._counters[PROMPT_TOKENS]
            hits = {name[len(HIT_TOKENS_PREFIX):]: n for name, n in self._counters.items()
                    if name.startswith(HIT_TOKENS_PREFIX)}
        if not prompt:
            return {}
        return {tier: n / prompt for tier, n in sorted(hits.items())}

    def miss_reasons(self) -> dict[str, dict[str, int]]:
        """{reason: {"requests": n, "tokens": prompt tokens computed}} for every cause counted so far."""
        with self._lock:
            out: dict[str, dict[str, int]] = {}
            for name, n in self._counters.items():
                if name.startswith(MISS_REASON_PREFIX):
                    out.setdefault(name[len(MISS_REASON_PREFIX):], {"requests": 0, "tokens": 0})["requests"] = n
                elif name.startswith(MISS_TOKENS_PREFIX):
                    out.setdefault(name[len(MISS_TOKENS_PREFIX):], {"requests": 0, "tokens": 0})["tokens"] = n
        return dict(sorted(out.items()))

    def reset(self) -> None:
        with self._lock:
            self._counters.clear()
            self._series.clear()

    def snapshot(self) -> dict:
        """Plain data: {"counters", "series": {name: summary}, "hit_rates", "tier_hit_rates", "miss_reasons"}."""
        with self._lock:
            counters = dict(self._counters)
            series = {name: list(values) for name, values in self._series.items()}
        return {
            "counters": counters,
            "series": {name: summarize(values) for name, values in series.items()},
            "hit_rates": self.hit_rates(),
            "tier_hit_rates": self.tier_hit_rates(),
            "miss_reasons": self.miss_reasons(),
        }
