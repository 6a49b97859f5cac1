"""The GUI's side of every miss explained: the results table's "why" column, the free prompt's "why not more",
the store panel's per-tier hit-rate chart and its recent evictions.

The first half needs no engine (records built by hand); the `live` half connects the real embedded engine with
an L1 too small for the document and no L2, so a repeated prompt misses because its chunks were evicted.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import needs_model
from kvbridge.engine.records import RequestRecord
from kvbridge.gui import handlers as h
from kvbridge.gui import results as r
from kvbridge.gui import store_panel as sp
from kvbridge.gui.charts import tier_hit_rate_figure, tier_hit_rates_from_records
from kvbridge.settings import Settings

DOC = "# Garden rota\n\n" + " ".join(
    f"Rule {i}: the {['north', 'south', 'east', 'west'][i % 4]} bed is watered on day {i % 7}." for i in range(16))
SHORT = "The rota has one gardener per bed and one spare for the rainy days of the week."


def records() -> list[RequestRecord]:
    return [RequestRecord(mode="cold", request_index=1, prompt_tokens=128, miss_reason="cold",
                          miss_detail="the request ran in cold mode: nothing is restored by design"),
            RequestRecord(mode="lmcache", request_index=1, prompt_tokens=128, matched_tokens=96, tier="L2",
                          hit_tiers="L1=64 L2=32", miss_reason="diverged",
                          miss_detail="the prompt diverges from a stored prompt at token 96"),
            RequestRecord(mode="lmcache", request_index=2, prompt_tokens=72, miss_reason="none_stored",
                          miss_detail="from token 0 of 72: nothing is stored under this prompt's first chunk")]


def test_the_table_says_why_beside_the_reuse_and_the_detail_beside_the_notes():
    table = r.records_table(records())
    headers = table["headers"]
    assert headers.index("why") == headers.index("prompt_tokens") + 1
    assert headers.index("why (detail)") == headers.index("notes") + 1
    assert "miss_reason" not in headers and r.column_field("why") == "miss_reason"
    rows = [dict(zip(headers, row)) for row in table["data"]]
    assert [row["why"] for row in rows] == ["cold", "diverged", "none_stored"]
    assert rows[1]["why (detail)"] == "the prompt diverges from a stored prompt at token 96"
    assert rows[1]["hit_tiers"] == "L1=64 L2=32"


def test_the_hit_rate_per_tier_counts_lmcache_prompt_tokens_only():
    """(64 + 0) / (128 + 72) from L1, 32 / 200 from L2; the cold request is not part of it."""
    rates = tier_hit_rates_from_records(records())
    assert rates == {"L1": 64 / 200, "L2": 32 / 200}
    fig = tier_hit_rate_figure(rates, ["L1", "L2", "L3"])
    bars = fig.data[0]
    assert list(bars.y) == ["L1", "L2", "computed"] and [round(x, 1) for x in bars.x] == [32.0, 16.0, 52.0]
    assert list(bars.text) == ["32.0 %", "16.0 %", "52.0 %"]
    assert "Hit rate per tier" in fig.layout.title.text
    empty = tier_hit_rate_figure({})
    assert not empty.data and "lmcache mode" in empty.layout.annotations[0].text


def test_before_connect_no_rates_and_no_eviction_list(tmp_path):
    state = h.AppState(Settings.from_env(env={"KVB_L2_DIR": str(tmp_path / "l2")}, env_file=None))
    assert sp.tier_hit_rates(state) == {} and sp.evictions_markdown(state) is None


def test_the_page_builds_with_the_hit_rate_chart_and_the_hidden_eviction_list(tmp_path):
    from kvbridge.gui.app import build_app

    state = h.AppState(Settings.from_env(env={"KVB_L2_DIR": str(tmp_path / "l2")}, env_file=None))
    blocks = {getattr(b, "elem_id", None): b for b in build_app(state.settings, state).blocks.values()}
    assert "kvb-plot-tier-hit-rate" in blocks
    assert blocks["kvb-evictions"].visible is False   # no store yet: nothing to list


# -- live: the real engine, an L1 that holds a few chunks, no L2 -----------------------------------------
@pytest.fixture(scope="module")
def evicting_state(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gui-misses")
    (tmp / "input").mkdir()
    # 32 tokens of SmolLM2 KV are ~0.7 MiB: a 3 MiB L1 keeps the last few chunks of the document, never its start
    settings = Settings.from_env(env={"KVB_L2_DIR": str(tmp / "l2"), "KVB_L2_ENABLED": "false", "KVB_L1_BYTES": "3MiB",
                                      "KVB_CHUNK_SIZE": "32", "KVB_N_PREDICT": "4", "KVB_CTX_SIZE": "1024",
                                      "KVB_INPUT_DIR": str(tmp / "input"), "KVB_OUTPUT_DIR": str(tmp / "out")},
                                 env_file=None)
    state = h.AppState(settings, env_path=tmp / ".env")
    outcome = h.connect_engine(state, "llamacpp", h.form_values(settings))
    assert outcome.ok, outcome.message
    yield state
    h.disconnect_engine(state)


@pytest.mark.live
@needs_model
def test_live_a_prompt_evicted_from_l1_says_so_and_the_store_panel_lists_the_eviction(evicting_state):
    state = evicting_state
    first = r.free_prompt(state, DOC, "lmcache", 4)
    assert first.ok and "Why not more: **none_stored**" in first.message
    again = r.free_prompt(state, DOC, "lmcache", 4)
    row = dict(zip(again.record["headers"], again.record["data"][0]))
    assert again.ok and row["why"] == "evicted", row
    assert "evicted from L1 by LRU" in row["why (detail)"] and "to make room for" in row["why (detail)"]
    assert "Why not more: **evicted**" in again.message
    listed = sp.evictions_markdown(state)
    assert listed is not None and "Recent evictions" in listed and "evicted from L1 by LRU" in listed
    assert listed.count("\n| `") == min(sp.EVICTIONS_SHOWN, len(state.engine.store.recent_evictions(100)))
    # a short prompt fits in L1: sent twice, its second run restores from L1, which the hit-rate chart shows
    r.free_prompt(state, SHORT, "lmcache", 4)
    hit = r.free_prompt(state, SHORT, "lmcache", 4)
    assert dict(zip(hit.record["headers"], hit.record["data"][0]))["tier"] == "L1"
    rates = sp.tier_hit_rates(state)
    assert set(rates) == {"L1"} and 0 < rates["L1"] < 1
    fig = tier_hit_rate_figure(rates, sp.store_tier_names(state))
    assert list(fig.data[0].y) == ["L1", "computed"]
