"""Writes a run's records as CSV, JSON and (given figures) a self-contained HTML report.

Place in the flow: records from CachedEngine.infer / run_scenario -> **export_run** -> files in
output/ (KVB_OUTPUT_DIR) with a timestamped name. The GUI and the bench CLI both call it. The HTML
embeds plotly.js inline so the report opens offline. Nothing secret is written: records carry no
credentials, and `meta` is scrubbed of anything that could hold one (see `scrub_meta`).
"""
from __future__ import annotations

import csv
import html
import json
import re
import time
from pathlib import Path
from typing import Any, Sequence

import plotly.graph_objects as go

from kvbridge.gui.charts import mode_summaries
from kvbridge.engine.records import RECORD_FIELDS, RequestRecord

EXPORT_FORMAT = "kvbridge-run v1"
REDACTED = "(redacted)"
# Meta keys that could carry a credential. `*_env` keys hold only the NAME of a variable and stay.
_SECRET_KEY = re.compile(r"(api_?key|api_?token|access_?token|auth_?token|secret|password|passwd|authorization|bearer|extra_headers|cookie|credential)", re.I)


def scrub_meta(meta: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of `meta` with values of credential-like keys replaced; nested dicts are scrubbed too."""
    clean: dict[str, Any] = {}
    for key, value in (meta or {}).items():
        if isinstance(value, dict):
            clean[key] = scrub_meta(value)
        elif _SECRET_KEY.search(str(key)) and not str(key).lower().endswith("_env") and value not in ("", None):
            clean[key] = REDACTED
        else:
            clean[key] = value
    return clean


def default_basename(meta: dict[str, Any] | None = None) -> str:
    """kvbridge-<scenario>-YYYYmmdd-HHMMSS, the scenario part only when meta names one."""
    scenario = re.sub(r"[^A-Za-z0-9_-]+", "-", str((meta or {}).get("scenario", ""))).strip("-")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return f"kvbridge-{scenario}-{stamp}" if scenario else f"kvbridge-run-{stamp}"


def _free_basename(output_dir: Path, basename: str) -> str:
    """`basename`, or basename-2, -3... so a second export in the same second overwrites nothing."""
    candidate, n = basename, 1
    while any((output_dir / f"{candidate}{ext}").exists() for ext in (".csv", ".json", ".html")):
        n += 1
        candidate = f"{basename}-{n}"
    return candidate


def export_run(
    records: Sequence[RequestRecord],
    output_dir: str | Path,
    basename: str | None = None,
    figures: dict[str, go.Figure] | None = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Write CSV and JSON (and HTML when figures are given); returns {"csv"|"json"|"html": path}."""
    out = Path(output_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    name = _free_basename(out, basename or default_basename(meta))
    clean_meta = scrub_meta(meta)
    paths = {"csv": out / f"{name}.csv", "json": out / f"{name}.json"}
    _write_csv(paths["csv"], records)
    _write_json(paths["json"], records, clean_meta)
    if figures is not None:
        paths["html"] = out / f"{name}.html"
        paths["html"].write_text(render_html(records, figures, clean_meta, title=name), encoding="utf-8")
    return paths


def record_columns(records: Sequence[RequestRecord]) -> list[str]:
    """RequestRecord's fields, then any a bench's record subclass adds (long-context: target_tokens, ...)."""
    columns = list(RECORD_FIELDS)
    for record in records:
        columns += [name for name in record.to_dict() if name not in columns]
    return columns


def _write_csv(path: Path, records: Sequence[RequestRecord]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=record_columns(records))
        writer.writeheader()
        for record in records:
            writer.writerow({k: "" if v is None else v for k, v in record.to_dict().items()})


def summary_rows(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """Per-mode summary as plain dicts (JSON export, HTML report, GUI)."""
    return [
        {
            "mode": s.mode,
            "requests": s.requests,
            "mean_ttft_ms": round(s.mean_ttft_ms, 2),
            "median_ttft_ms": round(s.median_ttft_ms, 2),
            "speedup_mean_vs_cold": None if s.speedup_mean is None else round(s.speedup_mean, 2),
            "speedup_median_vs_cold": None if s.speedup_median is None else round(s.speedup_median, 2),
            **{f"hits_{tier}": count for tier, count in s.hits.items()},
            "misses": s.misses,
        }
        for s in mode_summaries(records)
    ]


def length_summary_rows(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """A long-context run's table (one dict per prompt length, ratios included); [] for other runs."""
    from kvbridge.bench.long_context import length_rows

    return [row.to_dict() for row in length_rows(records)]


def _write_json(path: Path, records: Sequence[RequestRecord], meta: dict[str, Any]) -> None:
    document = {
        "format": EXPORT_FORMAT,
        "exported": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "meta": meta,
        "summary": summary_rows(records),
        "records": [r.to_dict() for r in records],
    }
    lengths = length_summary_rows(records)
    if lengths:
        document["long_context"] = lengths
    path.write_text(json.dumps(document, indent=2, default=str), encoding="utf-8")


def _html_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(row.get(c)))}</td>" for c in columns) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:2rem auto;max-width:1200px;color:#0f172a;padding:0 1rem}
h1{font-size:1.5rem}h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #e2e8f0;padding-bottom:.3rem}
table{border-collapse:collapse;font-size:.8rem;width:100%}th,td{border:1px solid #e2e8f0;padding:.25rem .4rem;text-align:left;vertical-align:top}
th{background:#f1f5f9}dl{display:grid;grid-template-columns:max-content 1fr;gap:.2rem 1rem;font-size:.85rem}dt{font-weight:600}
.charts{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:1rem}.wide{overflow-x:auto}
"""


def render_html(
    records: Sequence[RequestRecord], figures: dict[str, go.Figure], meta: dict[str, Any], title: str
) -> str:
    """One self-contained page: summary, charts (plotly.js inlined once), settings and every record."""
    chart_divs = []
    for i, (name, fig) in enumerate(figures.items()):
        # Two fixed grid columns: each chart is drawn as its script runs, before later cells exist,
        # so a grid that re-flows afterwards would leave the first charts clipped.
        chart_divs.append(fig.to_html(full_html=False, include_plotlyjs="inline" if i == 0 else False,
                                      config={"responsive": True},
                                      div_id=f"chart-{re.sub(r'[^A-Za-z0-9_-]', '-', name)}"))
    meta_html = "".join(f"<dt>{html.escape(str(k))}</dt><dd>{html.escape(_cell(v))}</dd>" for k, v in meta.items())
    summary = summary_rows(records)
    lengths = length_summary_rows(records)
    length_table = (f"<h2>Per prompt length</h2>\n<div class=\"wide\">{_html_table(lengths, list(lengths[0]))}</div>"
                    if lengths else "")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{_CSS}</style></head>
<body>
<h1>KVBridge run report: {html.escape(title)}</h1>
<h2>Summary per mode</h2>
{_html_table(summary, list(summary[0]) if summary else ["mode"])}
{length_table}
<h2>Charts</h2>
<div class="charts">{''.join(chart_divs)}</div>
<h2>Run</h2>
<dl>{meta_html}</dl>
<h2>Requests</h2>
<div class="wide">{_html_table([r.to_dict() for r in records], record_columns(records))}</div>
</body></html>
"""
