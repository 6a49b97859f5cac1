"""The Gradio testbed: pick an engine, run a scenario in cold/native/lmcache, read TTFT off charts.

Place in the flow: a person -> **this page** -> handlers (kvbridge.app_handlers, app_results) ->
CachedEngine -> records -> charts. This module only lays out components and wires events; every
decision lives in the handlers, which are tested without a browser. One engine per server
(AppState); runs stream through Gradio's queue on worker threads, so the page stays responsive.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading
from typing import Any

import gradio as gr

from .app_handlers import (
    AppState, Outcome, clear_tier, connect_engine, disconnect_engine, engine_choices, engine_notice,
    engine_status, field_type, fields_for_engine, form_fields, form_values, restart_engine, save_settings,
    store_markdown, store_stats, COMMON_FIELDS,
)
from .app_results import (
    ResultsView, document_choices, records_table, export_results, free_prompt, request_stop, results_view, run_stream,
    scenario_choices, scenario_description,
)
from .charts import store_figure
from .config import Settings, env_name
from .errors import KVBridgeError
from .scenarios import get_scenario
from .records import MODES

__all__ = ["AppState", "build_app", "launch_app", "main"]
log = logging.getLogger(__name__)

APP_THEME = gr.themes.Soft(primary_hue="blue", neutral_hue="slate")
APP_CSS = """
.gradio-container {max-width: 1400px !important}
#kvb-status {background: #eff6ff; border: 1px solid #bfdbfe; border-radius: 8px; padding: 8px 12px}
#kvb-notice strong {color: #b45309}
.kvb-message p {margin: 4px 0}
#kvb-summary > p:first-child, #kvb-summary p:first-of-type {font-size: 1.15em}
#kvb-results-table {font-size: 12px}
"""
MODE_HELP = "cold: no reuse (baseline) · native: the engine's own prefix cache · lmcache: restored from KVBridge's store"


def _message(outcome: Outcome | ResultsView) -> str:
    """Show the message in the page; errors also pop up as a warning toast."""
    if not outcome.ok:
        gr.Warning(outcome.message.splitlines()[0][:300])
        return f"⚠️ {outcome.message}"
    return outcome.message


def build_app(settings: Settings, state: AppState | None = None) -> gr.Blocks:
    """The whole page; `state` (one per server) defaults to a fresh AppState over `settings`."""
    state = state or AppState(settings)
    fields = form_fields()
    values = form_values(settings)
    choices = engine_choices()
    selected = settings.engine if settings.engine in {key for _, key in choices} else choices[0][1]

    with gr.Blocks(title="KVBridge testbed", analytics_enabled=False) as demo:
        gr.Markdown("# KVBridge testbed\nHow much time-to-first-token does reusing KV save? Connect an engine, "
                    "run a scenario in several modes, and compare. " + MODE_HELP)
        status = gr.Markdown(engine_status(state), elem_id="kvb-status")

        with gr.Row(equal_height=False):
            with gr.Column(scale=1):
                gr.Markdown("## 1 · Engine")
                engine_radio = gr.Radio(choices, value=selected, label="Engine", elem_id="kvb-engine")
                notice = gr.Markdown(engine_notice(selected), elem_id="kvb-notice")
                inputs: dict[str, gr.components.Component] = {}
                visible = fields_for_engine(selected)
                with gr.Accordion("Engine settings", open=True):
                    for name in fields:
                        if name not in COMMON_FIELDS:
                            inputs[name] = _field_input(name, values[name], name in visible)
                with gr.Accordion("Store and generation settings", open=False):
                    for name in COMMON_FIELDS:
                        inputs[name] = _field_input(name, values[name], True)
                with gr.Row():
                    connect_btn = gr.Button("Connect", variant="primary", elem_id="kvb-connect")
                    save_btn = gr.Button("Save settings to .env", elem_id="kvb-save")
                engine_msg = gr.Markdown(elem_classes="kvb-message", elem_id="kvb-engine-msg")

            with gr.Column(scale=1):
                gr.Markdown("## 2 · Scenario")
                scenarios = scenario_choices()
                first = scenarios[0][1] if scenarios else None
                scenario = gr.Dropdown(scenarios, value=first, label="Scenario", elem_id="kvb-scenario")
                description = gr.Markdown(scenario_description(first) if first else "")
                modes = gr.CheckboxGroup(list(MODES), value=list(MODES), label="Modes to run", info=MODE_HELP,
                                         elem_id="kvb-modes")
                with gr.Row():
                    n_requests = gr.Number(value=_default_requests(first), precision=0, minimum=1,
                                           label="Requests per mode", info="The scenario's questions or turns, "
                                           "repeated if you ask for more.", elem_id="kvb-n-requests")
                    docs = _safe_documents(state)
                    document = gr.Dropdown(docs, value=docs[0] if docs else None, label="Document",
                                           info="Built-in documents and files in input/.", elem_id="kvb-document")
                with gr.Row():
                    run_btn = gr.Button("Run", variant="primary", elem_id="kvb-run")
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="kvb-stop")
                run_progress = gr.Markdown("", elem_id="kvb-progress", min_height=44)  # the progress bar shows here
                run_msg = gr.Markdown(elem_classes="kvb-message", elem_id="kvb-run-msg")

        gr.Markdown("## 3 · Results")
        summary = gr.Markdown(elem_id="kvb-summary")
        with gr.Row():
            speedup_plot = gr.Plot(label="Speedup vs cold", show_label=False, elem_id="kvb-plot-speedup")
            summary_plot = gr.Plot(label="Mean and median TTFT", show_label=False, elem_id="kvb-plot-summary")
        with gr.Row():
            ttft_plot = gr.Plot(label="TTFT per request", show_label=False, elem_id="kvb-plot-ttft")
            hits_plot = gr.Plot(label="Hits and misses by tier", show_label=False, elem_id="kvb-plot-hits")
        shadow_plot = gr.Plot(label="Shadow: predicted vs reported", show_label=False, visible=False, elem_id="kvb-plot-shadow")
        table = gr.Dataframe(records_table([]), label="Requests", interactive=False, wrap=False, max_height=420,
                             elem_id="kvb-results-table")
        with gr.Row():
            export_btn = gr.Button("Export (CSV, JSON, HTML report)", elem_id="kvb-export", scale=0, min_width=300)
            export_msg = gr.Markdown(elem_classes="kvb-message", elem_id="kvb-export-msg")
        export_files = gr.File(label="Exported files", file_count="multiple", visible=False, elem_id="kvb-export-files")

        with gr.Row(equal_height=False):
            with gr.Column(scale=1):
                gr.Markdown("## 4 · Free prompt")
                prompt = gr.Textbox(lines=4, max_lines=8, label="Prompt", placeholder="Ask anything; send it twice in lmcache mode "
                                    "to see a restore.", elem_id="kvb-prompt")
                with gr.Row():
                    prompt_mode = gr.Radio(list(MODES), value="lmcache", label="Mode", elem_id="kvb-prompt-mode")
                    prompt_tokens = gr.Number(value=settings.n_predict, precision=0, minimum=1,
                                              label="Tokens to generate")
                send_btn = gr.Button("Send", variant="primary", elem_id="kvb-send")
                prompt_msg = gr.Markdown(elem_classes="kvb-message", elem_id="kvb-prompt-msg")
                answer = gr.Textbox(label="Answer", lines=4, interactive=False, elem_id="kvb-answer")
                prompt_record = gr.Dataframe(records_table([]), label="Its record", interactive=False, max_height=160)

            with gr.Column(scale=1):
                gr.Markdown("## 5 · Store")
                stats = store_stats(state)
                store_md = gr.Markdown(store_markdown(stats), elem_id="kvb-store")
                store_plot = gr.Plot(store_figure(stats), label="Occupancy", show_label=False, elem_id="kvb-plot-store")
                with gr.Row():
                    refresh_btn = gr.Button("Refresh")
                    clear_l1_btn = gr.Button("Clear L1", elem_id="kvb-clear-l1")
                    clear_l2_btn = gr.Button("Clear L2", elem_id="kvb-clear-l2")
                pending_tier = gr.State(None)
                with gr.Row(visible=False) as confirm_row:
                    confirm_md = gr.Markdown()
                    confirm_btn = gr.Button("Yes, clear it", variant="stop", elem_id="kvb-confirm-clear")
                    cancel_btn = gr.Button("Cancel")
                with gr.Row():
                    drop_l1 = gr.Checkbox(False, label="Also drop L1 (as a process restart would: next restore from L2)")
                    restart_btn = gr.Button("Restart engine", elem_id="kvb-restart")
                store_msg = gr.Markdown(elem_classes="kvb-message", elem_id="kvb-store-msg")

        field_inputs = [inputs[name] for name in fields]
        results_outputs = [run_msg, summary, speedup_plot, summary_plot, ttft_plot, hits_plot, shadow_plot, table,
                           store_md, store_plot]

        def results_values(view: ResultsView) -> list[Any]:
            figs = view.figures
            shadow = gr.update(value=figs.get("shadow"), visible=view.has_shadow)
            stats_now = store_stats(state)
            return [_message(view), view.summary, figs["speedup"], figs["ttft_summary"], figs["ttft_per_request"],
                    figs["hits"], shadow, view.table, store_markdown(stats_now), store_figure(stats_now)]

        def store_values(outcome: Outcome | None = None) -> list[Any]:
            stats_now = store_stats(state)
            return [store_markdown(stats_now), store_figure(stats_now), _message(outcome) if outcome else ""]

        # -- engine ------------------------------------------------------------------------------
        def on_engine_change(key: str) -> list[Any]:
            shown = fields_for_engine(key)
            return [engine_notice(key), *(gr.update(visible=(name in shown)) for name in fields)]

        def on_connect(key: str, *field_values: Any) -> list[Any]:
            outcome = connect_engine(state, key, dict(zip(fields, field_values)))
            docs_now = _safe_documents(state)
            return [engine_status(state), _message(outcome), gr.update(choices=docs_now),
                    *store_values()[:2]]

        def on_save(key: str, *field_values: Any) -> str:
            return _message(save_settings(state, key, dict(zip(fields, field_values))))

        engine_radio.change(on_engine_change, engine_radio, [notice, *field_inputs], queue=False)
        connect_btn.click(on_connect, [engine_radio, *field_inputs], [status, engine_msg, document, store_md, store_plot],
                          concurrency_limit=1, show_progress_on=[engine_msg])
        save_btn.click(on_save, [engine_radio, *field_inputs], engine_msg, concurrency_limit=1)

        # -- scenario runs -----------------------------------------------------------------------
        def on_run(key: str, chosen_modes: list[str], n: Any, doc: str | None, progress=gr.Progress()):
            for view in run_stream(state, key, chosen_modes, n, doc, progress=progress):
                yield results_values(view)

        scenario.change(lambda key: [scenario_description(key), _default_requests(key)], scenario,
                        [description, n_requests], queue=False)
        run_btn.click(on_run, [scenario, modes, n_requests, document], results_outputs, concurrency_limit=1,
                      concurrency_id="scenario-run", show_progress_on=[run_progress])
        stop_btn.click(lambda: _message(request_stop(state)), None, run_msg, concurrency_limit=None, queue=False)

        def on_export() -> list[Any]:
            outcome, paths = export_results(state)
            return [_message(outcome), gr.update(value=paths or None, visible=bool(paths))]

        export_btn.click(on_export, None, [export_msg, export_files], concurrency_limit=1)

        # -- free prompt -------------------------------------------------------------------------
        def on_send(text: str, mode: str, n: Any) -> list[Any]:
            result = free_prompt(state, text, mode, n)
            return [_message(result), result.answer, result.record, *store_values()[:2]]

        send_btn.click(on_send, [prompt, prompt_mode, prompt_tokens], [prompt_msg, answer, prompt_record, store_md,
                                                                      store_plot], concurrency_limit=1)

        # -- store -------------------------------------------------------------------------------
        def ask_clear(tier: str) -> list[Any]:
            stats_now = store_stats(state)
            question = f"**Really clear {tier}?** Every object in {tier} is deleted; the store keeps the other tier."
            if stats_now is None:
                question = "Connect an engine first."
            return [tier, gr.update(visible=stats_now is not None), question]

        def on_confirm_clear(tier: str | None) -> list[Any]:
            outcome = clear_tier(state, tier or "")
            return [None, gr.update(visible=False), *store_values(outcome)]

        refresh_btn.click(lambda: store_values(), None, [store_md, store_plot, store_msg], queue=False)
        clear_l1_btn.click(lambda: ask_clear("L1"), None, [pending_tier, confirm_row, confirm_md], queue=False)
        clear_l2_btn.click(lambda: ask_clear("L2"), None, [pending_tier, confirm_row, confirm_md], queue=False)
        cancel_btn.click(lambda: [None, gr.update(visible=False)], None, [pending_tier, confirm_row], queue=False)
        confirm_btn.click(on_confirm_clear, pending_tier, [pending_tier, confirm_row, store_md, store_plot, store_msg],
                          concurrency_limit=1)
        restart_btn.click(lambda drop: [engine_status(state), *store_values(restart_engine(state, drop))], drop_l1,
                          [status, store_md, store_plot, store_msg], concurrency_limit=1)

        # A reload (or a second tab) shows the server's current engine and results.
        demo.load(lambda: [engine_status(state), *results_values(results_view(state))], None,
                  [status, *results_outputs])

    demo.app_state = state  # main() stops this engine on SIGTERM
    return demo


def _field_input(name: str, value: Any, visible: bool) -> gr.components.Component:
    """One Settings field as an input labelled with its KVB_ variable."""
    if field_type(name) is bool:
        return gr.Checkbox(bool(value), label=env_name(name), visible=visible, elem_id=f"kvb-field-{name}")
    return gr.Textbox(str(value), label=env_name(name), visible=visible, max_lines=1, elem_id=f"kvb-field-{name}")


def _default_requests(key: str | None) -> int | None:
    try:
        return get_scenario(key or "").default_requests or None
    except KVBridgeError:
        return None


def _safe_documents(state: AppState) -> list[str]:
    try:
        return document_choices(state)
    except Exception:  # an unreadable input/ folder must not keep the page from loading
        log.exception("listing documents failed")
        return []


def launch_app(demo: gr.Blocks, settings: Settings, **kwargs: Any) -> str:
    """Serve without blocking; returns the local URL. Theme and CSS go to launch() since Gradio 6."""
    _, url, _ = demo.queue(default_concurrency_limit=1).launch(
        server_name=settings.host, server_port=settings.port, prevent_thread_lock=True, quiet=True,
        show_error=False, ssr_mode=False, theme=APP_THEME, css=APP_CSS,
        allowed_paths=[settings.output_dir], **kwargs,
    )
    return url


def main(settings: Settings | None = None) -> int:
    """`python -m kvbridge gui`: serve until SIGTERM/SIGINT, then stop the run, the store and the engine."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings or Settings.from_env()
    for problem in settings.validate():
        print(f"Setting problem (fix it in the Engine panel or .env): {problem}", file=sys.stderr)
    state = AppState(settings)
    demo = build_app(settings, state)
    shutdown = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        shutdown.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        url = launch_app(demo, settings)
    except OSError as exc:
        print(f"Cannot serve on {settings.host}:{settings.port} (KVB_HOST / KVB_PORT): {exc}", file=sys.stderr)
        return 2
    print(f"KVBridge GUI running at {url} (stop with Ctrl+C or ./scripts/stop.sh)", flush=True)
    while not shutdown.wait(0.5):
        pass
    print("Stopping: ending the run, flushing the store, closing the engine…", flush=True)
    disconnect_engine(state)
    demo.close()
    print("Stopped.", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
