"""The cache server's L1 page map as a figure (the GUI's cache server panel): every page a cell coloured by its
state, and the pool's pressure level. Split from kvbridge.gui.charts, whose layout helpers it uses."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from kvbridge.gui.charts import _base_layout, _empty, format_bytes

PAGE_STATES = (("free", "#e2e8f0"), ("object", "#2563eb"), ("leased object", "#8b5cf6"),
               ("pending write", "#f59e0b"), ("quarantined", "#dc2626"))
PRESSURE_COLORS = {"OK": "#16a34a", "SOFT": "#ca8a04", "HARD": "#ea580c", "CRITICAL": "#dc2626"}
PAGE_MAP_COLUMNS = 64
PAGE_MAP_MAX_CELLS = 64 * 64   # a bigger pool is drawn with several pages per cell


def page_map_figure(page_map: bytes | None, level: str = "", page_bytes: int = 0) -> go.Figure:
    """Every L1 page of the cache server as a cell coloured by its state, and the pressure level.

    Over PAGE_MAP_MAX_CELLS pages, a cell stands for a run of pages and shows the busiest state in
    it (quarantined > pending > leased > object > free); the legend counts single pages, exactly.
    """
    title = "Cache server L1: page map"
    if not page_map:
        return _empty(title, "No page map: the cache server is not connected.")
    # a code this GUI does not know (a newer server) is drawn as the last, most alarming state
    states = np.minimum(np.frombuffer(page_map, dtype=np.uint8), len(PAGE_STATES) - 1)
    counts = np.bincount(states, minlength=len(PAGE_STATES))
    n_pages = len(states)
    per_cell = -(-n_pages // PAGE_MAP_MAX_CELLS)
    cells = np.pad(states, (0, -n_pages % per_cell)).reshape(-1, per_cell).max(axis=1)
    columns = min(PAGE_MAP_COLUMNS, len(cells))
    rows = -(-len(cells) // columns)
    blank = rows * columns - len(cells)   # the last row's empty tail: no cell drawn
    names = [label for label, _ in PAGE_STATES]
    where = [f"page {p}" if per_cell == 1 else f"pages {p}–{min(p + per_cell, n_pages) - 1}"
             for p in range(0, n_pages, per_cell)]
    z = cells.tolist() + [None] * blank
    hover = [f"{w}: {names[c]}" for w, c in zip(where, cells.tolist())] + [""] * blank
    n = len(PAGE_STATES)   # a discrete scale: code i fills [i/n, (i+1)/n] of it
    scale = [[edge / n, color] for i, (_, color) in enumerate(PAGE_STATES) for edge in (i, i + 1)]
    fig = go.Figure(go.Heatmap(z=_rows(z, columns), text=_rows(hover, columns), zmin=-0.5, zmax=n - 0.5,
                               colorscale=scale, showscale=False, xgap=1, ygap=1, name="pages",
                               hovertemplate="%{text}<extra></extra>"))
    for (label, color), count in zip(PAGE_STATES, counts.tolist()):
        # the heatmap has no legend of its own: one empty marker trace per state makes it
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=f"{label} ({count})",
                                 marker={"color": color, "size": 11, "symbol": "square"}, hoverinfo="skip"))
    cell = "" if per_cell == 1 else f" · a cell is {per_cell} pages"
    size = f" of {format_bytes(page_bytes)}" if page_bytes else ""
    fig = _base_layout(fig, f"{title}: {n_pages} pages{size}{cell}",
                       xaxis={"visible": False, "range": [-0.5, columns - 0.5]},
                       yaxis={"visible": False, "autorange": "reversed"})
    if level:   # top right, opposite the title: the first thing to read after it
        fig.add_annotation(text=f"<b>pressure {level}</b>", showarrow=False, xref="paper", yref="paper", x=1,
                           y=1.02, xanchor="right", yanchor="bottom", bgcolor=PRESSURE_COLORS.get(level, "#475569"),
                           font={"color": "white", "size": 12}, borderpad=4)
    fig.update_layout(height=min(480, max(220, 150 + 14 * rows)), margin={"l": 20, "r": 20, "t": 60, "b": 60},
                      legend={"orientation": "h", "yanchor": "top", "y": -0.02, "xanchor": "left", "x": 0})
    return fig


def _rows(flat: list, columns: int) -> list[list]:
    return [flat[i:i + columns] for i in range(0, len(flat), columns)]
