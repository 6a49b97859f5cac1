"""The KV cache lab tab: its components and events. Every decision lives in kvbridge.gui.lab.

While a workload runs, a timer polls `lab_view` (the scheduler's snapshot and events) a little more
than once a second and redraws the block map, the pressure gauge, the queues and the timeline; it
switches itself off one tick after the run ends.
"""
from __future__ import annotations

from typing import Any

import gradio as gr

from kvbridge.gui.lab import (
    EVENT_COLUMNS, REQUEST_COLUMNS, RESULT_COLUMNS, LabSession, lab_view, start_lab, stop_lab, workload_choices,
    workload_defaults,
)
from kvbridge.gui.labels import setting_input

TICK_S = 0.8
# Column widths in pixels for every column but the last (free text, sized by Gradio to what it holds); with
# TABLE_CLASS (app.py's CSS) a header never wraps, so a table wider than its box scrolls sideways instead of
# breaking "priority" into letters.
TABLE_CLASS = "kvb-lab-table"
REQUEST_WIDTHS = [110, 90, 130, 120]
RESULT_WIDTHS = [120, 90, 100, 100, 100, 80, 110, 120, 110]
EVENT_WIDTHS = [80, 130, 130]


def build_lab_tab(lab: LabSession) -> None:
    gr.Markdown("## KV cache lab\nMany conversations on one llama.cpp context, as `kvbridge.scheduler` runs them: "
                "a KV budget in blocks, prefixes shared by reference count, cold prefixes evicted LRU, pressure "
                "watermarks, and low-priority requests preempted, their KV swapped out to the store and swapped "
                "back in later to finish where they stopped. Pick a scenario, change the budget or a request's "
                "priority, press **Run**, and watch.")
    choices = workload_choices()
    first = choices[0][1]
    description, defaults, rows = workload_defaults(lab, first)
    with gr.Row(equal_height=False):
        with gr.Column(scale=1):
            scenario = gr.Dropdown(choices, value=first, label="Scenario", elem_id="kvb-lab-scenario")
            about = gr.Markdown(description, elem_id="kvb-lab-about")
            with gr.Row():
                kv_cells = gr.Number(defaults.kv_cells, precision=0, minimum=1, elem_id="kvb-lab-cells",
                                     **setting_input("sched_kv_cells"))
                max_running = gr.Number(defaults.max_running, precision=0, minimum=1, elem_id="kvb-lab-running",
                                        **setting_input("sched_max_running"))
            with gr.Row():
                soft = gr.Number(defaults.soft, elem_id="kvb-lab-soft", **setting_input("sched_soft"))
                hard = gr.Number(defaults.hard, elem_id="kvb-lab-hard", **setting_input("sched_hard"))
                critical = gr.Number(defaults.critical, elem_id="kvb-lab-critical", **setting_input("sched_critical"))
            exact = gr.Checkbox(lab.settings.sched_exact, elem_id="kvb-lab-exact", **setting_input("sched_exact"))
        with gr.Column(scale=1):
            requests = gr.Dataframe(rows, headers=REQUEST_COLUMNS, label="Requests (edit a priority: 0-9, higher is "
                                    "more urgent)", interactive=True, wrap=True, elem_id="kvb-lab-requests",
                                    static_columns=[0, 2, 3, 4], max_height=300, elem_classes=[TABLE_CLASS],
                                    column_widths=REQUEST_WIDTHS)
            with gr.Row():
                run_btn = gr.Button("Run", variant="primary", elem_id="kvb-lab-run")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="kvb-lab-stop")
            message = gr.Markdown(lab_view(lab).message, elem_classes="kvb-message", elem_id="kvb-lab-msg")
    status = gr.Markdown("No scheduler yet: choose a scenario and press **Run**.", elem_id="kvb-lab-status")
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            block_map = gr.Plot(show_label=False, elem_id="kvb-lab-blocks")
        with gr.Column(scale=2):
            pressure = gr.Plot(show_label=False, elem_id="kvb-lab-pressure")
    timeline = gr.Plot(show_label=False, elem_id="kvb-lab-timeline")
    # each table on a row of its own: the results' ten columns need the page's width for one-line headers
    results = gr.Dataframe([], headers=RESULT_COLUMNS, label="Requests' results", interactive=False, wrap=True,
                           max_height=320, elem_id="kvb-lab-results", elem_classes=[TABLE_CLASS],
                           column_widths=RESULT_WIDTHS)
    events = gr.Dataframe([], headers=EVENT_COLUMNS, label="Events (newest first)", interactive=False, wrap=True,
                          max_height=320, elem_id="kvb-lab-events", elem_classes=[TABLE_CLASS],
                          column_widths=EVENT_WIDTHS)
    timer = gr.Timer(TICK_S, active=lab.attached)   # a served scheduler (gui --serve) is watched from the start

    view_outputs = [message, status, block_map, pressure, timeline, events, results, timer]

    def view_values(note: str | None = None) -> list[Any]:
        view = lab_view(lab)
        shown = note if note is not None else view.message
        return [shown, view.status, view.block_map, view.pressure, view.timeline, view.events, view.results,
                gr.Timer(active=view.running)]

    def on_scenario(key: str) -> list[Any]:
        text, marks, table = workload_defaults(lab, key)
        return [text, marks.kv_cells, marks.max_running, marks.soft, marks.hard, marks.critical, table]

    def on_run(key: str, cells: Any, running: Any, s: Any, h: Any, c: Any, table: Any, exact_on: Any) -> list[Any]:
        outcome = start_lab(lab, key, cells, running, s, h, c, table, exact_on)
        if not outcome.ok:
            gr.Warning(" ".join(outcome.message.split())[:300])
            return [f"⚠️ {outcome.message}", *[gr.update()] * 6, gr.Timer(active=False)]
        values = view_values(outcome.message)
        values[-1] = gr.Timer(active=True)
        return values

    def on_stop() -> list[Any]:
        return view_values(stop_lab(lab).message)

    scenario.change(on_scenario, scenario, [about, kv_cells, max_running, soft, hard, critical, requests],
                    queue=False)
    run_btn.click(on_run, [scenario, kv_cells, max_running, soft, hard, critical, requests, exact], view_outputs,
                  queue=False)
    stop_btn.click(on_stop, None, view_outputs, queue=False)
    timer.tick(lambda: view_values(), None, view_outputs, queue=False, show_progress="hidden")
