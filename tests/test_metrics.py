"""Metrics: summaries checked against hand-computed figures, hit rates, thread safety."""
from __future__ import annotations

import json
import math
import threading

import pytest

from conftest import needs_model
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


def test_tier_hit_rates_are_restored_tokens_over_prompt_tokens():
    metrics = Metrics()
    metrics.inc("prompt_tokens", 1000)
    metrics.inc("hit_tokens_L1", 256)
    metrics.inc("hit_tokens_L2", 96)
    metrics.inc("miss_reason_evicted", 2)
    metrics.inc("miss_tokens_evicted", 648)
    assert metrics.tier_hit_rates() == {"L1": 0.256, "L2": 0.096}
    assert metrics.miss_reasons() == {"evicted": {"requests": 2, "tokens": 648}}
    assert Metrics().tier_hit_rates() == {} and Metrics().miss_reasons() == {}


@needs_model
def test_an_engine_counts_a_miss_by_reason_and_a_hit_by_tier(make_settings):
    """The real model on the embedded store: a cold run, a first lmcache run (nothing stored: none_stored) and
    the same prompt again (restored from L1). The GUI's per-tier hit rate is over lmcache requests only."""
    from kvbridge.backends import make_backend
    from kvbridge.engine.cached_engine import CachedEngine

    settings = make_settings()
    prompt = "The lighthouse keeper logs every lamp check. " * 12 + "Which lamp was checked last?"
    with CachedEngine(settings, make_backend("llamacpp", settings)).start() as engine:
        cold = engine.infer(prompt, mode="cold", n_predict=2)
        miss = engine.infer(prompt, mode="lmcache", n_predict=2)
        hit = engine.infer(prompt, mode="lmcache", n_predict=2)
        metrics = engine.metrics
    assert (cold.miss_reason, miss.miss_reason, hit.miss_reason, hit.tier) == ("cold", "none_stored", "", "L1")
    assert hit.matched_tokens >= 32
    assert metrics.tier_hit_rates() == {"L1": hit.matched_tokens / (miss.prompt_tokens + hit.prompt_tokens)}
    assert metrics.miss_reasons() == {"cold": {"requests": 1, "tokens": cold.prompt_tokens},
                                      "none_stored": {"requests": 1, "tokens": miss.prompt_tokens}}
    assert metrics.snapshot()["tier_hit_rates"] == metrics.tier_hit_rates()


def test_snapshot_is_plain_data():
    metrics = Metrics()
    metrics.inc("requests")
    metrics.record("prefill_ms", 5.0)
    snapshot = metrics.snapshot()
    assert snapshot["counters"] == {"requests": 1}
    assert snapshot["series"]["prefill_ms"]["mean"] == 5.0
    json.dumps(snapshot)
    metrics.reset()
    assert metrics.snapshot() == {"counters": {}, "series": {}, "hit_rates": {}, "tier_hit_rates": {},
                                  "miss_reasons": {}}


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
