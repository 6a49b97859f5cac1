"""What the GUI's engine and store panels do, as plain functions over one AppState.

Place in the flow: a click in kvbridge.gui.app -> **a handler here** -> Settings / CachedEngine /
TieredStore -> a message and view data back to the page. No Gradio here, so every handler is
unit-tested without a browser. Handlers never raise into the page: a KVBridgeError becomes its
message, anything else a short message while the traceback goes to the server log. Run-time
handlers (scenario runs, the free prompt, export) live in kvbridge.gui.results.
"""
from __future__ import annotations

import logging
import threading
import typing
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.backends.registry import engine_specs, make_backend, resolve_engine
from kvbridge.settings import DEFAULT_ENV_FILE, Settings, env_name, settings_to_env, update_env_file
from kvbridge.settings.models import EMBEDDED_MODELS
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.errors import KVBridgeError
from kvbridge.engine.namespace import short_namespace
from kvbridge.engine.records import RequestRecord

log = logging.getLogger(__name__)

# Shown for every engine under "Store and generation", after the engine's own fields.
COMMON_FIELDS = ("chunk_size", "n_predict", "l1_bytes", "l2_enabled", "l2_dir", "l2_bytes")
# KVB_MODEL is what an empty KVB_MODEL_PATH falls back to, so the embedded-model choice is shown
# wherever an engine shows model_path, just above it (one rule here, not one more field per engine).
MODEL_FIELD, MODEL_PATH_FIELD = "model", "model_path"


@dataclass
class AppState:
    """Everything one GUI server holds: settings, the one engine, the current run's records.

    One engine per server, shared by every browser tab: `engine_lock` makes sure only one run,
    prompt, restart or clear uses it at a time; `stop_event` is what the runner checks to stop.
    `connecting` is the connect to the configured engine started with the server (start_connect): one
    per process, so a reload or a second tab watches it instead of starting another.
    """

    settings: Settings
    env_path: Path = DEFAULT_ENV_FILE   # the file Settings.from_env reads (not the current folder's, installed)
    engine: CachedEngine | None = None
    records: list[RequestRecord] = field(default_factory=list)
    run_meta: dict[str, Any] = field(default_factory=dict)
    stop_event: threading.Event = field(default_factory=threading.Event)
    engine_lock: threading.Lock = field(default_factory=threading.Lock)
    censuses: dict[str, tuple[Any, Future]] = field(default_factory=dict)   # a remote tier's count of its server
    connecting: Future | None = None    # start_connect's connect, done with its Outcome
    closing: threading.Event = field(default_factory=threading.Event)   # set on shutdown: a late connect closes at once
    _connect_guard: threading.Lock = field(default_factory=threading.Lock, repr=False)


@dataclass(frozen=True)
class Outcome:
    """A handler's answer: a message for the page and whether it is an error."""

    message: str
    ok: bool = True


def failure_message(action: str, exc: BaseException) -> str:
    """A readable message for the page; unexpected errors also log their traceback here."""
    if isinstance(exc, KVBridgeError):
        return f"{action} failed: {exc}"
    log.exception("%s failed", action)
    return f"{action} failed unexpectedly ({type(exc).__name__}: {exc}). Details are in the server log."


# -- the engine form --------------------------------------------------------------------------
def engine_choices() -> list[tuple[str, str]]:
    """(label, key) for the engine radio: every registered engine, nothing hard-coded."""
    return [(spec.label, spec.key) for spec in engine_specs()]


def form_fields() -> list[str]:
    """Every Settings field any engine shows, then the common ones, each once, in a stable order."""
    seen: dict[str, None] = {}
    for spec in engine_specs():
        seen.update(dict.fromkeys(f for f in _with_model_choice(spec.fields) if f not in COMMON_FIELDS))
    return [*seen, *COMMON_FIELDS]


def _with_model_choice(names: tuple[str, ...]) -> list[str]:
    """An engine's fields with KVB_MODEL put just before model_path (when the engine shows model_path)."""
    return [m for f in names for m in ((MODEL_FIELD, f) if f == MODEL_PATH_FIELD else (f,))]


def model_choices() -> list[tuple[str, str]]:
    """(label, KVB_MODEL name) for the embedded-model dropdown: every model in the table, nothing hard-coded."""
    return [(m.label, m.name) for m in EMBEDDED_MODELS.values()]


def selected_engine(settings: Settings) -> str:
    """The registry key of KVB_ENGINE (an alias is fine); the first engine when it names none."""
    try:
        return resolve_engine(settings.engine).key
    except KVBridgeError:
        return engine_specs()[0].key


def fields_for_engine(engine_key: str) -> set[str]:
    """The form fields visible while `engine_key` is selected."""
    spec = resolve_engine(engine_key)
    return set(_with_model_choice(spec.fields)) | set(COMMON_FIELDS)


def field_type(name: str) -> type:
    """The Python type of a Settings field (bool fields become checkboxes in the form)."""
    hints = typing.get_type_hints(Settings)
    return hints[name]


def form_values(settings: Settings) -> dict[str, Any]:
    """Current values for the form: bools as bools, everything else as its KVB_ text."""
    as_env = settings_to_env(settings)
    return {
        name: getattr(settings, name) if field_type(name) is bool else as_env.get(env_name(name), str(getattr(settings, name)))
        for name in form_fields()
    }


def engine_notice(engine_key: str, settings: Settings | None = None) -> str:
    """The blurb under the radio; for engines that send prompts away, a notice saying so."""
    try:
        spec = resolve_engine(engine_key)
    except KVBridgeError as exc:
        return f"**{exc}**"
    lines = [spec.blurb] if spec.blurb else []
    if getattr(spec.cls, "prompts_leave_machine", False):
        lines.append("**Notice: prompts sent with this engine leave this machine** and go to the provider's "
                     "servers; the provider's terms and costs apply. The API key itself is read from the "
                     "variable named in KVB_CLOUD_API_KEY_ENV and is never stored or shown.")
    return "\n\n".join(lines)


def settings_from_form(base: Settings, engine_key: str, values: dict[str, Any]) -> tuple[Settings | None, list[str]]:
    """New Settings from the form (base for everything not shown), plus problems for a person.

    Values go through Settings.from_env so the form accepts exactly what .env accepts (`512MiB`).
    """
    try:
        key = resolve_engine(engine_key).key
    except KVBridgeError as exc:
        return None, [str(exc)]
    env = settings_to_env(base)
    env[env_name("engine")] = key
    for name, value in values.items():
        if name not in Settings.__dataclass_fields__:
            continue
        env[env_name(name)] = ("true" if value else "false") if isinstance(value, bool) else str(value if value is not None else "").strip()
    try:
        settings = Settings.from_env(env=env, env_file=None)
    except (KVBridgeError, ValueError) as exc:
        return None, [str(exc)]
    return settings, settings.validate()


def problems_message(problems: list[str]) -> str:
    return "Please fix these settings first:\n" + "\n".join(f"- {p}" for p in problems)


# -- engine lifecycle -------------------------------------------------------------------------
def _busy() -> Outcome:
    return Outcome("The engine is busy with a run or a request; press Stop or wait for it to finish.", ok=False)


def connect_engine(state: AppState, engine_key: str, values: dict[str, Any]) -> Outcome:
    """Stop the current engine (if any) and start the chosen one with the form's settings."""
    settings, problems = settings_from_form(state.settings, engine_key, values)
    if settings is None or problems:
        return Outcome(problems_message(problems), ok=False)
    if not state.engine_lock.acquire(blocking=False):
        return _still_connecting(state) or _busy()
    state.connecting = None   # the person's own Connect: from here on its message is the one that counts
    try:
        return _connect(state, settings)
    finally:
        state.engine_lock.release()


def _connect(state: AppState, settings: Settings) -> Outcome:
    """Start the engine `settings` name in place of the current one; the caller holds engine_lock."""
    try:
        _stop_engine(state)  # first: two engines would hold two models and two stores over one L2 directory
        backend = make_backend(settings.engine, settings)
        engine = CachedEngine(settings, backend)
        engine.start()
    except Exception as exc:  # the UI boundary
        return Outcome(failure_message("Connect", exc), ok=False)
    if state.closing.is_set():   # the server stopped while the model loaded: nothing may outlive it
        engine.close()
        return Outcome("Connect abandoned: the server is stopping.", ok=False)
    state.engine, state.settings = engine, settings
    return Outcome(f"Connected: {resolve_engine(settings.engine).label}.")


# -- connecting when the server starts ----------------------------------------------------------
def connect_on_start_refusal(settings: Settings) -> str:
    """Why the configured engine is not connected on its own when the server starts; '' when it is.

    Every engine whose prompts stay on this machine connects on its own: the embedded model, a
    llama-server started or attached, Ollama. Connecting costs them only this machine's time, and
    a server that is not there is a failure message the engine panel fixes. An engine whose prompts
    go to a provider waits for Connect: its notice is read first, and connecting already calls the
    provider with the person's key.
    """
    try:
        spec = resolve_engine(settings.engine)
    except KVBridgeError as exc:
        return f"{exc}. Pick an engine and press **Connect**."
    if getattr(spec.cls, "prompts_leave_machine", False):
        return (f"{spec.label} sends prompts to the provider, so it waits for you: read the notice in the "
                "engine panel, then press **Connect**.")
    problems = settings.validate()
    return f"{problems_message(problems)}\n\nThen press **Connect**." if problems else ""


def start_connect(state: AppState) -> Future | None:
    """Connect the configured engine in the background, once per server; the connect's Future (done
    with its Outcome), or None when the engine waits for Connect (connect_on_start_refusal says why)."""
    with state._connect_guard:
        if state.connecting is not None or state.engine is not None or connect_on_start_refusal(state.settings):
            return state.connecting
        future: Future = Future()
        state.connecting = future
        state.engine_lock.acquire()   # taken here, released by the thread: a click in between finds it busy
    threading.Thread(target=_connect_in_background, args=(state, future), name="kvb-connect-on-start",
                     daemon=True).start()
    return future


def _connect_in_background(state: AppState, future: Future) -> None:
    try:   # start_connect holds engine_lock for this thread; a run that comes early waits on `future`
        outcome = _connect(state, state.settings)
    except Exception as exc:  # the future must be answered whatever happens: pages wait on it
        outcome = Outcome(failure_message("Connect", exc), ok=False)
    finally:
        state.engine_lock.release()
    if outcome.ok:
        log.info("connected on start: %s", outcome.message)
    else:
        log.warning("connecting on start failed: %s", outcome.message)
    future.set_result(outcome)


def connecting_now(state: AppState) -> bool:
    """Whether the connect started with the server is still loading."""
    future = state.connecting   # read once: the panel's own Connect may clear it meanwhile
    return future is not None and not future.done()


def start_outcome(state: AppState) -> Outcome | None:
    """The finished start-up connect's Outcome; None while it loads, or when there was none."""
    future = state.connecting
    return future.result() if future is not None and future.done() else None


def _connecting_label(state: AppState) -> str:
    try:
        return resolve_engine(state.settings.engine).label
    except KVBridgeError:
        return state.settings.engine


def connecting_message(state: AppState) -> str:
    return f"Connecting to {_connecting_label(state)}: loading the model…"


def _still_connecting(state: AppState) -> Outcome | None:
    if not connecting_now(state):
        return None
    return Outcome(f"{connecting_message(state)} Wait for it to finish, then press Connect to change engines.",
                   ok=False)


def wait_for_connect(state: AppState, timeout: float | None = None) -> None:
    """Block until the connect started with the server is done (a Run or Send pressed while it loads)."""
    future = state.connecting
    if future is not None:
        try:
            future.result(timeout=timeout)
        except TimeoutError:
            pass   # the caller finds no engine and says so


def no_engine_message(state: AppState) -> str:
    """What a button that needs an engine says when there is none: still connecting, the failed connect
    at start (fixed in the engine panel), or the plain request to connect."""
    if connecting_now(state):
        return f"{connecting_message(state)} Wait a moment, then try again."
    outcome = start_outcome(state)
    if outcome is not None and not outcome.ok:
        return f"Not connected. {outcome.message} Fix it in the Engine panel and press Connect."
    return "Connect an engine first (Engine panel, Connect)."


def connect_on_start_message(state: AppState) -> str:
    """The engine panel's message when the page opens: the start-up connect's progress or its failure."""
    if connecting_now(state):
        return connecting_message(state)
    outcome = start_outcome(state)
    if state.engine is None and outcome is not None and not outcome.ok:
        return f"⚠️ {outcome.message}"
    return ""


def _stop_engine(state: AppState) -> None:
    engine, state.engine = state.engine, None
    if engine is not None:
        try:
            engine.close()  # stops the backend, flushes L1 to L2 and closes the store
        except Exception:  # a failing stop must not keep the person from connecting another engine
            log.exception("stopping the previous engine failed")


def disconnect_engine(state: AppState, timeout: float = 20.0) -> None:
    """Stop a running scenario, then stop the engine and close its store (shutdown path); a connect
    still loading closes its engine as soon as it is up."""
    state.closing.set()
    state.stop_event.set()
    got_lock = state.engine_lock.acquire(timeout=timeout)
    try:
        _stop_engine(state)
    finally:
        if got_lock:
            state.engine_lock.release()


def save_settings(state: AppState, engine_key: str, values: dict[str, Any]) -> Outcome:
    """Write the form's settings to .env through update_env_file (never an API key value)."""
    settings, problems = settings_from_form(state.settings, engine_key, values)
    if settings is None or problems:
        return Outcome(problems_message(problems) + "\n\nNothing was written.", ok=False)
    as_env = settings_to_env(settings)
    names = [env_name("engine"), *(env_name(f) for f in values if f in Settings.__dataclass_fields__)]
    changes = {name: as_env[name] for name in names if name in as_env}
    try:
        update_env_file(state.env_path, changes)
    except Exception as exc:  # the UI boundary
        return Outcome(failure_message("Saving settings", exc), ok=False)
    return Outcome(f"Saved {len(changes)} settings to {state.env_path}.")


def restart_engine(state: AppState, drop_l1: bool = False) -> Outcome:
    """Drop the engine's context (or process) and keep the store, to show a restore afterwards."""
    if state.engine is None:
        return Outcome(no_engine_message(state), ok=False)
    if not state.engine_lock.acquire(blocking=False):
        return _busy()
    try:
        state.engine.restart_backend(drop_l1=drop_l1)
    except Exception as exc:  # the UI boundary
        return Outcome(failure_message("Restart", exc), ok=False)
    finally:
        state.engine_lock.release()
    source = "L2 (disk)" if drop_l1 else "L1 (RAM) or L2 (disk)"
    return Outcome(f"Engine restarted: its own cache is empty{' and L1 was dropped' if drop_l1 else ''}. "
                   f"The next lmcache request restores its prefix from {source}; see the tier column.")


# -- status -----------------------------------------------------------------------------------
def engine_status(state: AppState) -> str:
    """One status line: engine, where it runs, FULL or SHADOW, namespace (and budget for cloud)."""
    engine = state.engine
    if engine is None:
        if connecting_now(state):
            return f"**{connecting_message(state)}** Run waits for it; the engine panel can change it afterwards."
        outcome = start_outcome(state)
        if state.connecting is None:
            why = connect_on_start_refusal(state.settings)
        elif outcome is not None and not outcome.ok:
            why = "Connecting at start failed (the engine panel says why): fix the settings there and press **Connect**."
        else:
            why = ""
        return f"**Not connected.** {why or 'Pick an engine and press **Connect**.'}"
    backend = engine.backend
    try:
        label = resolve_engine(backend.key).label
    except KVBridgeError:
        label = backend.key
    parts = [
        f"**Engine:** {label}",
        f"**Location:** `{backend.describe()}`",
        f"**KV mode:** {backend.kv_mode.upper()}",
        f"**Namespace:** `{short_namespace(engine.namespace)}`",
    ]
    remaining_budget = getattr(backend, "remaining_budget", None)
    if callable(remaining_budget):
        left = remaining_budget()
        parts.append("**Token budget:** unlimited" if left is None else f"**Token budget left:** {left:,} tokens")
    line = " · ".join(parts) + f"\n\n<details><summary>namespace fields</summary><code>{engine.namespace}</code></details>"
    traits = getattr(engine, "traits", None)
    if backend.kv_mode == "full" and traits is not None:
        line += f"\n\n**Model:** {traits.summary()} · **KV layout:** {engine.status()['kv_layout']}"
        from kvbridge.models.matrix_rows import matrix_line   # the zoo package loads only once a model runs

        # its architecture's row of the zoo's compatibility matrix (Docs/Compatibility.md)
        line += f"\n\n**Compatibility matrix:** {matrix_line(traits.architecture)}"
    if getattr(engine, "kv_refusal", ""):
        line += f"\n\n**KV caching refused:** {engine.kv_refusal}. Every request runs uncached (`kv_refused`)."
    if backend.kv_mode == "shadow":
        line += ("\n\nSHADOW mode: this engine keeps its KV to itself. KVBridge indexes every prompt and "
                 "predicts reuse; the charts put that next to the cached tokens the engine reports.")
    if getattr(backend, "prompts_leave_machine", False):
        line += "\n\n**Prompts leave this machine** and are sent to the provider."
    return line
