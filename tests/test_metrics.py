"""Metrics: summaries checked against hand-computed figures, hit rates, thread safety."""
from __future__ import annotations

import json
import math
import threading

import pytest

from kvbridge.engine.metrics import Metrics, percentile, summarize


def test_summary_of_known_series():
    metrics = Metrics()
    for ms in (10, 20, 30, 40, 100):
        metrics.record("ttft_ms", ms)
    summary = metrics.summary("ttft_ms")
    assert summary["count"] == 5
    assert summary["mean"] == 40.0
    assert summary["median"] == 30.0
    # p95 by linear interpolation: rank 0.95 * 4 = 3.8 -> 40 + 0.8 * (100 - 40) = 88
    assert summary["p95"] == pytest.approx(88.0)
    assert (summary["min"], summary["max"]) == (10.0, 100.0)


def test_even_count_median_and_percentile_edges():
    assert summarize([4, 1, 3, 2])["median"] == 2.5
    assert percentile([7], 95) == 7
    assert percentile([1, 2, 3], 0) == 1 and percentile([1, 2, 3], 100) == 3
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_empty_series_is_nan_not_an_error():
    summary = Metrics().summary("restore_ms")
    assert summary["count"] == 0 and math.isnan(summary["mean"]) and math.isnan(summary["p95"])


def test_hit_rates_per_tier_from_counters():
    metrics = Metrics()
    metrics.inc("hits_L1", 6)
    metrics.inc("hits_L2", 2)
    metrics.inc("misses", 2)
    assert metrics.hit_rates() == {"L1": 0.6, "L2": 0.2}
    assert Metrics().hit_rates() == {}


def test_snapshot_is_plain_data():
    metrics = Metrics()
    metrics.inc("requests")
    metrics.record("prefill_ms", 5.0)
    snapshot = metrics.snapshot()
    assert snapshot["counters"] == {"requests": 1}
    assert snapshot["series"]["prefill_ms"]["mean"] == 5.0
    json.dumps(snapshot)
    metrics.reset()
    assert metrics.snapshot() == {"counters": {}, "series": {}, "hit_rates": {}}


def test_counters_and_series_are_thread_safe():
    metrics = Metrics()

    def work() -> None:
        for i in range(2000):
            metrics.inc("requests")
            metrics.record("ttft_ms", i)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert metrics.count("requests") == 8000 and metrics.summary("ttft_ms")["count"] == 8000
