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
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.backends.registry import engine_specs, make_backend, resolve_engine
from kvbridge.gui.charts import format_bytes, tier_usages
from kvbridge.settings import PROJECT_ROOT, Settings, env_name, settings_to_env, update_env_file
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.errors import KVBridgeError
from kvbridge.engine.namespace import short_namespace
from kvbridge.engine.records import RequestRecord
from kvbridge.store.objects import StoreFault

log = logging.getLogger(__name__)

# Shown for every engine under "Store and generation", after the engine's own fields.
COMMON_FIELDS = ("chunk_size", "n_predict", "l1_bytes", "l2_enabled", "l2_dir", "l2_bytes")


@dataclass
class AppState:
    """Everything one GUI server holds: settings, the one engine, the current run's records.

    One engine per server, shared by every browser tab: `engine_lock` makes sure only one run,
    prompt, restart or clear uses it at a time; `stop_event` is what the runner checks to stop.
    """

    settings: Settings
    env_path: Path = PROJECT_ROOT / ".env"
    engine: CachedEngine | None = None
    records: list[RequestRecord] = field(default_factory=list)
    run_meta: dict[str, Any] = field(default_factory=dict)
    stop_event: threading.Event = field(default_factory=threading.Event)
    engine_lock: threading.Lock = field(default_factory=threading.Lock)
    censuses: dict[str, tuple[Any, Future]] = field(default_factory=dict)   # a remote tier's count of its server


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
        seen.update(dict.fromkeys(f for f in spec.fields if f not in COMMON_FIELDS))
    return [*seen, *COMMON_FIELDS]


def selected_engine(settings: Settings) -> str:
    """The registry key of KVB_ENGINE (an alias is fine); the first engine when it names none."""
    try:
        return resolve_engine(settings.engine).key
    except KVBridgeError:
        return engine_specs()[0].key


def fields_for_engine(engine_key: str) -> set[str]:
    """The form fields visible while `engine_key` is selected."""
    spec = resolve_engine(engine_key)
    return set(spec.fields) | set(COMMON_FIELDS)


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
        return _busy()
    try:
        _stop_engine(state)  # first: two engines would hold two models and two stores over one L2 directory
        backend = make_backend(settings.engine, settings)
        engine = CachedEngine(settings, backend)
        engine.start()
        state.engine, state.settings = engine, settings
        return Outcome(f"Connected: {resolve_engine(settings.engine).label}.")
    except Exception as exc:  # the UI boundary
        return Outcome(failure_message("Connect", exc), ok=False)
    finally:
        state.engine_lock.release()


def _stop_engine(state: AppState) -> None:
    engine, state.engine = state.engine, None
    if engine is not None:
        try:
            engine.close()  # stops the backend, flushes L1 to L2 and closes the store
        except Exception:  # a failing stop must not keep the person from connecting another engine
            log.exception("stopping the previous engine failed")


def disconnect_engine(state: AppState, timeout: float = 20.0) -> None:
    """Stop a running scenario, then stop the engine and close its store (shutdown path)."""
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
        return Outcome("Connect an engine first.", ok=False)
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
        return "**Not connected.** Pick an engine and press **Connect**."
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
    if backend.kv_mode == "shadow":
        line += ("\n\nSHADOW mode: this engine keeps its KV to itself. KVBridge indexes every prompt and "
                 "predicts reuse; the charts put that next to the cached tokens the engine reports.")
    if getattr(backend, "prompts_leave_machine", False):
        line += "\n\n**Prompts leave this machine** and are sent to the provider."
    return line


# -- the store panel --------------------------------------------------------------------------
def store_stats(state: AppState) -> dict | None:
    if state.engine is None or state.engine.store is None:
        return None
    return state.engine.store.stats()


KEY_COUNTERS = ("misses", "evictions", "corrupt")   # always shown; other counters only when not zero
REMOTE_FAULTS = ("skipped_down", "timeouts", "connection_errors", "auth_errors", "writes_refused", "server_errors")


def store_tier_names(state: AppState) -> list[str]:
    """The connected store's tiers, fastest first (what the Clear control offers); [] before Connect."""
    return list(state.engine.store.tier_names) if state.engine is not None else []


def store_census(state: AppState) -> dict[str, dict]:
    """Per tier that can count what its server holds (L3's census()): {"objects", "bytes", "capped"}, or
    {"unknown": why}. A network call on each panel refresh, waited for at most the tier's own timeout.

    A cache server's store lists no tiers here: its L3 is the server's and is not counted from this process.
    """
    store = state.engine.store if state.engine is not None else None
    return {tier.name: _census(state, tier) for tier in getattr(store, "tiers", ())
            if callable(getattr(tier, "census", None))}


def _census(state: AppState, tier: Any) -> dict:
    """tier.census() on a thread of its own, so a server with a huge keyspace cannot hold the page past
    the tier's timeout; a count still running from an earlier refresh is waited for, not started twice."""
    held = state.censuses.get(tier.name)
    if held is None or held[0] is not tier or held[1].done():
        future: Future = Future()

        def count() -> None:
            try:
                future.set_result(tier.census())
            except BaseException as exc:   # handed to the refresh waiting for it, which shows it
                future.set_exception(exc)

        threading.Thread(target=count, name=f"kvb-census-{tier.name}", daemon=True).start()
        held = state.censuses[tier.name] = (tier, future)
    timeout = float(getattr(tier, "timeout", 2.0))
    try:
        return held[1].result(timeout=timeout)
    except FutureTimeout:
        return {"unknown": f"still counting after {timeout:g} s; press Refresh later"}
    except StoreFault as fault:
        down = tier.health().get("state") == "down" if callable(getattr(tier, "health", None)) else False
        return {"unknown": f"{tier.name} down" if down else str(fault)}
    except Exception as exc:   # the page's boundary: one cell says so, the log has the traceback
        log.exception("counting %s's objects failed", tier.name)
        return {"unknown": f"the count failed ({type(exc).__name__})"}


def codec_cell(codec: str | None) -> str:
    """A persistent tier's codec; a lossy one in bold, its label already says "(lossy)"."""
    if not codec:
        return "–"
    return f"**{codec}**" if "lossy" in codec else codec


def store_markdown(stats: dict | None, census: dict[str, dict] | None = None) -> str:
    """A table of tiers (objects, bytes against capacity, hits, evictions, codec), a line per remote tier
    (reachable or down, what its server holds) and the store's counters. `census`: store_census()."""
    if not stats:
        return "No store yet: connect an engine."
    tiers = stats.get("tiers", {})
    rows = ["| tier | objects | used of capacity | full | hits | evictions | codec |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    where, remote_lines, lossy = [], [], []
    for tier in tier_usages(stats):
        extra = tiers.get(tier.name, {}) if isinstance(tiers, dict) else {}
        if tier.remote:   # no capacity of ours: the server's maxmemory is the limit, and it is shared
            objects, used, full = f"{tier.objects:,} known here", f"{format_bytes(tier.bytes_used)} known here", "n/a"
            hits = (stats.get("hits") or {}).get(tier.name, extra.get("hits", 0))
            remote_lines.append(remote_tier_line(tier.name, extra, hits, (census or {}).get(tier.name)))
        else:
            objects, used = f"{tier.objects:,}", f"{format_bytes(tier.bytes_used)} of {format_bytes(tier.capacity)}"
            full = f"{100 * tier.bytes_used / tier.capacity:.1f} %" if tier.capacity else "n/a"
            if extra.get("location"):
                where.append(f"{tier.name}: `{extra['location']}`")
        rows.append(f"| {tier.name} | {objects} | {used} | {full} | {extra.get('hits', 0):,} "
                    f"| {extra.get('evictions', 0):,} | {codec_cell(extra.get('codec'))} |")
        if "lossy" in str(extra.get("codec", "")):
            lossy.append(f"{tier.name} keeps KV as {extra['codec']}")
    counters = {k: v for k, v in stats.items() if isinstance(v, int) and not isinstance(v, bool)}
    shown = {k: v for k, v in counters.items() if k in KEY_COUNTERS or v}
    lines = ["\n".join(rows), *remote_lines]
    if lossy:
        lines.append(f"**Lossy codec:** {'; '.join(lossy)}: a restore from it is close to the engine's own KV, "
                     "not equal, so answers can differ from a cold run's.")
    if shown:
        lines.append(" · ".join(f"{k.replace('_', ' ')}: **{v:,}**" for k, v in shown.items()))
    if where:
        lines.append("Where: " + " · ".join(where))
    return "\n\n".join(line for line in lines if line)


def remote_tier_line(name: str, tier: dict, hits: int, census: dict | None) -> str:
    """A shared tier (L3) in one line: where, reachable or down, what the server holds, this process's share."""
    remote = tier.get("remote") or {}
    prefix = remote.get("prefix", "?")
    if remote.get("state") == "down":
        retry = float(remote.get("retry_in_s") or 0)
        state = (f"**down** ({remote.get('reason') or 'unreachable'}), "
                 + (f"next try in {retry:.0f} s" if retry >= 0.5 else "retried on the next request"))
    else:
        state = "**up** (reachable)"
    if census is None:
        held = "not counted from here (the cache server's tier)"
    elif "unknown" in census:
        held = f"unknown ({census['unknown']})"
    else:
        capped = "at least " if census.get("capped") else ""
        held = f"{capped}**{census['objects']:,} objects**, {format_bytes(census['bytes'])}"
    faults = ", ".join(f"{remote[k]:,} {k.replace('_', ' ')}" for k in REMOTE_FAULTS if remote.get(k))
    ttl = float(remote.get("ttl_s") or 0)
    parts = [f"**{name}** `{remote.get('url', tier.get('location', '?'))}`", f"prefix `{prefix}`", state,
             f"on the server under `{prefix}:obj:*` (every host's): {held}",
             f"this process: {hits:,} hits", f"codec {codec_cell(tier.get('codec') or remote.get('codec'))}",
             f"expiry {ttl:g} s" if ttl else "", "Redis Cluster" if remote.get("cluster") else "",
             f"faults: {faults}" if faults else ""]
    return " · ".join(p for p in parts if p)


def clear_question(state: AppState, tier: str | None) -> Outcome:
    """What Clear asks before clear_tier runs; ok=False: nothing to ask, the message says why."""
    tiers = store_tier_names(state)
    if not tiers:
        return Outcome("Connect an engine first.", ok=False)
    if tier not in tiers:
        return Outcome(f"Choose one of the store's tiers: {', '.join(tiers)}.", ok=False)
    others = ", ".join(t for t in tiers if t != tier) or "nothing else"
    remote = ((store_stats(state) or {}).get("tiers", {}).get(tier) or {}).get("remote")
    if remote:
        return Outcome(f"**Really clear {tier}?** Every KVBridge object under `{remote.get('prefix')}:obj:*` on "
                       f"`{remote.get('url')}` is deleted, every host's, not only this process's; the server's other "
                       f"keys and {others} are kept.")
    return Outcome(f"**Really clear {tier}?** Every object in {tier} is deleted; {others} is kept.")


def clear_tier(state: AppState, tier: str) -> Outcome:
    """Empty one tier (called after the person confirmed); the tiers are the store's own list."""
    if state.engine is None:
        return Outcome("Connect an engine first.", ok=False)
    names = state.engine.store.tier_names
    if tier not in names:
        return Outcome(f"This store has no tier {tier!r}; its tiers are {', '.join(names)}"
                       f"{' (L2 is off: KVB_L2_ENABLED=false)' if tier == 'L2' else ''}.", ok=False)
    if not state.engine_lock.acquire(blocking=False):
        return _busy()
    try:
        state.engine.store.clear(tier)
    except StoreFault as fault:   # L3 unreachable, a disk that cannot be listed: nothing a traceback would add
        log.warning("clearing %s failed: %s", tier, fault)
        return Outcome(f"{tier} was not cleared: {fault}. Press Clear again once it can be reached.", ok=False)
    except Exception as exc:  # the UI boundary
        return Outcome(failure_message(f"Clearing {tier}", exc), ok=False)
    finally:
        state.engine_lock.release()
    return Outcome(f"{tier} cleared.")
