"""What the GUI's scenario, results and export panels do: runs streamed request by request.

Place in the flow: Run in kvbridge.gui.app -> **run_stream** -> kvbridge.bench.common.runner.run_scenario ->
CachedEngine.infer per request -> a ResultsView (table, charts, summary) after every request.
No Gradio here. A failing run keeps the records it already produced; a new run replaces the
shown results only once its first record arrives.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import plotly.graph_objects as go

from kvbridge.gui.handlers import (AppState, Outcome, connecting_message, connecting_now, failure_message,
                                   no_engine_message, wait_for_connect)
from kvbridge.gui.store_panel import store_stats
from kvbridge.gui.charts import ModeSummary, judged_records, mode_summaries, run_figures
from kvbridge.errors import BadSettings, KVBridgeError
from kvbridge.gui.export import export_run
from kvbridge.engine.modes import mode_names
from kvbridge.engine.records import RECORD_FIELDS, RequestRecord
from kvbridge.bench.common.report import summarize
from kvbridge.bench.common.runner import run_scenario
from kvbridge.bench.common.scenarios import get_scenario, list_documents, scenario_specs
from kvbridge.bench.rag import CORPORA, DEFAULT_CORPUS

RAG_SCENARIO = "rag"   # the scenario whose corpus the page picks (kvbridge.bench.common.scenarios)

log = logging.getLogger(__name__)

# The table's column order: what a person reads first, then every other RequestRecord field.
LEADING_COLUMNS = (
    "mode", "request_index", "label", "ttft_ms", "tier", "matched_tokens", "prompt_tokens", "miss_reason",
    "hit_tiers", "prefill_tokens", "notes", "miss_detail", "error", "engine_cached_tokens", "predicted_reuse_tokens",
    "chunks_hit", "chunks_total", "lookup_ms", "restore_ms", "store_ms", "total_ms", "gen_tokens", "restore_ok",
    "approx", "text",
)
TABLE_COLUMNS = [*LEADING_COLUMNS, *(f for f in RECORD_FIELDS if f not in LEADING_COLUMNS)]
# headers that are not the field's own name: the cause of a miss is what a person asks ("why?")
COLUMN_LABELS = {"miss_reason": "why", "miss_detail": "why (detail)"}
TABLE_HEADERS = [COLUMN_LABELS.get(column, column) for column in TABLE_COLUMNS]
TEXT_PREVIEW_CHARS = 80
ProgressFn = Callable[..., Any]


@dataclass
class ResultsView:
    """Everything the results area shows, rebuilt from the records after each request."""

    message: str
    ok: bool
    table: dict[str, list]
    summary: str
    figures: dict[str, go.Figure]
    has_shadow: bool
    has_facts: bool = False   # the scenario knew the answers (rag): the fact rate against TTFT is drawn


def records_table(records: Sequence[RequestRecord], preview_text: bool = True) -> dict[str, list]:
    """{"headers", "data"} for gr.Dataframe: one row per record, every field, floats rounded."""
    rows = []
    for record in records:
        values = record.to_dict()
        row = []
        for column in TABLE_COLUMNS:
            value = values[column]
            if isinstance(value, float):
                value = round(value, 1)
            elif column == "text" and preview_text and len(value) > TEXT_PREVIEW_CHARS:
                value = value[:TEXT_PREVIEW_CHARS] + "…"
            row.append("" if value is None else value)
        rows.append(row)
    return {"headers": list(TABLE_HEADERS), "data": rows}


def column_field(header: str) -> str:
    """The RequestRecord field behind a table header ("why" -> "miss_reason")."""
    return {label: column for column, label in COLUMN_LABELS.items()}.get(header, header)


def summary_markdown(records: Sequence[RequestRecord]) -> str:
    """The run in one table: mean/median TTFT per mode and the speedup against cold; where a run compares
    answers (a cold run beside modes that reuse), how many equal cold's, and where the scenario knows
    the answer (RAG), how many state the expected fact."""
    summaries = mode_summaries(records)
    if not summaries:
        return ""
    quality = summarize(records)
    agreement = any("answers_equal_cold" in q for q in quality.values())
    facts = any("answers_with_fact" in q for q in quality.values())
    tiers = " / ".join([*summaries[0].hits, "miss"])
    extra = (" answers = cold |" if agreement else "") + (" states the expected fact |" if facts else "")
    lines = [headline(summaries), "", "| mode | requests | mean TTFT | median TTFT | speedup vs cold (mean / median) "
             f"| {tiers} |{extra}",
             "| --- | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * extra.count("|")]
    for s in summaries:
        speedup = "baseline" if s.mode == "cold" else (
            "n/a (no cold run)" if s.speedup_mean is None else f"**{s.speedup_mean:.1f}×** / {s.speedup_median:.1f}×")
        row = (f"| {s.mode} | {s.requests} | {s.mean_ttft_ms:.1f} ms | {s.median_ttft_ms:.1f} ms | "
               f"{speedup} | {' / '.join(str(n) for n in [*s.hits.values(), s.misses])} |")
        q = quality.get(s.mode, {})
        if agreement:
            equal = q.get("answers_equal_cold")
            row += " baseline |" if s.mode == "cold" else (f" {equal['equal']}/{equal['compared']} |" if equal else " – |")
        if facts:
            held = q.get("answers_with_fact")
            row += f" {held['holding']}/{held['judged']} |" if held else " – |"
        lines.append(row)
    failed = sum(bool(r.error) for r in records)
    if failed:
        lines.append(f"\n{failed} request(s) failed; see the error column.")
    return "\n".join(lines)


def headline(summaries: Sequence[ModeSummary]) -> str:
    """One sentence a person reads first: how much faster than cold each mode was."""
    faster = [f"**{s.mode}** {s.speedup_mean:.1f}× (median {s.speedup_median:.1f}×)"
              for s in summaries if s.mode != "cold" and s.speedup_mean is not None]
    if not faster:
        return "Run the **cold** mode too to see speedups: they are measured against it."
    return "Time to first token, times faster than cold on average: " + " · ".join(faster)


def results_view(state: AppState, message: str = "", ok: bool = True,
                 figures: dict[str, go.Figure] | None = None) -> ResultsView:
    """The view of the shown records; `figures` reuses charts built for an earlier view of the same run
    (run_stream rebuilds them at most every FIGURES_EVERY_S), else every chart is built now."""
    records = list(state.records)
    if figures is None:
        figures = build_figures(state, records)
    return ResultsView(
        message=message,
        ok=ok,
        table=records_table(records),
        summary=summary_markdown(records),
        figures=figures,
        has_shadow=any(r.kv_mode == "shadow" for r in records),
        has_facts=bool(judged_records(records)),
    )


def build_figures(state: AppState, records: Sequence[RequestRecord]) -> dict[str, go.Figure]:
    figures = run_figures(records, store_stats(state))
    if "long_context" in figures:
        # a long-context run's curve takes the per-request plot's place: TTFT against prompt length is
        # what its requests mean, and the page has no plot of its own for it
        figures["ttft_per_request"] = figures["long_context"]
    return figures


# -- scenario choices -------------------------------------------------------------------------
def scenario_choices() -> list[tuple[str, str]]:
    return [(s.title, s.key) for s in scenario_specs()]


def corpus_choices() -> list[str]:
    """The corpora the rag scenario knows (kvbridge.bench.rag.CORPORA), the default first."""
    return [DEFAULT_CORPUS] + [name for name in CORPORA if name != DEFAULT_CORPUS]


def scenario_description(key: str | None) -> str:
    try:
        scenario = get_scenario(key or "")
    except KVBridgeError as exc:
        return f"**{exc}**"
    count = f" Default: {scenario.default_requests} requests per mode." if scenario.default_requests else ""
    return scenario.description + count


def document_choices(state: AppState) -> list[str]:
    """Built-in documents plus the files in input/ (KVB_INPUT_DIR), by name."""
    return list(list_documents(state.settings))


def document_text(state: AppState, name: str | None) -> str | None:
    """The text behind a document name; None (the scenario's built-in) when none is chosen."""
    if not name:
        return None
    documents = list_documents(state.settings)
    if name not in documents:
        raise BadSettings(f"The document {name!r} is no longer available; files come from {state.settings.input_dir} "
                          "(KVB_INPUT_DIR). Pick another one.")
    return documents[name]


# -- runs -------------------------------------------------------------------------------------
def check_run_request(state: AppState, modes: Sequence[str], n_requests: Any) -> list[str]:
    problems = []
    if state.engine is None:
        problems.append(no_engine_message(state))
    known = mode_names()
    unknown = [m for m in modes if m not in known]
    if not modes:
        problems.append(f"Pick at least one mode ({', '.join(known)}).")
    elif unknown:
        problems.append(f"Unknown mode(s) {', '.join(unknown)}; the modes are {', '.join(known)}.")
    if n_requests not in (None, ""):
        try:
            if int(n_requests) < 1:
                problems.append("Number of requests must be at least 1.")
        except (TypeError, ValueError):
            problems.append(f"Number of requests must be a whole number, not {n_requests!r}.")
    return problems


def run_meta(state: AppState, scenario: str, modes: Sequence[str], n_requests: int | None, document: str | None,
             corpus: str | None = None) -> dict:
    """What the export says about the run: engine, scenario, store settings. Nothing secret."""
    engine, s = state.engine, state.settings
    meta = {"scenario": scenario, "modes": ",".join(modes), "n_requests": n_requests or "scenario default",
            "document": document or "built-in", "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if scenario == RAG_SCENARIO:
        meta["corpus"] = corpus or DEFAULT_CORPUS
    if engine is not None:
        meta.update(engine=engine.backend.key, location=engine.backend.describe(),
                    kv_mode=engine.backend.kv_mode, namespace=engine.namespace)
    meta.update(chunk_size=s.chunk_size, ctx_size=s.ctx_size, n_predict=s.n_predict, threads=s.resolved_threads(),
                l1_bytes=s.l1_bytes, l2_enabled=s.l2_enabled, l2_bytes=s.l2_bytes)
    return meta


GUI_SETTLE_S = 0.5   # seconds between requests of a GUI run (see run_stream)
# A running run's charts are rebuilt at most this often (every plotly figure of the run, ~0.1-0.3 s of CPU on
# 2 cores, and the page redraws each); the table and the summary follow every request, the charts catch up
# with the next rebuild and always with the run's last view.
FIGURES_EVERY_S = 0.5


def run_stream(
    state: AppState,
    scenario: str,
    modes: Sequence[str],
    n_requests: Any = None,
    document: str | None = None,
    progress: ProgressFn | None = None,
    corpus: str | None = None,
) -> Iterator[ResultsView]:
    """Run a scenario and yield the updated view after every request; errors end the run, not the page.
    Pressed while the engine connects on start, it waits for that connect first. `corpus`: the rag scenario's
    (a name in kvbridge.bench.rag.CORPORA; None: its default)."""
    if connecting_now(state):
        yield results_view(state, f"Waiting for the engine: {connecting_message(state)} The run starts when it is up.")
        wait_for_connect(state)
    problems = check_run_request(state, modes, n_requests)
    if problems:
        yield results_view(state, "\n".join(problems), ok=False)
        return
    if not state.engine_lock.acquire(blocking=False):
        yield results_view(state, "A run or request is already using the engine; press Stop or wait.", ok=False)
        return
    n = int(n_requests) if n_requests not in (None, "") else None
    modes = [m for m in mode_names() if m in modes]
    new_records: list[RequestRecord] = []
    try:
        state.stop_event.clear()
        text = document_text(state, document)
        meta = run_meta(state, scenario, modes, n, document, corpus)
        yield results_view(state, f"Running **{scenario}** in {', '.join(modes)}…")
        on_progress = None if progress is None else (
            lambda done, total, what: progress((done, total), desc=what, unit="requests"))
        figures: dict[str, go.Figure] | None = None   # the charts last shown, while they are fresh enough
        drawn_at = time.monotonic()
        for record in run_scenario(state.engine, scenario, modes, n_requests=n, document=text,
                                   progress=on_progress, stop_event=state.stop_event, corpus=corpus):
            new_records.append(record)
            if len(new_records) == 1:  # the new run replaces the old results only now
                state.records, state.run_meta = new_records, meta
            redraw = figures is None or time.monotonic() - drawn_at >= FIGURES_EVERY_S
            view = results_view(state, f"Running **{scenario}**: {len(new_records)} requests done "
                                       f"(last: {record.mode} #{record.request_index}, TTFT {record.ttft_ms:.0f} ms).",
                                figures=None if redraw else figures)
            figures = view.figures
            yield view
            if redraw:
                # let the page draw the updated charts before the next timed request: on a 2-core machine the
                # browser's own rendering would otherwise share the CPU with that request's prefill
                time.sleep(GUI_SETTLE_S)
                drawn_at = time.monotonic()
        word = "Stopped" if state.stop_event.is_set() else "Finished"
        failed = sum(bool(r.error) for r in new_records)
        yield results_view(state, f"{word} **{scenario}**: {len(new_records)} requests"
                                  + (f", {failed} failed (see the error column)." if failed else "."), ok=not failed)
    except Exception as exc:  # the UI boundary: keep what was shown, say what went wrong
        message = failure_message(f"Scenario {scenario!r}", exc)
        if new_records:
            message += f" The {len(new_records)} requests before the failure are kept."
        yield results_view(state, message, ok=False)
    finally:
        state.engine_lock.release()


def request_stop(state: AppState) -> Outcome:
    state.stop_event.set()
    return Outcome("Stopping after the current request…")


# -- the free prompt --------------------------------------------------------------------------
@dataclass
class FreePromptResult:
    message: str
    ok: bool
    answer: str
    record: dict[str, list]


def free_prompt(state: AppState, prompt: str, mode: str, n_predict: Any = None) -> FreePromptResult:
    """Send one prompt in one mode; return the answer and its record (the run's results stay)."""
    empty = records_table([])
    wait_for_connect(state)   # sent while the engine connects on start: answered once it is up
    if state.engine is None:
        return FreePromptResult(no_engine_message(state), False, "", empty)
    if not (prompt or "").strip():
        return FreePromptResult("Type a prompt first.", False, "", empty)
    if mode not in mode_names():
        return FreePromptResult(f"Pick a mode: {', '.join(mode_names())}.", False, "", empty)
    try:
        n = int(n_predict) if n_predict not in (None, "") else None
    except (TypeError, ValueError):
        return FreePromptResult(f"Tokens to generate must be a whole number, not {n_predict!r}.", False, "", empty)
    if not state.engine_lock.acquire(blocking=False):
        return FreePromptResult("A run is using the engine; press Stop or wait.", False, "", empty)
    try:
        record = state.engine.infer(prompt, mode=mode, n_predict=n, scenario="free prompt", label="free prompt")
    except Exception as exc:  # the UI boundary
        return FreePromptResult(failure_message("The prompt", exc), False, "", empty)
    finally:
        state.engine_lock.release()
    table = records_table([record], preview_text=False)
    if record.error:
        return FreePromptResult(f"The prompt failed: {record.error}", False, "", table)
    summary = (f"{record.mode}: TTFT {record.ttft_ms:.1f} ms, {record.matched_tokens} of {record.prompt_tokens} "
               f"prompt tokens reused (tier {record.tier}), {record.prefill_tokens} computed.")
    if record.miss_reason:
        summary += f" Why not more: **{record.miss_reason}**: {record.miss_detail}"
    if record.notes:
        summary += f" Notes: {record.notes}"
    return FreePromptResult(summary, True, record.text, table)


# -- export -----------------------------------------------------------------------------------
def export_results(state: AppState) -> tuple[Outcome, list[str]]:
    """CSV, JSON and the HTML report of the shown run into KVB_OUTPUT_DIR; returns the paths too."""
    records = list(state.records)
    if not records:
        return Outcome("Nothing to export yet: run a scenario first.", ok=False), []
    try:
        paths = export_run(records, state.settings.output_dir, figures=run_figures(records, store_stats(state)),
                           meta=state.run_meta)
    except Exception as exc:  # the UI boundary
        return Outcome(failure_message("Export", exc), ok=False), []
    listed = ", ".join(f"`{p.name}`" for p in paths.values())
    return Outcome(f"Exported {len(records)} requests to {state.settings.output_dir}: {listed}"), [str(p) for p in paths.values()]
