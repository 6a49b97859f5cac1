"""Charts: hand-computed summaries, one trace per mode, the store figure from a real TieredStore's stats."""
from __future__ import annotations

import json

import pytest

from kvbridge.gui import charts
from kvbridge.settings import Settings
from kvbridge.engine.records import RequestRecord
from kvbridge.store import ObjectMeta, TieredStore
from kvbridge.engine.hashing import tokens_digest


def rec(mode: str, index: int, ttft: float, tier: str = "none", **extra) -> RequestRecord:
    return RequestRecord(mode=mode, request_index=index, ttft_ms=ttft, tier=tier, engine="llamacpp",
                         kv_mode=extra.pop("kv_mode", "full"), label=f"Q{index}", prompt_tokens=400, **extra)


@pytest.fixture
def run_records() -> list[RequestRecord]:
    # cold: mean 1100, median 1100; lmcache: mean 360, median 50; native: mean 400, median 100
    return [
        rec("cold", 1, 1000), rec("cold", 2, 1200), rec("cold", 3, 1100),
        rec("native", 1, 1000), rec("native", 2, 100), rec("native", 3, 100),
        rec("lmcache", 1, 1000), rec("lmcache", 2, 50, "L1", matched_tokens=384),
        rec("lmcache", 3, 30, "L2", matched_tokens=384, notes="approx"),
    ]


def test_mode_summaries_hand_computed(run_records):
    by_mode = {s.mode: s for s in charts.mode_summaries(run_records)}
    assert list(by_mode) == ["cold", "native", "lmcache"]
    assert by_mode["cold"].speedup_mean == pytest.approx(1.0)
    lm = by_mode["lmcache"]
    assert lm.mean_ttft_ms == pytest.approx(360.0)
    assert lm.median_ttft_ms == pytest.approx(50.0)
    assert lm.speedup_mean == pytest.approx(1100 / 360)
    assert lm.speedup_median == pytest.approx(22.0)
    assert (lm.hits, lm.misses) == ({"L1": 1, "L2": 1}, 1)
    assert by_mode["native"].speedup_median == pytest.approx(11.0)


def test_failed_requests_are_left_out_of_timings(run_records):
    run_records.append(rec("lmcache", 4, 0.0, error="engine unreachable"))
    lm = {s.mode: s for s in charts.mode_summaries(run_records)}["lmcache"]
    assert lm.requests == 3 and lm.mean_ttft_ms == pytest.approx(360.0)


def test_no_cold_run_means_no_speedup():
    summaries = charts.mode_summaries([rec("lmcache", 1, 100)])
    assert summaries[0].speedup_mean is None
    fig = charts.speedup_figure([rec("lmcache", 1, 100)])
    assert "cold mode too" in fig.layout.annotations[0].text


def test_ttft_per_request_one_trace_per_mode(run_records):
    fig = charts.ttft_per_request_figure(run_records)
    assert [t.name for t in fig.data] == ["cold", "native", "lmcache"]
    lm = fig.data[2]
    assert list(lm.x) == [1, 2, 3] and list(lm.y) == [1000, 50, 30]
    assert lm.marker.color == charts.MODE_COLORS["lmcache"]
    assert fig.layout.yaxis.type == "log"


def test_speedup_figure_labels_bars(run_records):
    fig = charts.speedup_figure(run_records)
    assert [t.name for t in fig.data] == ["native", "lmcache"]  # cold is the baseline, not a bar
    lmcache = fig.data[1]
    assert list(lmcache.x) == ["mean TTFT", "median TTFT"]
    assert list(lmcache.text) == [f"{1100 / 360:.1f}×", "22.0×"]
    assert lmcache.marker.color == charts.MODE_COLORS["lmcache"]


def test_hits_figure_stacks_tiers(run_records):
    fig = charts.hits_figure(run_records)
    counts = {t.name: list(t.y) for t in fig.data}
    assert counts["hit from L1"] == [0, 0, 1]
    assert counts["hit from L2"] == [0, 0, 1]
    assert counts[charts.MISS_LABEL] == [3, 3, 1]


def test_tiers_and_their_order_come_from_the_store(run_records):
    """No tier table in the charts: a tier the store lists (here a remote L3) gets its bar, in the store's order."""
    run_records.append(rec("lmcache", 4, 40, "L3", matched_tokens=384))
    fig = charts.hits_figure(run_records, ["L1", "L2", "L3"])
    assert [t.name for t in fig.data] == ["hit from L1", "hit from L2", "hit from L3", charts.MISS_LABEL]
    assert len({t.marker.color for t in fig.data}) == 4
    lm = {s.mode: s for s in charts.mode_summaries(run_records, ["L1", "L2", "L3"])}["lmcache"]
    assert lm.hits == {"L1": 1, "L2": 1, "L3": 1} and lm.misses == 1


def test_shadow_figure_only_for_shadow_engines(run_records):
    assert "shadow" not in charts.run_figures(run_records)
    shadow = [rec("lmcache", 1, 80, kv_mode="shadow", predicted_reuse_tokens=256, engine_cached_tokens=250),
              rec("lmcache", 2, 70, kv_mode="shadow", predicted_reuse_tokens=256, engine_cached_tokens=None)]
    fig = charts.run_figures(shadow)["shadow"]
    assert list(fig.data[0].y) == [256, 256]
    assert list(fig.data[1].y) == [250, 0]
    assert list(fig.data[1].text) == ["", "not reported"]


def test_stages_figure_stacks_each_warm_request_by_stage():
    warm = [rec("native", 1, 60, prefill_ms=50, first_token_ms=1, tokenize_ms=1),
            rec("lmcache", 1, 75, "L1", matched_tokens=384, prefill_ms=50, first_token_ms=1, tokenize_ms=1,
                lookup_ms=2, fetch_ms=6, assemble_ms=8, handoff_ms=5),
            rec("cold", 1, 900, prefill_ms=899)]
    fig = charts.stages_figure(warm)
    traces = {t.name: list(t.y) for t in fig.data}
    assert fig.layout.barmode == "stack" and list(fig.data[0].x) == ["#1 native", "#1 lmcache"]   # no cold bar
    assert traces["suffix prefill"] == [50, 50] and traces["assemble"] == [0, 8] and traces["hand to engine"] == [0, 5]
    assert traces["other"] == [8, 2]     # what no stage accounts for
    assert "reset cache" not in traces   # a stage no request spent time in gets no legend entry


def test_empty_records_give_hint_figures():
    for name, fig in charts.run_figures([]).items():
        assert fig.layout.annotations[0].text == charts.EMPTY_HINT, name


def test_figures_serialise(run_records):
    for fig in charts.run_figures(run_records).values():
        json.loads(fig.to_json())


def test_store_figure_from_real_store_stats(tmp_path):
    settings = Settings(l2_dir=str(tmp_path / "l2"), l1_bytes=1 << 20, l2_bytes=4 << 20)
    store = TieredStore.from_settings(settings, namespace="test")
    try:
        meta = ObjectMeta(namespace="test", n_tokens=4, tokens_digest=tokens_digest([1, 2, 3, 4]))
        assert store.put(b"k" * 32, b"x" * 300_000, meta)
        stats = store.stats()
    finally:
        store.close()
    usages = {u.name: u for u in charts.tier_usages(stats)}
    assert usages["L1"].objects == 1 and usages["L1"].bytes_used == 300_000 and usages["L1"].capacity == 1 << 20
    assert usages["L2"].capacity == 4 << 20
    fig = charts.store_figure(stats)
    assert list(fig.data[0].y) == ["L1", "L2"]
    assert "1 objects" in fig.data[0].text[0]
    assert fig.data[0].x[0] == pytest.approx(100 * 300_000 / (1 << 20))
    assert "connect" in charts.store_figure(None).layout.annotations[0].text.lower()


@pytest.mark.parametrize("n, text", [(512, "512 B"), (1536, "1.5 KiB"), (3 << 20, "3.0 MiB"), (5 << 30, "5.0 GiB")])
def test_format_bytes(n, text):
    assert charts.format_bytes(n) == text
