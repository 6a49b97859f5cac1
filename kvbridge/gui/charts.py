"""Plotly figures for a run: what each mode's TTFT cost and where the reused KV came from.

Place in the flow: the engine fills a RequestRecord per request -> **these figures** -> the GUI
(gr.Plot) and the HTML report (kvbridge.gui.export). Pure functions of records and store stats; no
Gradio here, so the bench and the export can draw the same charts.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import plotly.graph_objects as go

from kvbridge.engine.modes import mode_names
from kvbridge.engine.records import RequestRecord

MODE_COLORS = {"cold": "#94a3b8", "native": "#10b981", "lmcache": "#2563eb", "blend": "#d97706"}
# Tier names and their order come from the store (records' `tier`, stats()["tiers"]); colours go by
# position in that order, so a new tier (a remote L3) needs no entry here.
TIER_PALETTE = ("#2563eb", "#8b5cf6", "#0d9488", "#d97706", "#db2777")
MISS_COLOR = "#cbd5e1"
MISS_LABEL = "miss / not from our store"
FIGURE_HEIGHT = 340
EMPTY_HINT = "No results yet: connect an engine and press Run."


# -- numbers ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModeSummary:
    """TTFT statistics of one mode in a run, with the speedup against the cold baseline."""

    mode: str
    requests: int
    mean_ttft_ms: float
    median_ttft_ms: float
    speedup_mean: float | None      # cold mean / this mode's mean; None without cold records
    speedup_median: float | None
    hits: dict[str, int]            # tier name -> requests whose reused KV came from it, fastest tier first
    misses: int
    matched_tokens: int
    prompt_tokens: int


def ordered_modes(records: Iterable[RequestRecord]) -> list[str]:
    """Modes present in the records, in the canonical order (cold, native, lmcache, then others)."""
    present = {r.mode for r in records}
    modes = mode_names()
    return [m for m in modes if m in present] + sorted(present - set(modes))


def tier_order(records: Iterable[RequestRecord], tier_names: Sequence[str] = ()) -> list[str]:
    """The store's tier names (fastest first), then any other tier a record names, as first seen."""
    order = list(tier_names)
    for r in records:
        if r.tier and r.tier != "none" and r.tier not in order:
            order.append(r.tier)
    return order


def tier_color(tier: str, order: Sequence[str]) -> str:
    return TIER_PALETTE[order.index(tier) % len(TIER_PALETTE)] if tier in order else MISS_COLOR


def mode_summaries(records: Sequence[RequestRecord], tier_names: Sequence[str] = ()) -> list[ModeSummary]:
    """One ModeSummary per mode; requests that failed (record.error) are left out of the timings.

    tier_names: the store's tiers in order (TieredStore.tier_names); tiers only the records name follow.
    """
    timed = [r for r in records if not r.error]
    tiers = tier_order(timed, tier_names)
    cold = [r.ttft_ms for r in timed if r.mode == "cold"]
    cold_mean = statistics.fmean(cold) if cold else None
    cold_median = statistics.median(cold) if cold else None
    summaries = []
    for mode in ordered_modes(timed):
        mine = [r for r in timed if r.mode == mode]
        ttfts = [r.ttft_ms for r in mine]
        mean, median = statistics.fmean(ttfts), statistics.median(ttfts)
        summaries.append(ModeSummary(
            mode=mode,
            requests=len(mine),
            mean_ttft_ms=mean,
            median_ttft_ms=median,
            speedup_mean=_ratio(cold_mean, mean),
            speedup_median=_ratio(cold_median, median),
            hits={tier: sum(r.tier == tier for r in mine) for tier in tiers},
            misses=sum(r.tier not in tiers for r in mine),
            matched_tokens=sum(r.matched_tokens for r in mine),
            prompt_tokens=sum(r.prompt_tokens for r in mine),
        ))
    return summaries


def _ratio(baseline: float | None, value: float) -> float | None:
    if baseline is None or value <= 0:
        return None
    return baseline / value


# -- figures ----------------------------------------------------------------------------------
def _base_layout(fig: go.Figure, title: str, **axes: Any) -> go.Figure:
    fig.update_layout(
        title={"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}},
        template="plotly_white",
        height=FIGURE_HEIGHT,
        margin={"l": 60, "r": 20, "t": 70, "b": 50},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "xanchor": "right", "x": 1.0},
        font={"family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif", "size": 12},
        **axes,
    )
    return fig


def _empty(title: str, hint: str = EMPTY_HINT) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=hint, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font={"size": 13, "color": "#64748b"})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _base_layout(fig, title)


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}×"


def ttft_per_request_figure(records: Sequence[RequestRecord]) -> go.Figure:
    """TTFT of every request, one coloured line per mode, on a log axis (cold and warm differ 10-100×)."""
    title = "TTFT per request (ms, log scale)"
    done = [r for r in records if not r.error]
    if not done:
        return _empty(title)
    fig = go.Figure()
    for mode in ordered_modes(done):
        mine = [r for r in done if r.mode == mode]
        fig.add_trace(go.Scatter(
            x=[r.request_index for r in mine],
            y=[max(r.ttft_ms, 0.01) for r in mine],
            mode="lines+markers",
            name=mode,
            marker={"color": MODE_COLORS.get(mode), "size": 8},
            line={"color": MODE_COLORS.get(mode), "width": 2},
            customdata=[[r.label, r.tier, r.matched_tokens, r.prompt_tokens, r.notes] for r in mine],
            hovertemplate=("request %{x} · %{customdata[0]}<br>TTFT %{y:.1f} ms<br>tier %{customdata[1]}, "
                           "reused %{customdata[2]} of %{customdata[3]} tokens<br>%{customdata[4]}"
                           f"<extra>{mode}</extra>"),
        ))
    return _base_layout(fig, title, xaxis={"title": "request", "dtick": 1},
                        yaxis={"title": "TTFT (ms)", "type": "log"})


STAGE_COLORS = {"tokenize": "#64748b", "hash": "#94a3b8", "lookup": "#f59e0b", "fetch": "#d97706",
                "assemble": "#8b5cf6", "handoff": "#db2777", "reset": "#cbd5e1", "prefill": "#2563eb",
                "first_token": "#10b981"}
STAGES_SHOWN = 40   # the latest requests; a cold prefill's bar would flatten the warm ones, so cold is left out


def stages_figure(records: Sequence[RequestRecord]) -> go.Figure:
    """Where each request's time to the first token went, a stacked bar per request and mode side by
    side (native's bar is the floor a restore is measured against); cold requests are left out."""
    from kvbridge.engine.stages import STAGE_LABELS, STAGES, stages_gap_ms, stages_of

    title = "Time to first token by stage (ms), warm modes side by side"
    done = sorted((r for r in records if not r.error and r.mode != "cold"),
                  key=lambda r: (r.request_index, ordered_modes(records).index(r.mode)))[-STAGES_SHOWN:]
    if not done:
        return _empty(title, "Run native or lmcache to see where the time to the first token goes."
                      if any(not r.error for r in records) else EMPTY_HINT)
    names = [f"#{r.request_index} {r.mode}" for r in done]
    fig = go.Figure()
    for stage in STAGES:
        values = [stages_of(r)[stage] for r in done]
        if not any(v >= 0.05 for v in values):
            continue
        fig.add_trace(go.Bar(x=names, y=values, name=STAGE_LABELS[stage], marker={"color": STAGE_COLORS[stage]},
                             hovertemplate=f"%{{x}}<br>{STAGE_LABELS[stage]} %{{y:.1f}} ms<extra></extra>"))
    gaps = [max(0.0, stages_gap_ms(r)) for r in done]
    if any(g >= 0.05 for g in gaps):
        fig.add_trace(go.Bar(x=names, y=gaps, name="other", marker={"color": "#e2e8f0"},
                             hovertemplate="%{x}<br>not in a stage %{y:.1f} ms<extra></extra>"))
    return _base_layout(fig, title, barmode="stack", xaxis={"title": "request", "type": "category"},
                        yaxis={"title": "ms"})


def speedup_figure(records: Sequence[RequestRecord]) -> go.Figure:
    """The headline: how many times faster than cold each mode reached the first token."""
    title = "Speedup vs cold: how many times faster to the first token"
    summaries = [s for s in mode_summaries(records) if s.mode != "cold"]
    if not summaries:
        return _empty(title)
    if all(s.speedup_mean is None for s in summaries):
        return _empty(title, "Run the cold mode too: speedups are measured against it.")
    fig = go.Figure()
    for s in summaries:
        values = [s.speedup_mean, s.speedup_median]
        fig.add_trace(go.Bar(
            x=["mean TTFT", "median TTFT"], y=[v or 0 for v in values], name=s.mode,
            text=[_times(v) for v in values], textposition="outside", cliponaxis=False,
            textfont={"size": 14}, marker={"color": MODE_COLORS.get(s.mode, "#475569")},
            hovertemplate=s.mode + ": %{text} faster than cold (%{x})<extra></extra>",
        ))
    fig.add_hline(y=1, line_dash="dot", line_color="#64748b")  # cold itself; a label would sit on the bars
    return _base_layout(fig, title, barmode="group",
                        yaxis={"title": "× faster than cold (dotted: 1×)", "rangemode": "tozero"})


def ttft_summary_figure(records: Sequence[RequestRecord]) -> go.Figure:
    """Mean and median TTFT per mode, side by side."""
    title = "Mean and median TTFT per mode (ms, lower is better)"
    summaries = mode_summaries(records)
    if not summaries:
        return _empty(title)
    fig = go.Figure()
    for s in summaries:
        values = [s.mean_ttft_ms, s.median_ttft_ms]
        fig.add_trace(go.Bar(
            x=["mean", "median"], y=values, name=s.mode, text=[f"{v:.0f} ms" for v in values],
            textposition="outside", cliponaxis=False, marker={"color": MODE_COLORS.get(s.mode, "#475569")},
            hovertemplate=s.mode + " %{x} TTFT: %{y:.1f} ms<extra></extra>",
        ))
    return _base_layout(fig, title, barmode="group", yaxis={"title": "TTFT (ms)", "rangemode": "tozero"})


def hits_figure(records: Sequence[RequestRecord], tier_names: Sequence[str] = ()) -> go.Figure:
    """Requests per mode by where their reused KV came from: each tier of the store, or nowhere (a miss)."""
    title = "Store hits and misses per mode (requests)"
    summaries = mode_summaries(records, tier_names)
    if not summaries:
        return _empty(title)
    modes = [s.mode for s in summaries]
    tiers = list(summaries[0].hits)
    fig = go.Figure()
    bars = [(f"hit from {tier}", tier_color(tier, tiers), [s.hits[tier] for s in summaries]) for tier in tiers]
    bars.append((MISS_LABEL, MISS_COLOR, [s.misses for s in summaries]))
    for label, color, counts in bars:
        fig.add_trace(go.Bar(
            x=modes, y=counts, name=label, marker={"color": color},
            text=[c or "" for c in counts], textposition="inside",
            hovertemplate="%{x}: %{y} requests " + label + "<extra></extra>",
        ))
    return _base_layout(fig, title, barmode="stack", yaxis={"title": "requests", "rangemode": "tozero"})


def shadow_figure(records: Sequence[RequestRecord]) -> go.Figure:
    """Shadow engines: the reuse our index predicts next to the cached tokens the engine reported."""
    title = "SHADOW: predicted reuse vs engine-reported cached tokens"
    shadow = [r for r in records if r.kv_mode == "shadow" and not r.error]
    if not shadow:
        return _empty(title, "Shown for shadow engines (Ollama, cloud), which keep their KV to themselves.")
    labels = [f"{r.mode} #{r.request_index}" for r in shadow]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=labels, y=[r.predicted_reuse_tokens or 0 for r in shadow],
                         name="predicted by KVBridge" + (" (approx)" if any(r.approx for r in shadow) else ""),
                         marker={"color": "#2563eb"}))
    fig.add_trace(go.Bar(x=labels, y=[r.engine_cached_tokens or 0 for r in shadow],
                         name="reported by the engine", marker={"color": "#f59e0b"},
                         text=["not reported" if r.engine_cached_tokens is None else "" for r in shadow],
                         textposition="outside"))
    return _base_layout(fig, title, barmode="group", xaxis={"title": "request"},
                        yaxis={"title": "prompt tokens", "rangemode": "tozero"})


FACTS_HINT = ("Shown for scenarios that know the answers (rag): how often each mode's answer states the expected "
              "fact, against its TTFT.")


def judged_records(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    """The records whose answer can be judged: the scenario knew the fact (record.expected) and the request ran."""
    return [r for r in records if r.expected and not r.error]


def fact_rate_figure(records: Sequence[RequestRecord]) -> go.Figure:
    """The task's quality against its speed: per mode, the share of answers stating the expected fact
    (report.holds_fact) at the mode's mean TTFT, one point each, cold included."""
    from kvbridge.bench.common.report import holds_fact

    title = "Answers stating the fact against TTFT: up and left is better"
    judged = judged_records(records)
    if not judged:
        return _empty(title, FACTS_HINT)
    fig = go.Figure()
    for mode in ordered_modes(judged):
        mine = [r for r in judged if r.mode == mode]
        holding = sum(holds_fact(r.text, r.expected) for r in mine)
        mean = statistics.fmean(r.ttft_ms for r in mine)
        color = MODE_COLORS.get(mode, "#475569")
        fig.add_trace(go.Scatter(
            x=[max(mean, 0.01)], y=[100 * holding / len(mine)], mode="markers+text", name=mode,
            text=[f"{mode} {holding}/{len(mine)}"], textposition="top center", cliponaxis=False,
            marker={"color": color, "size": 14}, textfont={"size": 13},
            hovertemplate=(f"{mode}: {holding} of {len(mine)} answers state the expected fact (%{{y:.0f}} %)"
                           "<br>mean TTFT %{x:.1f} ms<extra></extra>"),
        ))
    return _base_layout(fig, title, xaxis={"title": "mean TTFT (ms, log scale)", "type": "log"},
                        yaxis={"title": "answers stating the fact (%)", "range": [0, 112],   # room for 100 %'s label
                               "tickvals": [0, 25, 50, 75, 100]})


# -- the store --------------------------------------------------------------------------------
@dataclass(frozen=True)
class TierUsage:
    name: str
    objects: int
    bytes_used: int
    capacity: int
    remote: bool = False   # a shared server's tier (L3): its capacity is the server's, objects those known here


def tier_usages(stats: dict | None) -> list[TierUsage]:
    """Per-tier occupancy from TieredStore.stats()."""
    if not stats:
        return []
    tiers = stats.get("tiers", {})
    items = tiers.items() if isinstance(tiers, dict) else ((t.get("name", "?"), t) for t in tiers)
    return [
        TierUsage(
            name=str(name),
            objects=int(tier.get("objects", 0)),
            bytes_used=int(tier.get("bytes", 0)),
            capacity=int(tier.get("capacity", 0) or tier.get("capacity_bytes", 0)),
            remote="remote" in tier,
        )
        for name, tier in items
    ]


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def store_figure(stats: dict | None) -> go.Figure:
    """How full each tier is, as a share of its capacity (tiers differ 10x in size, so not in bytes)."""
    title = "Store occupancy per tier (% of capacity)"
    usages = tier_usages(stats)
    if not usages:
        return _empty(title, "Connect an engine to see its store.")
    names = [u.name for u in usages]
    used = [100 * u.bytes_used / u.capacity if u.capacity and not u.remote else 0 for u in usages]
    fig = go.Figure()
    fig.add_trace(go.Bar(
        y=names, x=used, orientation="h", name="used",
        marker={"color": [tier_color(n, names) for n in names]},
        text=[f"{format_bytes(u.bytes_used)} · {u.objects} objects known here; the server's memory is its limit"
              if u.remote else f"{format_bytes(u.bytes_used)} of {format_bytes(u.capacity)} · {u.objects} objects"
              for u in usages],
        textposition="outside", cliponaxis=False, hovertemplate="%{y}: %{x:.2f} % full<extra></extra>",
    ))
    fig = _base_layout(fig, title, showlegend=False, xaxis={"title": "% of capacity", "range": [0, 100]},
                       yaxis={"autorange": "reversed"})
    fig.update_layout(height=230, margin={"l": 40, "r": 20, "t": 50, "b": 45})
    return fig


def tier_hit_rates_from_records(records: Sequence[RequestRecord]) -> dict[str, float]:
    """{tier: restored tokens from it / prompt tokens} over lmcache records (record.hit_tiers), as the engine's
    Metrics.tier_hit_rates() counts them; {} without any."""
    from kvbridge.engine.misses import parse_hit_tiers

    mine = [r for r in records if r.mode == "lmcache" and not r.error]
    prompt = sum(r.prompt_tokens for r in mine)
    hits: dict[str, int] = {}
    for r in mine:
        for tier, n in parse_hit_tiers(r.hit_tiers).items():
            hits[tier] = hits.get(tier, 0) + n
    return {tier: n / prompt for tier, n in hits.items()} if prompt else {}


def tier_hit_rate_figure(rates: dict[str, float], tier_names: Sequence[str] = ()) -> go.Figure:
    """Per tier, the share of lmcache prompt tokens restored from it; the rest was computed (a miss)."""
    title = "Hit rate per tier (% of lmcache prompt tokens restored from it)"
    if not rates:
        return _empty(title, "Send a prompt or run a scenario in lmcache mode to see where its tokens came from.")
    order = tier_order((), list(tier_names)) + [t for t in rates if t not in tier_names]
    names = [t for t in order if t in rates]
    computed = max(0.0, 1.0 - sum(rates.values()))
    labels = [*names, "computed"]
    values = [100 * rates[t] for t in names] + [100 * computed]
    colors = [tier_color(t, order) for t in names] + [MISS_COLOR]
    fig = go.Figure(go.Bar(y=labels, x=values, orientation="h", marker={"color": colors},
                           text=[f"{v:.1f} %" for v in values], textposition="outside", cliponaxis=False,
                           hovertemplate="%{y}: %{x:.1f} % of lmcache prompt tokens<extra></extra>"))
    fig = _base_layout(fig, title, showlegend=False, xaxis={"title": "% of prompt tokens", "range": [0, 100]},
                       yaxis={"autorange": "reversed"})
    fig.update_layout(height=230, margin={"l": 70, "r": 20, "t": 50, "b": 45})
    return fig


# -- the cache server's L1 --------------------------------------------------------------------
# The codes of the storage module's page_map (one byte per page), in order, with their colours.
# the long-context curve: TTFT per mode, plus the restore and the plain copy it is held to
CURVE_SERIES = (
    ("cold TTFT", "cold_ttft_ms", MODE_COLORS["cold"], "solid"),
    ("native warm TTFT", "native_warm_ttft_ms", MODE_COLORS["native"], "solid"),
    ("lmcache warm TTFT", "lmcache_warm_ttft_ms", MODE_COLORS["lmcache"], "solid"),
    ("restore (lookup+fetch+assemble+set)", "restore_ms", "#8b5cf6", "dash"),
    ("plain copy of the same bytes", "plain_copy_ms", "#f59e0b", "dot"),
)


def long_context_figure(rows: Sequence[Any]) -> go.Figure:
    """How the win grows with the prompt: x = prompt tokens, y = ms on a log axis (rows: LengthRow)."""
    title = "Long context: TTFT and restore time by prompt length (ms, log scale)"
    if not rows:
        return _empty(title, "Run the long-context scenario to see how the win grows with the prompt.")
    fig = go.Figure()
    x = [r.prompt_tokens for r in rows]
    hover = [[r.target_tokens, _times(r.lmcache_speedup), _times(r.native_speedup),
              "n/a" if r.lmcache_vs_native is None else f"{r.lmcache_vs_native:.2f}×",
              "n/a" if r.restore_vs_copy is None else f"{r.restore_vs_copy:.2f}×", r.restored_bytes / 1e6] for r in rows]
    for name, attribute, color, dash in CURVE_SERIES:
        y = [getattr(r, attribute) for r in rows]
        if all(v is None for v in y):
            continue
        fig.add_trace(go.Scatter(
            x=x, y=[None if v is None else max(v, 0.01) for v in y], mode="lines+markers", name=name,
            line={"color": color, "width": 2, "dash": dash}, marker={"color": color, "size": 8},
            customdata=hover, connectgaps=False,
            hovertemplate=("%{x} prompt tokens (target %{customdata[0]})<br>" + name + ": %{y:.1f} ms<br>"
                           "lmcache %{customdata[1]} faster than cold, native %{customdata[2]}<br>"
                           "lmcache ÷ native %{customdata[3]}; restore ÷ copy %{customdata[4]} "
                           "(%{customdata[5]:.1f} MB)<extra></extra>"),
        ))
    fig = _base_layout(fig, title, xaxis={"title": "prompt tokens", "type": "log", "tickvals": x},
                       yaxis={"title": "ms (log scale)", "type": "log"})
    # five series: the legend goes below the plot, where it cannot cover the title or the lines
    fig.update_layout(height=FIGURE_HEIGHT + 120, margin={"b": 130},
                      legend={"orientation": "h", "yanchor": "top", "y": -0.2, "xanchor": "left", "x": 0})
    return fig


def run_figures(records: Sequence[RequestRecord], store_stats: dict | None = None) -> dict[str, go.Figure]:
    """Every chart of a run, by a stable name (the GUI and the HTML report use the same names).

    A long-context run puts its curve first.
    """
    from kvbridge.bench.long_context import length_rows

    rows = length_rows(records)
    figures = {"long_context": long_context_figure(rows)} if rows else {}
    figures |= {
        "speedup": speedup_figure(records),
        "ttft_per_request": ttft_per_request_figure(records),
        "stages": stages_figure(records),
        "ttft_summary": ttft_summary_figure(records),
        "hits": hits_figure(records, list((store_stats or {}).get("tiers", {}))),   # the store's tier order
    }
    if any(r.kv_mode == "shadow" for r in records):
        figures["shadow"] = shadow_figure(records)
    if judged_records(records):   # a scenario that knows the answers (rag): quality against speed
        figures["facts"] = fact_rate_figure(records)
    if store_stats:
        figures["store"] = store_figure(store_stats)
    return figures
