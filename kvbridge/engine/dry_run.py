"""A dry run of a restore: what a prompt would restore from where, and why the rest would not, without evaluating it.

Place in the flow: prompt -> tokens -> chunk hashes -> lookup -> fetch + confirm (ChunkKV.find_prefix) -> **stop**:
nothing is assembled, restored, prefilled or stored -> the MissExplainer names the cause of the first token not
restorable (one store call on a miss) -> the eviction history of the prompt's own keys. `kvbridge explain` prints it.

The namespace every key is seeded with needs the KV layout's digest (kvbridge.engine.layout), and the layout is
proven on a real state of the engine, never guessed: GGUF metadata would predict a plain model's row sizes, but
a wrong guess names another namespace and every stored prompt would read as `none_stored`, silently. So the engine
is started as for a request (the model loaded, the layout probe's few tokens evaluated) and the prompt itself is
not. Reads behave as any read does: an L2 hit is promoted into this process's L1 and an L3 hit copied into L2.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from kvbridge.errors import EmptyPrompt
from kvbridge.engine.cached_engine import PROBE_TEXT, CachedEngine
from kvbridge.engine.chunks import ChunkKV
from kvbridge.engine.hashing import make_hasher, tail_key
from kvbridge.engine.misses import MissExplainer, MissReport
from kvbridge.engine.restore_plan import RestorePlan
from kvbridge.engine.shadow_index import ShadowIndex
from kvbridge.store.history import MIN_HISTORY, Eviction

JSON_VERSION = "kvbridge-explain-1"   # the --json schema's name; bumped when a field changes meaning


@dataclass
class DryRun:
    """What a restore of one prompt would do now, and why it would stop where it stops."""

    namespace: str
    kv_mode: str                   # "full" (KV restored) or "shadow" (the engine keeps its KV: a prediction)
    layout: str                    # how the KV layout behind the namespace was learnt, for a person
    prompt_tokens: int
    chunks_total: int
    chunks_hit: int = 0
    restorable_tokens: int = 0     # what an lmcache request would restore now (at most kvbridge.engine.cold_cut.restorable)
    tier: str = "none"             # the slowest tier a restorable piece comes from
    hit_tiers: dict[str, int] = field(default_factory=dict)
    reason: str = ""               # kvbridge.engine.misses.MISS_REASONS; "" when everything restorable is
    detail: str = ""
    at_token: int = 0              # the first prompt position not restorable
    store_calls: int = 0           # lookup + fetch + the explainer's probe
    explain_ms: float = 0.0
    key_history: list[Eviction] = field(default_factory=list)       # this prompt's keys evicted, newest first
    recent_evictions: list[Eviction] = field(default_factory=list)  # the store's newest evictions (--evictions)
    history_available: bool = False   # the store keeps an eviction ring it can list (recent_evictions)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """Plain JSON data (`kvbridge explain --json`); keys as hex."""
        return {
            "schema": JSON_VERSION, "namespace": self.namespace, "kv_mode": self.kv_mode, "layout": self.layout,
            "prompt_tokens": self.prompt_tokens, "chunks_total": self.chunks_total, "chunks_hit": self.chunks_hit,
            "restorable_tokens": self.restorable_tokens, "tier": self.tier, "hit_tiers": dict(self.hit_tiers),
            "miss": {"reason": self.reason, "detail": self.detail, "at_token": self.at_token},
            "store_calls": self.store_calls, "explain_ms": round(self.explain_ms, 3),
            "key_history": [eviction_dict(e) for e in self.key_history] if self.history_available else None,
            "recent_evictions": [eviction_dict(e) for e in self.recent_evictions] if self.history_available else None,
            "notes": list(self.notes),
        }


def eviction_dict(e: Eviction, now: float | None = None) -> dict:
    return {"key": e.key.hex(), "namespace": e.namespace, "tier": e.tier, "reason": e.reason, "at": e.at,
            "policy": e.policy, "for_key": e.for_key.hex(), "for_kind": e.for_kind, "for_size": e.for_size,
            "size": e.size, "gone": e.gone, "text": e.describe(now)}


def layout_text(engine: CachedEngine, start_s: float) -> str:
    """How the engine learnt its KV layout, for the output: the probe is the only thing evaluated."""
    if engine.backend.kv_mode != "full":
        return "none: a shadow engine keeps its KV; the namespace is its fingerprint"
    if engine.kv_refusal:
        return f"refused ({engine.kv_refusal})"
    if engine.geometry is None:
        return "whole snapshots (the engine's state is not read here, so no layout was probed)"
    probe = len(engine.backend.tokenize(PROBE_TEXT))
    return (f"{engine.geometry.summary()}; proven by the engine's layout probe (the model loaded and ~{probe} probe "
            f"tokens evaluated, {start_s:.1f} s); the prompt itself was not evaluated")


def dry_run(engine: CachedEngine, prompt: str | Sequence[dict], *, namespace: str | None = None,
            evictions: int = 0) -> DryRun:
    """What `engine` (started) would restore of `prompt` now and why not the rest; nothing is written.

    `namespace`: another namespace of the same layout to look under (a cache salt's, see
    kvbridge.scheduler.salts.salt_namespace); `evictions`: how many of the store's newest evictions to list.
    """
    p = engine.prepare(prompt)
    tokens = [int(t) for t in p.tokens]
    if not tokens:
        raise EmptyPrompt("The prompt has no tokens for this engine's tokenizer; there is nothing to explain.")
    namespace = namespace or engine.namespace
    settings = engine.settings
    hasher = engine.hasher if namespace == engine.namespace else make_hasher(
        settings.chunk_size, namespace, settings.prefer_lmcache_hasher)
    seed = getattr(hasher, "seed", b"")
    hashes = hasher.chunk_hashes(tokens)
    out = DryRun(namespace=namespace, kv_mode=engine.backend.kv_mode, layout="", prompt_tokens=len(tokens),
                 chunks_total=len(hashes))
    if p.approx_tokens:
        out.notes.append("token figures come from an approximate tokenizer")
    started = time.perf_counter()
    report, plan = _explain(engine, namespace, seed, tokens, hashes, out)
    out.explain_ms = (time.perf_counter() - started) * 1000
    if plan is not None:
        out.restorable_tokens, out.chunks_hit, out.tier = plan.matched_tokens, plan.chunks_hit, plan.tier
        out.store_calls = plan.store_calls + report.round_trips
        out.notes.extend(plan.notes)
    out.hit_tiers = dict(report.hit_tiers)
    out.reason, out.detail, out.at_token = report.reason, report.detail, report.at_token
    _history(engine.store, namespace, _prompt_keys(hashes, seed), evictions, out)
    return out


def _explain(engine: CachedEngine, namespace: str, seed: bytes, tokens: list[int], hashes: list[bytes],
             out: DryRun) -> tuple[MissReport, RestorePlan | None]:
    """The plan a restore would make (lookup, fetch, confirm; released at once) and the cause of what it lacks."""
    settings, store = engine.settings, engine.store
    if engine.backend.kv_mode == "full" and engine.kv_refusal:
        return MissExplainer.fixed("refused", f"the architecture is refused: {engine.kv_refusal}"), None
    if engine.backend.kv_mode == "full":
        # the engine's own ChunkKV keeps what this process failed to store (window_incomplete); a salt gets its own
        kv = engine._kv if namespace == engine.namespace else ChunkKV(store, namespace, seed, settings.chunk_size,
                                                                      engine.geometry)
        kv.cold_cut = engine._kv is not None and engine._kv.cold_cut   # cut where the engine's restores are cut
        kv.cut_rule = engine.cut_rule
        hot, kv.hot_restores = kv.hot_restores, False   # read what a fresh restore reads, not a state held
        try:
            plan = kv.find_prefix(tokens, hashes)
        finally:
            kv.hot_restores = hot
        plan.release()   # nothing is assembled: the store's loans go back at once
        explainer = kv.misses
    else:
        index = engine._index if namespace == engine.namespace else ShadowIndex(store, namespace, seed,
                                                                                settings.chunk_size)
        chunks_hit, predicted, tier = index.predict(tokens, hashes)
        plan = RestorePlan(matched_tokens=predicted, chunks_hit=chunks_hit, tier=tier, store_calls=2)
        plan.add_tokens(tier, predicted)
        explainer = index.misses
    explainer.detokenize = engine.backend.detokenize
    # the owner's tool: other cache salts' namespaces are named too (serve never shows a tenant that)
    return explainer.explain(tokens, hashes, plan, probe=settings.explain_misses, across_salts=True), plan


def _prompt_keys(hashes: Sequence[bytes], seed: bytes) -> set[bytes]:
    """Every key a store could hold of this prompt: its chunks and the tail at each boundary."""
    return {*hashes, tail_key(seed), *(tail_key(h) for h in hashes)}


def _history(store, namespace: str, keys: set[bytes], limit: int, out: DryRun) -> None:
    """The store's eviction ring: this prompt's keys in it, and the newest `limit` entries (hidden when absent)."""
    recent = getattr(store, "recent_evictions", None)
    if not callable(recent):
        out.notes.append("this store keeps no eviction history it can list")
        return
    entries = list(recent(max(limit, MIN_HISTORY)))
    out.history_available = True
    out.key_history = [e for e in entries if e.key in keys and e.namespace in ("", namespace)]
    out.recent_evictions = entries[:max(0, limit)]
