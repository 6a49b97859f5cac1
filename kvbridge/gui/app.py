"""The Gradio testbed: pick an engine, run a scenario in cold/native/lmcache, read TTFT off charts.

Place in the flow: a person -> **this page** -> handlers (kvbridge.gui.handlers, kvbridge.gui.results) ->
CachedEngine -> records -> charts. This module only lays out components and wires events; every
decision lives in the handlers, which are tested without a browser. One engine per server
(AppState); runs stream through Gradio's queue on worker threads, so the page stays responsive.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading
from types import SimpleNamespace
from typing import Any

import gradio as gr

from kvbridge.gui.handlers import (
    AppState, Outcome, connect_engine, connect_on_start_message, connecting_message, connecting_now,
    disconnect_engine, engine_choices, engine_notice, engine_status, field_type, fields_for_engine, form_fields,
    form_values, model_choices, restart_engine, save_settings, selected_engine, start_connect,
    COMMON_FIELDS, MODEL_FIELD,
)
from kvbridge.gui.labels import setting_input
from kvbridge.gui.store_panel import (
    clear_question, clear_tier, evictions_markdown, store_census, store_markdown, store_stats, store_tier_names,
    tier_hit_rates,
)
from kvbridge.gui.results import (
    RAG_SCENARIO, ResultsView, corpus_choices, document_choices, export_results, free_prompt, records_table,
    request_stop, results_view, run_stream, scenario_choices, scenario_description,
)
from kvbridge.gui.charts import store_figure, tier_hit_rate_figure
from kvbridge.gui.lab import LabSession
from kvbridge.gui.lab_tab import TABLE_CLASS as LAB_TABLE_CLASS, build_lab_tab
from kvbridge.gui.server_panel import ServerView, server_view
from kvbridge.settings import Settings
from kvbridge.errors import KVBridgeError
from kvbridge.engine.modes import default_mode_names, mode_names
from kvbridge.bench.common.scenarios import get_scenario

__all__ = ["AppState", "build_app", "launch_app", "main"]
log = logging.getLogger(__name__)

APP_THEME = gr.themes.Soft(primary_hue="blue", neutral_hue="slate")
APP_CSS = """
.gradio-container {max-width: 1400px !important}
#kvb-status {background: #eff6ff; border: 1px solid #bfdbfe; border-radius: 8px; padding: 8px 12px}
#kvb-notice strong {color: #b45309}
#kvb-notice:has(strong) {background: #fffbeb; border: 1px solid #fcd34d; border-radius: 8px; padding: 4px 12px}
.kvb-message p {margin: 4px 0}
#kvb-summary > p:first-child, #kvb-summary p:first-of-type {font-size: 1.15em}
#kvb-results-table {font-size: 12px}
.kvb-level {font-weight: 700; padding: 1px 8px; border-radius: 6px; color: white}
.kvb-level-ok {background: #16a34a} .kvb-level-soft {background: #ca8a04}
.kvb-level-hard {background: #ea580c} .kvb-level-critical {background: #dc2626}
"""
APP_CSS += f".{LAB_TABLE_CLASS} th .header {{white-space: nowrap}}\n"   # one-line headers; a wide table scrolls
MODE_HELP = ("cold: no reuse (baseline) · native: the engine's own prefix cache · lmcache: restored from KVBridge's "
             "store · blend: stored passages reused at any position (approximate; prompts cut by KVB_BLEND_SEPARATOR)")


def _message(outcome: Outcome | ResultsView) -> str:
    """Show the message in the page; errors also pop up as a warning toast."""
    if not outcome.ok:
        gr.Warning(" ".join(outcome.message.split())[:300])  # the toast: the whole message on one line
        return f"⚠️ {outcome.message}"
    return outcome.message


def build_app(settings: Settings, state: AppState | None = None, lab: LabSession | None = None) -> gr.Blocks:
    """The whole page; `state` (one per server) defaults to a fresh AppState over `settings`, `lab` (the
    KV cache lab's scheduler and run) to a fresh LabSession."""
    state = state or AppState(settings)
    lab = lab or LabSession(settings)
    ui = SimpleNamespace()  # the components event wiring needs, by name
    with gr.Blocks(title="KVBridge testbed", analytics_enabled=False) as demo:
        gr.Markdown("# KVBridge testbed\nHow much time-to-first-token does reusing KV save? The engine your "
                    "settings name connects when the GUI starts (change it in the engine panel); run a scenario in "
                    "several modes, and compare. " + MODE_HELP)
        with gr.Tabs():
            with gr.Tab("Testbed", id="testbed", elem_id="kvb-tab-testbed"):
                ui.status = gr.Markdown(engine_status(state), elem_id="kvb-status")
                with gr.Row(equal_height=False):
                    with gr.Column(scale=1):
                        _engine_panel(ui, settings)
                    with gr.Column(scale=1):
                        _scenario_panel(ui, state)
                _results_panel(ui)
                with gr.Row(equal_height=False):
                    with gr.Column(scale=1):
                        _prompt_panel(ui, settings)
                    with gr.Column(scale=1):
                        _store_panel(ui, state)
            with gr.Tab("KV cache lab", id="lab", elem_id="kvb-tab-lab"):
                build_lab_tab(lab)
        _wire(ui, state, demo)
    demo.app_state = state  # main() stops this engine on SIGTERM
    demo.lab = lab          # ... and closes the lab's scheduler
    return demo


# -- layout -------------------------------------------------------------------------------------
def _engine_panel(ui: SimpleNamespace, settings: Settings) -> None:
    gr.Markdown("## 1 · Engine")
    selected = selected_engine(settings)
    ui.engine_radio = gr.Radio(engine_choices(), value=selected, label="Engine", elem_id="kvb-engine")
    ui.notice = gr.Markdown(engine_notice(selected), elem_id="kvb-notice")
    values, visible = form_values(settings), fields_for_engine(selected)
    ui.fields = form_fields()
    ui.inputs = {}
    with gr.Accordion("Engine settings", open=True):
        for name in ui.fields:
            if name not in COMMON_FIELDS:
                ui.inputs[name] = _field_input(name, values[name], name in visible)
    with gr.Accordion("Store and generation settings", open=False):
        for name in COMMON_FIELDS:
            ui.inputs[name] = _field_input(name, values[name], True)
    with gr.Row():
        ui.connect_btn = gr.Button("Connect", variant="primary", elem_id="kvb-connect")
        ui.save_btn = gr.Button("Save settings to .env", elem_id="kvb-save")
    ui.engine_msg = gr.Markdown(elem_classes="kvb-message", elem_id="kvb-engine-msg")


def _scenario_panel(ui: SimpleNamespace, state: AppState) -> None:
    gr.Markdown("## 2 · Scenario")
    scenarios = scenario_choices()
    first = scenarios[0][1] if scenarios else None
    ui.scenario = gr.Dropdown(scenarios, value=first, label="Scenario", elem_id="kvb-scenario")
    ui.description = gr.Markdown(scenario_description(first) if first else "")
    ui.modes = gr.CheckboxGroup(list(mode_names()), value=list(default_mode_names()), label="Modes to run", info=MODE_HELP,
                                elem_id="kvb-modes")
    with gr.Row():
        ui.n_requests = gr.Number(value=_default_requests(first), precision=0, minimum=1, label="Requests per mode",
                                  info="The scenario's questions or turns, repeated if you ask for more.",
                                  elem_id="kvb-n-requests")
        docs = _safe_documents(state)
        ui.document = gr.Dropdown(docs, value=docs[0] if docs else None, label="Document",
                                  info="Built-in documents and files in input/.", elem_id="kvb-document",
                                  visible=first != RAG_SCENARIO)
        corpora = corpus_choices()
        ui.corpus = gr.Dropdown(corpora, value=corpora[0], label="Corpus",
                                info="The handbook the RAG questions are asked about (bench --corpus).",
                                elem_id="kvb-corpus", visible=first == RAG_SCENARIO)
    with gr.Row():
        ui.run_btn = gr.Button("Run", variant="primary", elem_id="kvb-run")
        ui.stop_btn = gr.Button("Stop", variant="stop", elem_id="kvb-stop")
    ui.run_progress = gr.Markdown("", elem_id="kvb-progress", min_height=44)  # the progress bar shows here
    ui.run_msg = gr.Markdown(elem_classes="kvb-message", elem_id="kvb-run-msg")


def _results_panel(ui: SimpleNamespace) -> None:
    gr.Markdown("## 3 · Results")
    ui.summary = gr.Markdown(elem_id="kvb-summary")
    with gr.Row():
        ui.speedup_plot = gr.Plot(show_label=False, elem_id="kvb-plot-speedup")   # the headline
        ui.summary_plot = gr.Plot(show_label=False, elem_id="kvb-plot-summary")
    with gr.Row():
        ui.ttft_plot = gr.Plot(show_label=False, elem_id="kvb-plot-ttft")
        ui.hits_plot = gr.Plot(show_label=False, elem_id="kvb-plot-hits")
    ui.stages_plot = gr.Plot(show_label=False, elem_id="kvb-plot-stages")
    ui.shadow_plot = gr.Plot(show_label=False, visible=False, elem_id="kvb-plot-shadow")
    # the task's quality against speed, for a scenario that knows the answers (rag)
    ui.facts_plot = gr.Plot(show_label=False, visible=False, elem_id="kvb-plot-facts")
    ui.table = gr.Dataframe(records_table([]), label="Requests", interactive=False, wrap=False, max_height=420,
                            elem_id="kvb-results-table")
    with gr.Row():
        ui.export_btn = gr.Button("Export (CSV, JSON, HTML report)", elem_id="kvb-export", scale=0, min_width=300)
        ui.export_msg = gr.Markdown(elem_classes="kvb-message", elem_id="kvb-export-msg")
    ui.export_files = gr.File(label="Exported files", file_count="multiple", visible=False,
                              elem_id="kvb-export-files")


def _prompt_panel(ui: SimpleNamespace, settings: Settings) -> None:
    gr.Markdown("## 4 · Free prompt")
    ui.prompt = gr.Textbox(lines=4, max_lines=8, label="Prompt", elem_id="kvb-prompt",
                           placeholder="Ask anything; send it twice in lmcache mode to see a restore.")
    with gr.Row():
        ui.prompt_mode = gr.Radio(list(mode_names()), value="lmcache", label="Mode", elem_id="kvb-prompt-mode")
        ui.prompt_tokens = gr.Number(value=settings.n_predict, precision=0, minimum=1, elem_id="kvb-prompt-tokens",
                                     **setting_input("n_predict", note="starts here; changes this prompt only"))
    ui.send_btn = gr.Button("Send", variant="primary", elem_id="kvb-send")
    ui.prompt_msg = gr.Markdown(elem_classes="kvb-message", elem_id="kvb-prompt-msg")
    ui.answer = gr.Textbox(label="Answer", lines=4, interactive=False, elem_id="kvb-answer")
    ui.prompt_record = gr.Dataframe(records_table([]), label="Its record", interactive=False, max_height=160)


def _store_panel(ui: SimpleNamespace, state: AppState) -> None:
    gr.Markdown("## 5 · Store")
    census = store_census(state)   # before stats(): a count that finds L3 down shows it down in the same view
    stats = store_stats(state)
    ui.store_md = gr.Markdown(store_markdown(stats, census), elem_id="kvb-store")
    ui.store_plot = gr.Plot(store_figure(stats), show_label=False, elem_id="kvb-plot-store")
    ui.hit_rate_plot = gr.Plot(tier_hit_rate_figure(tier_hit_rates(state), store_tier_names(state)), show_label=False,
                               elem_id="kvb-plot-tier-hit-rate")
    evictions = evictions_markdown(state)   # None: the store keeps no eviction history it can list
    ui.evictions_md = gr.Markdown(evictions or "", visible=evictions is not None, elem_id="kvb-evictions")
    server = server_view(state, stats)   # shown only when the store is a cache server's (KVB_STORE_URL)
    with gr.Column(visible=server.shown, elem_id="kvb-server-panel") as ui.server_box:
        ui.server_md = gr.Markdown(server.summary, elem_id="kvb-server")
        ui.page_map_plot = gr.Plot(server.page_map, show_label=False, elem_id="kvb-plot-pages")
        ui.events_md = gr.Markdown(server.events, elem_id="kvb-server-events")
    tiers = store_tier_names(state)   # the store's own tiers, fastest first (none before Connect)
    with gr.Row():
        ui.refresh_btn = gr.Button("Refresh")
        ui.tier_choice = gr.Dropdown(tiers, value=tiers[0] if tiers else None, label="Tier", elem_id="kvb-tier",
                                     scale=0, min_width=120)
        ui.clear_btn = gr.Button("Clear tier…", elem_id="kvb-clear")
    ui.pending_tier = gr.State(None)
    with gr.Row(visible=False) as ui.confirm_row:
        ui.confirm_md = gr.Markdown()
        ui.confirm_btn = gr.Button("Yes, clear it", variant="stop", elem_id="kvb-confirm-clear")
        ui.cancel_btn = gr.Button("Cancel")
    with gr.Row():
        ui.drop_l1 = gr.Checkbox(False, label="Also drop L1 (as a process restart would: next restore from L2)")
        ui.restart_btn = gr.Button("Restart engine", elem_id="kvb-restart")
    ui.store_msg = gr.Markdown(elem_classes="kvb-message", elem_id="kvb-store-msg")


# -- events -------------------------------------------------------------------------------------
def _wire(ui: SimpleNamespace, state: AppState, demo: gr.Blocks) -> None:
    """Connect clicks to handlers. Engine-using events run one at a time on Gradio's worker threads."""
    field_inputs = [ui.inputs[name] for name in ui.fields]
    store_outputs = [ui.store_md, ui.store_plot, ui.tier_choice, ui.server_box, ui.server_md, ui.page_map_plot,
                     ui.events_md, ui.hit_rate_plot, ui.evictions_md]
    results_outputs = [ui.status, ui.run_msg, ui.summary, ui.speedup_plot, ui.summary_plot, ui.ttft_plot,
                       ui.hits_plot, ui.stages_plot, ui.shadow_plot, ui.facts_plot, ui.table, *store_outputs]

    def store_values(choose_first_tier: bool = False) -> list[Any]:
        census = store_census(state)   # before stats(), as in _store_panel
        stats = store_stats(state)
        tiers = store_tier_names(state)
        choice = gr.update(choices=tiers, value=tiers[0] if tiers else None) if choose_first_tier \
            else gr.update(choices=tiers)
        evictions = evictions_markdown(state)
        return [store_markdown(stats, census), store_figure(stats), choice, *_server_values(server_view(state, stats)),
                tier_hit_rate_figure(tier_hit_rates(state), tiers),
                gr.update(value=evictions or "", visible=evictions is not None)]

    def results_values(view: ResultsView, choose_first_tier: bool = False) -> list[Any]:
        figs = view.figures
        shadow = gr.update(value=figs.get("shadow"), visible=view.has_shadow)
        facts = gr.update(value=figs.get("facts"), visible=view.has_facts)
        return [engine_status(state), _message(view), view.summary, figs["speedup"], figs["ttft_summary"],
                figs["ttft_per_request"], figs["hits"], figs["stages"], shadow, facts, view.table,
                *store_values(choose_first_tier)]

    # engine
    def on_engine_change(key: str) -> list[Any]:
        shown = fields_for_engine(key)
        return [engine_notice(key), *(gr.update(visible=(name in shown)) for name in ui.fields)]

    def on_connect(key: str, *values: Any) -> list[Any]:
        outcome = connect_engine(state, key, dict(zip(ui.fields, values)))
        return [engine_status(state), _message(outcome), gr.update(choices=_safe_documents(state)),
                *store_values(choose_first_tier=True)]

    def on_save(key: str, *values: Any) -> str:
        return _message(save_settings(state, key, dict(zip(ui.fields, values))))

    ui.engine_radio.change(on_engine_change, ui.engine_radio, [ui.notice, *field_inputs], queue=False)
    ui.connect_btn.click(on_connect, [ui.engine_radio, *field_inputs],
                         [ui.status, ui.engine_msg, ui.document, *store_outputs], show_progress_on=[ui.engine_msg])
    ui.save_btn.click(on_save, [ui.engine_radio, *field_inputs], ui.engine_msg)

    # runs, streamed: one update per request; Stop bypasses the queue so it works mid-run
    def on_run(key: str, modes: list[str], n: Any, doc: str | None, corpus: str | None, progress=gr.Progress()):
        for view in run_stream(state, key, modes, n, doc, progress=progress, corpus=corpus):
            yield results_values(view)

    def on_export() -> list[Any]:
        outcome, paths = export_results(state)
        return [_message(outcome), gr.update(value=paths or None, visible=bool(paths))]

    def on_scenario(key: str) -> list[Any]:
        # the rag scenario asks about a corpus, not a document: the page shows the picker the scenario reads
        return [scenario_description(key), _default_requests(key), gr.update(visible=key != RAG_SCENARIO),
                gr.update(visible=key == RAG_SCENARIO)]

    ui.scenario.change(on_scenario, ui.scenario, [ui.description, ui.n_requests, ui.document, ui.corpus], queue=False)
    ui.run_btn.click(on_run, [ui.scenario, ui.modes, ui.n_requests, ui.document, ui.corpus], results_outputs,
                     concurrency_limit=1, show_progress_on=[ui.run_progress])
    ui.stop_btn.click(lambda: _message(request_stop(state)), None, ui.run_msg, queue=False)
    ui.export_btn.click(on_export, None, [ui.export_msg, ui.export_files])

    # free prompt
    def on_send(text: str, mode: str, n: Any) -> list[Any]:
        result = free_prompt(state, text, mode, n)
        return [_message(result), result.answer, result.record, engine_status(state), *store_values()]

    ui.send_btn.click(on_send, [ui.prompt, ui.prompt_mode, ui.prompt_tokens],
                      [ui.prompt_msg, ui.answer, ui.prompt_record, ui.status, *store_outputs])

    # store: Clear asks first (the tier waits in pending_tier until Yes or Cancel)
    def ask_clear(tier: str | None) -> list[Any]:
        question = clear_question(state, tier)
        return [tier if question.ok else None, gr.update(visible=question.ok), question.message]

    def on_confirm_clear(tier: str | None) -> list[Any]:
        outcome = clear_tier(state, tier or "")
        return [None, gr.update(visible=False), *store_values(), _message(outcome)]

    def on_restart(drop_l1: bool) -> list[Any]:
        outcome = restart_engine(state, drop_l1)
        return [engine_status(state), *store_values(), _message(outcome)]

    confirm_outputs = [ui.pending_tier, ui.confirm_row, ui.confirm_md]
    ui.refresh_btn.click(lambda: [*store_values(), ""], None, [*store_outputs, ui.store_msg], queue=False)
    ui.clear_btn.click(ask_clear, ui.tier_choice, confirm_outputs, queue=False)
    ui.cancel_btn.click(lambda: [None, gr.update(visible=False)], None, confirm_outputs[:2], queue=False)
    ui.confirm_btn.click(on_confirm_clear, ui.pending_tier, [*confirm_outputs[:2], *store_outputs, ui.store_msg])
    ui.restart_btn.click(on_restart, ui.drop_l1, [ui.status, *store_outputs, ui.store_msg])

    # a reload (or a second tab) shows the server's current engine and results; while the engine that
    # main() connects on start still loads, the page says so and fills in once it is up (every open tab
    # watches the one connect: not queued behind each other, nothing connects twice)
    def on_open():
        loading = state.connecting if connecting_now(state) else None
        yield [*results_values(results_view(state)), connect_on_start_message(state), gr.update()]
        if loading is not None:
            outcome = loading.result()
            yield [*results_values(results_view(state), choose_first_tier=True), _message(outcome),
                   gr.update(choices=_safe_documents(state))]

    demo.load(on_open, None, [*results_outputs, ui.engine_msg, ui.document], concurrency_limit=None,
              show_progress="hidden")


def _server_values(view: ServerView) -> list[Any]:
    """The cache-server section's outputs: its visibility, then summary, page map, event log."""
    return [gr.update(visible=view.shown), view.summary, view.page_map if view.shown else gr.update(),
            view.events]


def _field_input(name: str, value: Any, visible: bool) -> gr.components.Component:
    """One Settings field as an input: a label in words, its KVB_ variable as the hint beneath."""
    text = setting_input(name)
    if field_type(name) is bool:
        return gr.Checkbox(bool(value), visible=visible, elem_id=f"kvb-field-{name}", **text)
    if name == MODEL_FIELD:
        # allow_custom_value: an unknown name from .env stays visible, and validate() names it on Connect
        return gr.Dropdown(model_choices(), value=str(value), visible=visible, allow_custom_value=True,
                           elem_id=f"kvb-field-{name}", **text)
    return gr.Textbox(str(value), visible=visible, max_lines=1, elem_id=f"kvb-field-{name}", **text)


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


def main(settings: Settings | None = None, serve: bool = False) -> int:
    """`python -m kvbridge gui [--serve]`: serve until SIGTERM/SIGINT, then stop the run, the store and the
    engine. With --serve, the OpenAI-compatible endpoint runs beside it on KVB_SERVE_PORT, and the lab
    tab watches its scheduler."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings or Settings.from_env()
    for problem in settings.validate():
        print(f"Setting problem (fix it in the Engine panel or .env): {problem}", file=sys.stderr)
    state = AppState(settings)
    lab = LabSession(settings)
    serving = None
    if serve:
        try:
            serving = _start_serving(settings, lab)
        except KVBridgeError as exc:
            print(f"Cannot start the serve endpoint: {exc}", file=sys.stderr)
            lab.close()
            return 2
    demo = build_app(settings, state, lab)
    try:
        url = launch_app(demo, settings)
    except OSError as exc:
        log.debug("launch failed: %s", exc)
        print(f"Cannot serve on {settings.host}:{settings.port}: the port is in use or the address is not "
              "available here. Set KVB_PORT to a free port (or KVB_HOST to an address of this machine).",
              file=sys.stderr)
        return 2
    connecting = start_connect(state)   # the configured engine, so the first Run runs (handlers say which)
    if connecting is not None:
        print(f"{connecting_message(state)} The page says when it is ready.", flush=True)
        connecting.add_done_callback(lambda done: _print_connected(done.result()))
    shutdown = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        shutdown.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"KVBridge GUI running at {url} (stop with Ctrl+C or ./scripts/stop.sh)", flush=True)
    while not shutdown.wait(0.5):
        pass
    print("Stopping: ending the run, flushing the store, closing the engine…", flush=True)
    if serving is not None:
        serve_endpoint, serve_engine = serving
        serve_endpoint.stop(settings.serve_drain_timeout + 5)
        serve_engine.close()
    demo.lab.close()
    disconnect_engine(state)
    demo.close()
    print("Stopped.", flush=True)
    return 0


def _print_connected(outcome: Outcome) -> None:
    """The terminal's line once the start-up connect is done (the page says the same)."""
    if outcome.ok:
        print(f"{outcome.message} Run is ready on the page.", flush=True)
    else:
        print(f"{outcome.message} Fix it in the page's engine panel and press Connect.", file=sys.stderr, flush=True)


def _start_serving(settings: Settings, lab: LabSession):
    """The serve endpoint on its own port in this process, its scheduler attached to the lab."""
    from kvbridge.serve.engines import SchedulerEngine
    from kvbridge.serve.server import BackgroundServe

    engine = SchedulerEngine(settings)
    try:
        endpoint = BackgroundServe(settings, engine)
    except BaseException:
        engine.close()
        raise
    lab.attach(engine.scheduler, usage=lambda: endpoint.metrics.tenant_usage(engine.bytes_held()))
    print(f"KVBridge serve ready on {endpoint.url} (beside the GUI)", flush=True)
    return endpoint, engine


if __name__ == "__main__":
    sys.exit(main())
