"""The store panel's logic, without Gradio: the tiers table, L3's line (reachable or down, what its
server holds), and the Clear control's question and action. app.py lays it out; tests call it directly.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any

from kvbridge.gui.charts import format_bytes, tier_hit_rates_from_records, tier_usages
from kvbridge.gui.handlers import AppState, Outcome, _busy, failure_message, no_engine_message
from kvbridge.store.objects import StoreFault

log = logging.getLogger(__name__)


def store_stats(state: AppState) -> dict | None:
    if state.engine is None or state.engine.store is None:
        return None
    return state.engine.store.stats()


def tier_hit_rates(state: AppState) -> dict[str, float]:
    """{tier: share of lmcache prompt tokens restored from it}: the engine's Metrics (every request this engine
    ran), or the shown run's records where the engine counts none."""
    if state.engine is None:
        return {}
    rates = getattr(state.engine.metrics, "tier_hit_rates", None)
    counted = rates() if callable(rates) else {}
    return counted or tier_hit_rates_from_records(state.records)


EVICTIONS_SHOWN = 12   # the store panel's list of recent evictions


def evictions_markdown(state: AppState, limit: int = EVICTIONS_SHOWN) -> str | None:
    """The store's newest evictions (store.recent_evictions), newest first; None when the store keeps no
    history it can list (the panel hides the list then)."""
    store = state.engine.store if state.engine is not None else None
    recent = getattr(store, "recent_evictions", None)
    if not callable(recent):
        return None
    try:
        entries = list(recent(limit))
    except StoreFault as fault:   # a cache server that does not answer: the list says so, the page stays
        return f"**Recent evictions:** unknown ({fault})"
    if not entries:
        return "**Recent evictions:** none yet (a miss whose objects were evicted names the eviction here)."
    now = time.time()
    rows = ["**Recent evictions** (newest first; `kvbridge explain` lists a prompt's own):", "",
            "| key | what happened |", "| --- | --- |"]
    rows += [f"| `{e.key.hex()[:12]}` | {e.describe(now)} |" for e in entries[:limit]]
    return "\n".join(rows)


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
             f"on the server under `{remote.get('objects_under') or prefix + ':obj:*'}` (every host's): {held}",
             f"this process: {hits:,} hits", f"codec {codec_cell(tier.get('codec') or remote.get('codec'))}",
             f"expiry {ttl:g} s" if ttl else "", "Redis Cluster" if remote.get("cluster") else "",
             f"faults: {faults}" if faults else ""]
    return " · ".join(p for p in parts if p)


def clear_question(state: AppState, tier: str | None) -> Outcome:
    """What Clear asks before clear_tier runs; ok=False: nothing to ask, the message says why."""
    tiers = store_tier_names(state)
    if not tiers:
        return Outcome(no_engine_message(state), ok=False)
    if tier not in tiers:
        return Outcome(f"Choose one of the store's tiers: {', '.join(tiers)}.", ok=False)
    others = ", ".join(t for t in tiers if t != tier) or "nothing else"
    remote = ((store_stats(state) or {}).get("tiers", {}).get(tier) or {}).get("remote")
    if remote:
        under = remote.get("objects_under") or f"{remote.get('prefix')}:obj:*"   # S3 names its own place
        return Outcome(f"**Really clear {tier}?** Every KVBridge object under `{under}` on "
                       f"`{remote.get('url')}` is deleted, every host's, not only this process's; the server's other "
                       f"keys and {others} are kept.")
    return Outcome(f"**Really clear {tier}?** Every object in {tier} is deleted; {others} is kept.")


def clear_tier(state: AppState, tier: str) -> Outcome:
    """Empty one tier (called after the person confirmed); the tiers are the store's own list."""
    if state.engine is None:
        return Outcome(no_engine_message(state), ok=False)
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
