"""The store panel's cache-server section: the server behind KVB_STORE_URL, who uses it, what it holds.

Place in the flow: the engine's store -> its stats() (a cache server's store carries the server's
status there) -> **this view** -> the GUI's store panel (kvbridge.gui.app). What it shows: the
server (url, connected, id, shared memory or inline bytes), its modules and their dependencies,
the clients with their liveness, the L1 page map and pressure level, and the kv_events log.

Whether the store is a cache server's is a capability of the store (it has `server_status`), checked
here and nowhere else; an embedded store shows nothing new. A server that cannot be reached is one
line saying so and what to run; the rest of the page works as before. No Gradio here.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import plotly.graph_objects as go

from kvbridge.cache_server.protocol import ServerModuleCallRequest
from kvbridge.gui.charts import format_bytes
from kvbridge.gui.page_map_chart import page_map_figure

log = logging.getLogger(__name__)

KV_EVENTS_MODULE = "kvbridge.cache_server.plugin_modules.kv_events"
ENABLE_EVENTS = f"--server-module '{{\"module_path\": \"{KV_EVENTS_MODULE}\"}}'"
EVENT_ROWS = 10


@dataclass(frozen=True)
class ServerView:
    """What the section shows; `shown` False: the store is embedded and the section stays hidden."""

    shown: bool = False
    summary: str = ""       # markdown: the server, the pressure level, modules, clients
    page_map: go.Figure = field(default_factory=lambda: page_map_figure(None))
    events: str = ""        # markdown: the event log, or how to turn it on


def server_view(state: Any, stats: dict | None) -> ServerView:
    """The section for the connected engine's store; `stats` is that store's stats() (or None)."""
    engine = state.engine
    store = getattr(engine, "store", None)
    if store is None or not callable(getattr(store, "server_status", None)):
        if engine is None and state.settings.store_url:
            return ServerView(True, f"Engines will use the cache server at `{state.settings.store_url}` "
                                    "(KVB_STORE_URL). Connect an engine to see it here.")
        return ServerView()
    server = (stats or {}).get("server")
    if server is None:   # a store whose stats() does not carry the status: ask the server itself
        server = {"url": getattr(getattr(store, "client", None), "url", "?"), "status": store.server_status()}
    status = server.get("status") or {}
    if not status:
        return ServerView(True, unreachable_markdown(server.get("url", "?")))
    storage = status.get("storage", {})
    pool = storage.get("pool", {})
    sections = [server_line(server, status), pressure_line(pool), modules_table(status),
                clients_table(status, server.get("instance_id", ""))]
    return ServerView(True, "\n\n".join(s for s in sections if s),
                      page_map_figure(storage.get("page_map"), pool.get("level", ""), pool.get("page_bytes", 0)),
                      event_log(store, status))


# -- the pieces -------------------------------------------------------------------------------
def unreachable_markdown(url: str) -> str:
    return (f"**The cache server at `{url}` cannot be reached** (KVB_STORE_URL). The engine keeps working "
            "without it: every lookup is a miss and prefixes are recomputed.\n\n"
            f"Start it from the project folder: `./scripts/cache_server.sh start --url {url}` (in the background) "
            f"or `python -m kvbridge cache-server --url {url}`, then press **Refresh**: the engine reconnects by itself.")


def server_line(server: dict, status: dict) -> str:
    facts = status.get("server", {})
    connected = "connected" if server.get("connected", True) else "**reconnecting**"
    memory = ("shared memory (same host)" if server.get("shared_memory")
              else "inline bytes (no shared memory with this process)")
    server_id = facts.get("server_id") or server.get("server_id") or ""
    tiers = " → ".join(facts.get("tier_names", []))
    parts = [f"**Cache server** `{server.get('url', facts.get('url', '?'))}`", connected,
             f"server `{server_id[:8]}`" if server_id else "", memory,
             f"up {duration(facts['uptime_s'])}" if "uptime_s" in facts else "", f"tiers {tiers}" if tiers else ""]
    return " · ".join(p for p in parts if p)


def level_badge(level: str) -> str:
    """The pressure level as a badge the page's CSS colours (kvb-level-ok ... kvb-level-critical)."""
    return f'<span class="kvb-level kvb-level-{cell(level).lower()}">{cell(level)}</span>'


def pressure_line(pool: dict) -> str:
    if not pool:
        return ""
    total = pool.get("total_pages", 0)
    refused = sum((pool.get("refused") or {}).values())
    return (f"**L1 pressure:** {level_badge(pool.get('level', '?'))} · {100 * pool.get('usage_ratio', 0):.1f} % of "
            f"{total:,} pages ({format_bytes(total * pool.get('page_bytes', 0))}) in use · "
            f"{pool.get('objects', 0):,} objects · leases {pool.get('read_leases', 0)} read, "
            f"{pool.get('write_leases', 0)} write · evictions {pool.get('evictions', 0):,} · "
            f"refused {refused:,} · revoked {pool.get('revoked', 0):,} · "
            f"quarantined pages {pool.get('quarantined_pages', 0):,}")


def modules_table(status: dict) -> str:
    rows = status.get("server", {}).get("modules", [])
    if not rows:
        return ""
    lines = ["**Modules** (built in dependency order; plugins are named with --server-module)", "",
             "| module | depends on | source |", "| --- | --- | --- |"]
    for row in rows:
        source = "--server-module" if row.get("external") else "built-in"
        lines.append(f"| {cell(row.get('name', '?'))} | {cell(', '.join(row.get('dependencies', [])) or '–')} "
                     f"| {source} |")
    return "\n".join(lines)


def clients_table(status: dict, own_instance: str = "") -> str:
    management = status.get("management", {})
    clients = management.get("clients", [])
    reap = management.get("reap_timeout_s", 0) or 0
    rule = f"dropped after {duration(reap)} without a request" if reap else "never dropped (reaper off)"
    if not clients:
        return f"**Clients:** none registered ({rule})."
    lines = [f"**Clients** ({len(clients)}; {rule})", "",
             "| client | label (host) | prio | idle | requests | up |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for c in sorted(clients, key=lambda c: c.get("connected_s", 0), reverse=True):
        iid = c.get("instance_id", "")
        who = f"`{iid[:8]}`" + (" (this engine)" if iid and iid == own_instance else "")
        idle = c.get("idle_s", 0)
        quiet = " **quiet**" if reap and idle > reap / 2 else ""   # past half the timeout: heartbeats are missing
        label = f"{c.get('label') or 'pid ' + str(c.get('pid', '?'))} ({c.get('hostname', '?')})"
        lines.append(f"| {who} | {cell(label)} | {c.get('priority', '?')} | {duration(idle)}{quiet} "
                     f"| {c.get('requests', 0):,} | {duration(c.get('connected_s', 0))} |")
    return "\n".join(lines)


def event_log(store: Any, status: dict) -> str:
    """The newest kv_events, newest first; without that module, the line that turns it on."""
    if "kv_events" not in status:
        return ("**Event log:** off. Start the cache server with the kv_events module to see every store, "
                f"eviction and removal here:\n\n`python -m kvbridge cache-server {ENABLE_EVENTS}`")
    info = status["kv_events"]
    head = (f"**Event log** (kv_events: {info.get('published', 0):,} published, {info.get('dropped', 0):,} dropped; "
            f"subscribe to `{info.get('endpoint', '?')}`, topics {', '.join(info.get('topics', []))})")
    try:
        recent = recent_events(store.client, EVENT_ROWS)
    except Exception as exc:   # the page's boundary: any failure is this one line and a log entry
        log.warning("kv_events.recent from the cache server failed: %s", exc)
        return f"{head}\n\nThe recent events could not be read: {exc}"
    if not recent:
        return f"{head}\n\nNo events yet: store something (run a scenario in lmcache mode)."
    lines = [head, "", "| seq | time | event | tier | key | size |", "| ---: | --- | --- | --- | --- | ---: |"]
    for e in reversed(recent):
        lines.append(f"| {e.get('seq', '?')} | {time.strftime('%H:%M:%S', time.localtime(e.get('time', 0)))} "
                     f"| {cell(e.get('event', '?'))} | {cell(e.get('tier', '?'))} | `{str(e.get('key', ''))[:16]}` "
                     f"| {format_bytes(e.get('size', 0))} |")
    return "\n".join(lines)


def recent_events(client: Any, limit: int) -> list[dict]:
    """kv_events.recent through the server-module envelope; RuntimeError carries the server's refusal."""
    request = ServerModuleCallRequest("kv_events.recent", msgspec.msgpack.encode({"limit": limit}))
    response = client.server_module_call(request).result(timeout=client.timeout_s)
    if not response.success:
        raise RuntimeError(response.error)
    return list(msgspec.msgpack.decode(response.payload).get("events", []))


def duration(seconds: float) -> str:
    seconds = float(seconds or 0)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    return f"{minutes // 60} h {minutes % 60} min"


def cell(text: Any) -> str:
    """Text for a markdown table cell: a | would end the cell, a newline the row."""
    return str(text).replace("|", "\\|").replace("\n", " ")
