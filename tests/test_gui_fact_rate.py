"""The results tab's fact rate against TTFT: records made by hand, no model. One point per mode at its mean TTFT
and its share of answers stating the expected fact; the plot is built and shown only for a run that judged facts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbridge.engine.records import RequestRecord
from kvbridge.gui import charts
from kvbridge.gui import handlers as h
from kvbridge.gui import results as r
from kvbridge.settings import Settings

FACT = "the Kessel Tunnel"


def rag(mode: str, index: int, ttft: float, right: bool, **extra) -> RequestRecord:
    text = f"The longest tunnel is {FACT}." if right else "I could not find it in the passages."
    return RequestRecord(mode=mode, request_index=index, ttft_ms=ttft, text=text, expected=FACT,
                         scenario="rag", label=f"Q{index}", **extra)


@pytest.fixture
def rag_records() -> list[RequestRecord]:
    # cold: 2/2 at mean 1000 ms; lmcache: 2/2 at mean 100 ms; blend: 1/2 at mean 40 ms
    return [
        rag("cold", 1, 900.0, True), rag("cold", 2, 1100.0, True),
        rag("lmcache", 1, 150.0, True), rag("lmcache", 2, 50.0, True),
        rag("blend", 1, 30.0, True), rag("blend", 2, 50.0, False),
    ]


def points(fig) -> dict[str, tuple[float, float, str]]:
    return {t.name: (t.x[0], t.y[0], t.text[0]) for t in fig.data}


def test_one_point_per_mode_at_its_mean_ttft_and_fact_share(rag_records):
    fig = charts.fact_rate_figure(rag_records)
    assert [t.name for t in fig.data] == ["cold", "lmcache", "blend"]
    assert all(len(t.x) == len(t.y) == 1 for t in fig.data)
    got = points(fig)
    assert got["cold"][:2] == pytest.approx((1000.0, 100.0))
    assert got["lmcache"][:2] == pytest.approx((100.0, 100.0))
    assert got["blend"][:2] == pytest.approx((40.0, 50.0))
    assert [label for *_, label in got.values()] == ["cold 2/2", "lmcache 2/2", "blend 1/2"]
    assert fig.layout.xaxis.type == "log"
    assert tuple(fig.layout.yaxis.range)[0] == 0 and tuple(fig.layout.yaxis.range)[1] >= 100
    assert "up and left is better" in fig.layout.title.text
    assert fig.data[0].marker.color == charts.MODE_COLORS["cold"]
    assert fig.data[1].marker.color == charts.MODE_COLORS["lmcache"]
    json.loads(fig.to_json())


def test_failed_and_unjudged_records_are_left_out(rag_records):
    rag_records += [rag("blend", 3, 5.0, False, error="engine died"),            # failed: neither point nor time
                    RequestRecord(mode="blend", request_index=4, ttft_ms=1.0, text="x")]   # no expected fact
    got = points(charts.fact_rate_figure(rag_records))
    assert got["blend"][:2] == pytest.approx((40.0, 50.0)) and got["blend"][2] == "blend 1/2"


def test_records_without_expected_give_the_empty_figure():
    plain = [RequestRecord(mode="cold", request_index=1, ttft_ms=900.0, text="an answer"),
             RequestRecord(mode="lmcache", request_index=1, ttft_ms=60.0, text="an answer")]
    for records in ([], plain, [rag("cold", 1, 900.0, True, error="boom")]):
        fig = charts.fact_rate_figure(records)
        assert not fig.data
        assert "rag" in fig.layout.annotations[0].text and fig.layout.annotations[0].text == charts.FACTS_HINT
    assert "facts" not in charts.run_figures(plain)


def test_run_figures_include_the_fact_rate_for_a_run_that_judged_facts(rag_records):
    figures = charts.run_figures(rag_records)
    assert "facts" in figures and [t.name for t in figures["facts"].data] == ["cold", "lmcache", "blend"]
    assert {"speedup", "ttft_per_request", "stages", "ttft_summary", "hits"} <= set(figures)


def small_state(tmp_path: Path) -> h.AppState:
    (tmp_path / "input").mkdir(exist_ok=True)
    env = {"KVB_L2_DIR": str(tmp_path / "l2"), "KVB_INPUT_DIR": str(tmp_path / "input"),
           "KVB_OUTPUT_DIR": str(tmp_path / "out"), "KVB_L1_BYTES": "64MiB", "KVB_L2_BYTES": "128MiB"}
    return h.AppState(Settings.from_env(env=env, env_file=None), env_path=tmp_path / ".env")


def test_results_view_has_the_figure_and_shows_it_only_when_facts_were_judged(tmp_path, rag_records):
    state = small_state(tmp_path)
    state.records = rag_records
    view = r.results_view(state)
    assert view.has_facts and "facts" in view.figures
    assert "facts" in r.build_figures(state, rag_records)
    assert "2/2" in view.summary and "1/2" in view.summary   # the summary's column says the same
    state.records = [RequestRecord(mode="cold", request_index=1, ttft_ms=900.0, text="an answer")]
    view = r.results_view(state)
    assert not view.has_facts and "facts" not in view.figures


def test_the_page_shows_the_fact_plot_only_for_a_run_that_judged_facts(tmp_path, rag_records):
    """The results outputs carry the fact plot in its place: on_open (a page load) updates it visible for a rag
    run and hidden otherwise, and every other output keeps its position."""
    from kvbridge.gui.app import build_app

    state = small_state(tmp_path)
    demo = build_app(state.settings, state)
    by_id = {b.elem_id: b for b in demo.blocks.values() if getattr(b, "elem_id", None)}
    facts_plot = by_id["kvb-plot-facts"]
    assert facts_plot.visible is False
    load = next(f for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "on_open")
    outputs = [getattr(o, "elem_id", None) for o in load.outputs]
    shadow_at = outputs.index("kvb-plot-shadow")
    assert outputs[shadow_at + 1] == "kvb-plot-facts" and outputs[shadow_at + 2] == "kvb-results-table"

    def shown_values() -> list:
        values = next(load.fn())
        assert len(values) == len(load.outputs)
        return values

    state.records = rag_records
    update = shown_values()[shadow_at + 1]
    assert update["visible"] is True and [t.name for t in update["value"].data] == ["cold", "lmcache", "blend"]
    state.records = [RequestRecord(mode="cold", request_index=1, ttft_ms=900.0, text="an answer")]
    values = shown_values()
    assert values[shadow_at + 1]["visible"] is False
    assert isinstance(values[shadow_at + 2], dict) and values[shadow_at + 2]["data"]   # the table, still next
