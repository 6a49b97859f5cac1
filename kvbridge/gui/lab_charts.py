"""Plotly figures for the KV cache lab: the block map of the KV budget, the pressure gauge with its
watermarks, and the timeline of scheduler events.

Pure functions of `Scheduler.snapshot()` and `Scheduler.events()`; no Gradio here.

The block map draws the ledger's blocks in the order their extents were made (the scheduler's
account, not llama.cpp's physical cell order): each running request's own blocks in its colour,
blocks that several sequences hold (a shared prefix) in amber with their reference count written
on them, cached prefixes that no running request uses in slate, free blocks in light grey.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import plotly.graph_objects as go

REQUEST_PALETTE = ("#2563eb", "#16a34a", "#db2777", "#7c3aed", "#0891b2", "#ea580c", "#65a30d", "#be123c",
                   "#4f46e5", "#0d9488")
SHARED_COLOR = "#f59e0b"
CACHED_COLOR = "#64748b"
FREE_COLOR = "#e5e7eb"
MAX_SQUARES = 1024
COLUMNS = 32
EVENT_STYLE = {   # kind -> (colour, marker symbol)
    "admit": ("#2563eb", "circle"),
    "share": ("#f59e0b", "diamond"),
    "restore": ("#7c3aed", "star"),
    "evict": ("#64748b", "x-thin-open"),
    "preempt": ("#dc2626", "x"),
    "swap-out": ("#ea580c", "triangle-down"),
    "swap-in": ("#16a34a", "triangle-up"),
    "finish": ("#111827", "square"),
    "cancel": ("#9ca3af", "square-open"),
    "restore-failed": ("#be185d", "star-open"),   # llama.cpp refused a restore: the request recomputes
    "fail": ("#7f1d1d", "x-open"),                # a step raised: only its requests failed and were freed
}


def block_map_figure(snapshot: dict | None) -> go.Figure:
    fig = go.Figure()
    if not snapshot:
        return _empty(fig, "The KV budget appears here when a workload runs.", 260)
    blocks = snapshot["blocks"]
    labels = _labels(snapshot)
    running = {f"req-{r['id']}" for r in snapshot["running"]}
    squares = _block_squares(blocks, labels, running)
    scale = max(1, math.ceil(len(squares) / MAX_SQUARES))
    squares = squares[::scale]
    columns = COLUMNS if len(squares) <= 512 else 2 * COLUMNS
    rows = math.ceil(len(squares) / columns)
    size = max(5, min(18, int(760 / columns) - 4))
    groups: dict[str, dict[str, list]] = {}
    for i, (name, color, text, hover) in enumerate(squares):
        group = groups.setdefault(name, {"x": [], "y": [], "text": [], "hover": [], "color": color})
        group["x"].append(i % columns)
        group["y"].append(-(i // columns))
        group["text"].append(text)
        group["hover"].append(hover)
    for name, group in groups.items():
        fig.add_trace(go.Scatter(
            x=group["x"], y=group["y"], mode="markers+text", name=name, text=group["text"],
            textfont={"size": max(7, size - 8), "color": "white"}, hovertext=group["hover"], hoverinfo="text",
            marker={"symbol": "square", "size": size, "color": group["color"], "line": {"width": 0}}))
    per = f" (one square = {scale} blocks)" if scale > 1 else ""
    fig.update_layout(
        title=f"KV budget: {blocks['used']} of {blocks['total']} blocks used, {blocks['block_tokens']} cells each{per}",
        height=max(220, 60 + rows * (size + 4) + 80), margin={"l": 10, "r": 10, "t": 40, "b": 10},
        xaxis={"visible": False, "range": [-1, columns]}, yaxis={"visible": False, "range": [-rows, 1]},
        legend={"orientation": "h", "y": -0.02, "yanchor": "top"}, plot_bgcolor="white")
    return fig


def _block_squares(blocks: dict, labels: dict[str, str], running: set[str]) -> list[tuple[str, str, str, str]]:
    """(legend name, colour, text on the square, hover) per block, extents first, then the free ones."""
    colours: dict[str, str] = {}
    squares = []
    for extent in blocks.get("extents", []):
        holders = extent["holders"]
        if len(holders) > 1:
            name, color, text = "shared (refs on the block)", SHARED_COLOR, str(len(holders))
        elif holders and holders[0] in running:
            holder = holders[0]
            color = colours.setdefault(holder, REQUEST_PALETTE[len(colours) % len(REQUEST_PALETTE)])
            name, text = labels.get(holder, holder), ""
        else:
            name, color, text = "cached prefix", CACHED_COLOR, ""
        who = ", ".join(labels.get(h, h) for h in holders)
        hover = f"{extent['cells']} cells made by {labels.get(extent['owner'], extent['owner'])}<br>held by {who}"
        squares += [(name, color, text, hover)] * extent["blocks"]
    free = blocks["total"] - len(squares)
    squares += [("free", FREE_COLOR, "", "free block")] * max(0, free)
    return squares


def _labels(snapshot: dict) -> dict[str, str]:
    labels = {f"req-{r['id']}": r["label"] for key in ("running", "waiting", "swapped") for r in snapshot[key]}
    labels.update({p["holder"]: p.get("label") or p["holder"] for p in snapshot["prefixes"]})
    return labels


def pressure_figure(snapshot: dict | None) -> go.Figure:
    """Free blocks as a gauge; the coloured bands are the watermarks (below SOFT, HARD, CRITICAL)."""
    fig = go.Figure()
    if not snapshot:
        return _empty(fig, "Pressure appears here when a workload runs.", 260)
    blocks, marks = snapshot["blocks"], snapshot["watermarks"]
    free_pct = 100.0 * blocks["free"] / max(1, blocks["total"])
    critical, hard, soft = (100 * marks[k] for k in ("critical", "hard", "soft"))
    fig.add_trace(go.Indicator(
        mode="gauge+number", value=free_pct, number={"suffix": "% free", "valueformat": ".0f"},
        title={"text": f"Pressure: {snapshot['pressure']}"},
        gauge={"axis": {"range": [0, 100], "ticksuffix": "%"}, "bar": {"color": "#1e293b", "thickness": 0.3},
               "steps": [{"range": [0, critical], "color": "#fecaca"}, {"range": [critical, hard], "color": "#fed7aa"},
                         {"range": [hard, soft], "color": "#fef08a"}, {"range": [soft, 100], "color": "#dcfce7"}],
               "threshold": {"line": {"color": "#dc2626", "width": 3}, "thickness": 0.9, "value": critical}}))
    fig.update_layout(height=260, margin={"l": 30, "r": 30, "t": 60, "b": 10},
                      annotations=[{"text": f"watermarks (free): soft {soft:g}% · hard {hard:g}% · critical "
                                            f"{critical:g}%", "x": 0.5, "y": -0.05, "showarrow": False,
                                    "xref": "paper", "yref": "paper", "font": {"size": 11}}])
    return fig


def timeline_figure(events: Sequence[dict[str, Any]]) -> go.Figure:
    """One row per request, a marker per event at its time since the scheduler started."""
    fig = go.Figure()
    if not events:
        return _empty(fig, "Admissions, shares, preemptions, swaps and finishes appear here.", 300)
    rows = list(dict.fromkeys(e["label"] or e["request"] for e in events))
    for kind, (color, symbol) in EVENT_STYLE.items():
        chosen = [e for e in events if e["kind"] == kind]
        if not chosen:
            continue
        fig.add_trace(go.Scatter(
            x=[e["t"] for e in chosen], y=[e["label"] or e["request"] for e in chosen], mode="markers", name=kind,
            hovertext=[f"{kind} {e['label'] or e['request']} at {e['t']:.2f} s<br>{e['detail']}" for e in chosen],
            hoverinfo="text", marker={"color": color, "symbol": symbol, "size": 14 if kind == "preempt" else 10,
                                      "line": {"width": 1, "color": color}}))
    fig.update_layout(title="Timeline", height=max(260, 90 + 26 * len(rows)),
                      margin={"l": 10, "r": 10, "t": 40, "b": 40}, xaxis={"title": "seconds", "rangemode": "tozero"},
                      yaxis={"categoryorder": "array", "categoryarray": rows[::-1], "automargin": True},
                      legend={"orientation": "h", "y": -0.25})
    return fig


def _empty(fig: go.Figure, text: str, height: int) -> go.Figure:
    fig.update_layout(height=height, xaxis={"visible": False}, yaxis={"visible": False}, plot_bgcolor="white",
                      annotations=[{"text": text, "showarrow": False, "font": {"size": 13, "color": "#64748b"}}],
                      margin={"l": 10, "r": 10, "t": 20, "b": 10})
    return fig
