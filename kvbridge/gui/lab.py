"""The KV cache lab: run a many-request workload on the scheduler and watch its KV budget live.

Place in the flow: a person -> the lab tab (kvbridge.gui.app) -> **these handlers** -> a
kvbridge.scheduler.Scheduler of its own (or one attached by a serving front in the same process) ->
snapshot() and events() -> figures (kvbridge.gui.lab_charts). No Gradio here: the handlers are
tested without a browser, and the tab only polls `lab_view` on a timer while a workload runs.

A run submits each of the workload's timed requests at its arrival time from a driver thread, so
what the page shows is the scheduler doing its own work: admitting, sharing prefixes, evicting
cold ones, preempting and swapping out, swapping in, finishing.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kvbridge.bench.common.scheduler_workloads import WORKLOADS, LabDefaults, TimedRequest, Workload, get_workload
from kvbridge.errors import KVBridgeError
from kvbridge.gui.charts import format_bytes
from kvbridge.gui.handlers import Outcome, failure_message
from kvbridge.gui.lab_charts import block_map_figure, pressure_figure, timeline_figure
from kvbridge.gui.server_panel import cell, level_badge
from kvbridge.settings import Settings

log = logging.getLogger(__name__)

# Table headers short enough for one line each at the default window (the tab sets the column widths)
REQUEST_COLUMNS = ["request", "priority", "arrives (s)", "max tokens", "prompt"]
RESULT_COLUMNS = ["request", "priority", "result", "queue ms", "TTFT ms", "tokens", "preempted",
                  "swap-out ms", "swap-in ms", "answer"]
EVENT_COLUMNS = ["t (s)", "event", "request", "detail"]
EVENTS_SHOWN = 60
WATCHING = ("Watching the serve endpoint's scheduler (`gui --serve`): its requests appear here as they run. A "
            "scenario runs on it too, with its settings (the budget controls here apply to the lab's own scheduler).")
SCHEDULER_FIELDS = ("sched_kv_cells", "sched_max_running", "sched_soft", "sched_hard", "sched_critical")


@dataclass
class LabRun:
    """One workload on one scheduler: what was submitted, what came back."""

    workload: Workload
    stop: threading.Event = field(default_factory=threading.Event)
    futures: dict[str, Future] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    error: str = ""
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self.finished is None


class LabSession:
    """The lab of one GUI server: its scheduler (built per run from the tab's controls, or attached
    from a serving front in the same process) and the current run."""

    def __init__(self, settings: Settings, workload_options: dict[str, dict] | None = None) -> None:
        self.settings = settings
        self.workload_options = workload_options or {}   # sizes per workload key (tests use small ones)
        self.scheduler = None
        self.run: LabRun | None = None
        self._own = False
        self._lock = threading.Lock()
        self.usage: Callable[[], dict[str, dict]] | None = None   # a serving front's per-tenant usage

    def attach(self, scheduler, usage: Callable[[], dict[str, dict]] | None = None) -> None:
        """Watch (and run workloads on) a scheduler that someone else owns and closes; `usage`: the serve
        endpoint's per-tenant usage (ServeMetrics.tenant_usage), shown under the queues."""
        with self._lock:
            self._close_own()
            self.scheduler, self._own, self.usage = scheduler, False, usage

    def close(self) -> None:
        run = self.run
        if run is not None:
            _stop(run, self.scheduler)
            if run.thread is not None:
                run.thread.join(timeout=30)
        with self._lock:
            self._close_own()

    @property
    def owns_scheduler(self) -> bool:
        return self._own

    @property
    def attached(self) -> bool:
        """Watching a scheduler someone else runs (the serve endpoint of `gui --serve`)."""
        return self.scheduler is not None and not self._own

    def scheduler_for(self, settings: Settings):
        """A fresh scheduler with these settings (so counters and the timeline start with the run),
        unless one is attached."""
        with self._lock:
            if self.scheduler is not None and not self._own:
                return self.scheduler
            self._close_own()
            from kvbridge.scheduler import Scheduler   # loads llama.cpp: only when the lab is used
            self.scheduler, self._own = Scheduler(settings), True
            return self.scheduler

    def _close_own(self) -> None:
        if self._own and self.scheduler is not None:
            self.scheduler.close()
        if self._own:
            self.scheduler = None


# -- the controls ---------------------------------------------------------------------------------
def workload_choices() -> list[tuple[str, str]]:
    return [(get_workload(key).title, key) for key in WORKLOADS]


def workload_defaults(lab: LabSession, key: str) -> tuple[str, LabDefaults, list[list[Any]]]:
    """The workload's description, its default scheduler settings, and its requests as table rows."""
    workload = get_workload(key, **lab.workload_options.get(key, {}))
    return workload.description, workload.defaults, request_rows(workload.requests)


def request_rows(requests: Sequence[TimedRequest]) -> list[list[Any]]:
    return [[r.label, r.priority, r.at_s, r.n_predict, _excerpt(r.messages[-1]["content"], 70)] for r in requests]


def lab_settings(base: Settings, kv_cells: Any, max_running: Any, soft: Any, hard: Any,
                 critical: Any, exact: Any = None) -> tuple[Settings | None, list[str]]:
    """The base settings with the tab's scheduler controls; problems name the KVB_SCHED_ variables. exact: the
    tab's "Exact answers" box (KVB_SCHED_EXACT, on by default; flash attention off with it, unless the V cache is
    quantised); None keeps the base's."""
    values = dict(zip(SCHEDULER_FIELDS, (kv_cells, max_running, soft, hard, critical)))
    names = {"sched_kv_cells": "KV budget (KVB_SCHED_KV_CELLS)", "sched_max_running": "running sequences "
             "(KVB_SCHED_MAX_RUNNING)", "sched_soft": "KVB_SCHED_SOFT", "sched_hard": "KVB_SCHED_HARD",
             "sched_critical": "KVB_SCHED_CRITICAL"}
    changes, problems = {}, []
    for name, value in values.items():
        kind = int if name in ("sched_kv_cells", "sched_max_running") else float
        try:
            number = float(value)
            if kind is int and number != int(number):
                raise ValueError
            changes[name] = kind(number)
        except (TypeError, ValueError):
            problems.append(f"{names[name]} must be a {'whole number' if kind is int else 'fraction like 0.1'}, "
                            f"got {value!r}")
    if problems:
        return None, problems
    if exact is not None:
        changes["sched_exact"] = bool(exact)
    if changes.get("sched_exact", base.sched_exact) and base.cache_type_v.lower() in ("f16", "f32", "bf16"):
        # exact mode's condition (kvbridge.scheduler.exact); a quantised V cache needs flash attention, so there the
        # scheduler runs with the mode off and its notes say why
        changes["flash_attn"] = False
    settings = base.replace(**changes)
    problems = [p for p in settings.validate() if "KVB_SCHED_" in p]
    return (None, problems) if problems else (settings, [])


def start_lab(lab: LabSession, key: str, kv_cells: Any, max_running: Any, soft: Any, hard: Any, critical: Any,
              rows: Any, exact: Any = None) -> Outcome:
    """Start the workload with the tab's settings and priorities; the page then polls lab_view."""
    if lab.run is not None and lab.run.active:
        return Outcome("A workload is running; press Stop first (or wait for it to finish).", ok=False)
    try:
        workload = get_workload(key, **lab.workload_options.get(key, {})).with_priorities(_priorities(rows))
    except KVBridgeError as exc:
        return Outcome(f"Cannot start: {exc}. Nothing was changed.", ok=False)
    settings, problems = lab_settings(lab.settings, kv_cells, max_running, soft, hard, critical, exact)
    if settings is None:
        return Outcome("Cannot start: " + "; ".join(problems) + ". Nothing was changed.", ok=False)
    run = LabRun(workload)
    lab.run = run
    run.thread = threading.Thread(target=_drive, args=(lab, run, settings), name="kvbridge-lab", daemon=True)
    run.thread.start()
    return Outcome(f"Started **{workload.title}**: {len(workload.requests)} requests on "
                   f"{settings.sched_kv_cells} KV cells, {settings.sched_max_running} running at once"
                   + (", exact answers (each equals the request run alone)." if settings.sched_exact
                      and not settings.flash_attn else "."))


def stop_lab(lab: LabSession) -> Outcome:
    run = lab.run
    if run is None or not run.active:
        return Outcome("Nothing is running.")
    _stop(run, lab.scheduler)
    return Outcome("Stopping: every request that has not finished is cancelled and its blocks freed.")


def _stop(run: LabRun, scheduler) -> None:
    run.stop.set()
    for future in run.futures.values():
        if scheduler is not None and not future.done():
            scheduler.cancel(future)


def _drive(lab: LabSession, run: LabRun, settings: Settings) -> None:
    """Build the scheduler (unless one is attached), submit each request at its time, wait for all."""
    try:
        scheduler = lab.scheduler_for(settings)
        run.started = time.monotonic()
        for request in sorted(run.workload.requests, key=lambda r: r.at_s):
            if run.stop.wait(max(0.0, run.started + request.at_s - time.monotonic())):
                break
            try:
                run.futures[request.label] = scheduler.submit(
                    [dict(m) for m in request.messages], priority=request.priority, n_predict=request.n_predict,
                    label=request.label)
            except KVBridgeError as exc:
                run.refused[request.label] = str(exc)
        for future in list(run.futures.values()):
            while not future.done():
                if run.stop.is_set():
                    scheduler.cancel(future)
                try:
                    future.exception(timeout=0.2)
                except (FutureTimeout, CancelledError):
                    pass
        if run.stop.is_set() and lab.owns_scheduler:
            scheduler.drain(30)   # the cancelled requests leave the queues (and free their blocks) first
    except Exception as exc:
        run.error = failure_message("The lab run", exc)
    finally:
        run.finished = time.monotonic()


def _priorities(rows: Any) -> dict[str, Any]:
    """{label: priority} from the request table (a DataFrame or a list of rows)."""
    if rows is None:
        return {}
    if hasattr(rows, "values") and hasattr(rows, "columns"):
        rows = rows.values.tolist()
    return {str(row[0]): row[1] for row in rows if len(row) >= 2 and str(row[0]).strip()}


# -- what the tab shows ---------------------------------------------------------------------------
@dataclass
class LabView:
    message: str
    status: str            # pressure badge, free blocks, counters, the three queues (markdown)
    block_map: Any
    pressure: Any
    timeline: Any
    events: list[list[Any]]
    results: list[list[Any]]
    running: bool


def lab_view(lab: LabSession) -> LabView:
    """Everything the tab shows, from one snapshot of the scheduler."""
    run, scheduler = lab.run, lab.scheduler
    snapshot = scheduler.snapshot() if scheduler is not None else None
    events = scheduler.events() if scheduler is not None else []
    running = (run is not None and run.active) or lab.attached   # a served scheduler is watched all along
    return LabView(
        message=_run_message(run, snapshot, lab.attached),
        status=(status_markdown(snapshot) + tenants_markdown(lab.usage() if lab.usage else {})) if snapshot
        else "No scheduler yet: choose a scenario and press **Run**.",
        block_map=block_map_figure(snapshot),
        pressure=pressure_figure(snapshot),
        timeline=timeline_figure(events),
        events=[[e["t"], e["kind"], e["label"] or e["request"], e["detail"]] for e in reversed(events[-EVENTS_SHOWN:])],
        results=result_rows(run) if run is not None else [],
        running=running,
    )


def status_markdown(snapshot: dict) -> str:
    blocks, counters = snapshot["blocks"], snapshot["counters"]
    free_pct = 100.0 * blocks["free"] / max(1, blocks["total"])
    lines = [
        f"**Pressure** {level_badge(snapshot['pressure'])} · free blocks **{blocks['free']}** of {blocks['total']} "
        f"({free_pct:.0f}%, {blocks['block_tokens']} cells each) · shared extents {len(blocks['shared'])}",
        "**Counters** " + " · ".join(f"{name.replace('_', ' ')} {counters[name]}" for name in
                                     ("hits", "misses", "shared_tokens", "evictions", "preemptions", "swap_ins",
                                      "restore_failed", "finished", "cancelled", "failed")),
        "",
        "| queue | requests |",
        "|---|---|",
    ]
    for name in ("running", "waiting", "swapped"):
        entries = snapshot[name]
        text = ", ".join(f"{cell(r['label'])} (p{r['priority']}, {r['kv_tokens']}/{r['tokens']} tokens in KV"
                         + (f", preempted {r['preemptions']}×" if r["preemptions"] else "") + ")" for r in entries)
        lines.append(f"| {name} ({len(entries)}) | {text or '—'} |")
    prefixes = ", ".join(f"{cell(p['label'] or p['holder'])} ({p['tokens']} tokens)" for p in snapshot["prefixes"])
    lines.append(f"| cached prefixes ({len(snapshot['prefixes'])}) | {prefixes or '—'} |")
    return "\n".join(lines)


def tenants_markdown(usage: dict[str, dict]) -> str:
    """The serve endpoint's usage per tenant (LMCache's user-specific usage), below the queues."""
    if not usage:
        return ""
    lines = ["", "", "| tenant (serve) | requests | prompt tokens | cached tokens | KV bytes held |", "|---|---|---|---|---|"]
    for tenant, u in usage.items():
        held = ", ".join(f"{tier} {format_bytes(size)}" for tier, size in u["bytes_held"].items()) or "—"
        lines.append(f"| {cell(tenant)} | {u['requests']} | {u['prompt_tokens']} | {u['cached_tokens']} | {held} |")
    return "\n".join(lines)


def result_rows(run: LabRun) -> list[list[Any]]:
    rows = []
    for request in run.workload.requests:
        future = run.futures.get(request.label)
        if request.label in run.refused:
            rows.append([request.label, request.priority, f"refused: {run.refused[request.label]}", *[""] * 7])
            continue
        if future is None or not future.done():
            state = "not yet submitted" if future is None else "in progress"
            rows.append([request.label, request.priority, state, *[""] * 7])
            continue
        if future.cancelled():
            rows.append([request.label, request.priority, "cancelled", *[""] * 7])
            continue
        error = future.exception()
        if error is not None:
            rows.append([request.label, request.priority, f"error: {error}", *[""] * 7])
            continue
        r = future.result()
        rows.append([request.label, r.priority, "done", round(r.queue_ms or 0.0), round(r.ttft_ms or 0.0), r.gen_tokens,
                     r.preemptions, round(r.swap_out_ms, 1), round(r.swap_in_ms, 1), _excerpt(r.text, 80)])
    return rows


def _run_message(run: LabRun | None, snapshot: dict | None, attached: bool = False) -> str:
    if run is None:
        return WATCHING if attached else ""
    if run.error:
        return f"⚠️ {run.error}"
    done = sum(1 for f in run.futures.values() if f.done())
    total = len(run.workload.requests)
    elapsed = (run.finished or time.monotonic()) - run.started
    if run.active:
        if snapshot is None:
            return f"**{run.workload.title}**: loading the model into the scheduler's context…"
        return f"**{run.workload.title}** running: {done} of {total} requests finished, {elapsed:.1f} s."
    stopped = " (stopped)" if run.stop.is_set() else ""
    preempted = snapshot["counters"]["preemptions"] if snapshot else 0
    return (f"**{run.workload.title}** finished{stopped} in {elapsed:.1f} s: {done} of {total} requests done, "
            f"{preempted} preemptions.")


def _excerpt(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"
