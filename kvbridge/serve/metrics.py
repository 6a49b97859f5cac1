"""Prometheus metrics of `serve` (GET /metrics), names under `kvbridge_serve_`, in two views.

The operator's view (the key in KVB_SERVE_ADMIN_KEY_ENV, or anyone when no key is configured) is the
whole registry: requests by endpoint and status, the global token and reuse counters, TTFT, tiers,
the engine's state, and every tenant's series with the bytes of KV held in its cache. A tenant's view
is only the series labelled with that tenant, counting its own completions: nothing global, of the
process, the engine or the store moves in it when another tenant asks (a tenant must not learn when,
what size or whether another's request hit).

Per-tenant state is a bounded LRU (TENANTS_KEPT): the tenants file bounds it already, and no
client-chosen value (a request's `cache_salt`) becomes a key of it; bytes held are summed per cache
group from the engine's {cache salt: bytes} at render time.

Why prompts missed (issue 35): prompt tokens reused by tier (`kvbridge_serve_hit_tokens_total{tier}`), and
requests and prompt tokens by the cause of their miss (`kvbridge_serve_misses_total{reason}`,
`kvbridge_serve_miss_tokens_total{reason}`), so a per-tier hit rate is hit tokens over prompt tokens. The
operator's series count the true causes; a tenant's (`kvbridge_serve_tenant_...`) the causes as that tenant
was shown them (kvbridge.serve.misses). A miss its own salt's namespaces leave `none_stored` may be held under
another salt: that probe runs only after the answer has left (`finished` hands it back to run then), so the
operator's count of that request's cause lands a moment after the answer, and the tenant's timing never
includes it (issue 46).

llama-server's names (`llamacpp:*`, its README's /metrics table) stand beside KVBridge's in the operator's view,
fed from the same finished requests (LlamaCounts), so a Grafana panel made for llama-server keeps working:
`prompt_tokens_total` counts the prompt tokens computed (llama-server leaves cached ones out: here, restored and
shared ones), `prompt_seconds_total` the time from admission to the first token (restore, prefill and the first
step), `tokens_predicted_total` and `tokens_predicted_seconds_total` the answer's tokens and the time after the
first, `requests_processing` and `requests_deferred` the engine's running and waiting requests.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvbridge.engine.misses import MISS_REASONS, parse_hit_tiers
from kvbridge.serve.tenants import group_of

log = logging.getLogger(__name__)
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
HIT_TIERS = ("context", "L1", "L2", "L3")   # where reused prompt tokens come from (the record's hit_tiers)
TENANTS_KEPT = 1024   # tenants with counters; past it the least recently served is forgotten
_COUNTERS = {
    "requests": "Finished requests by tenant",
    "prompt_tokens": "Prompt tokens by tenant",
    "cached_tokens": "Prompt tokens reused from the tenant's own (or its group's) cache",
    "completion_tokens": "Generated tokens by tenant",
}
# the per-tenant families with a second label: field -> (label, doc)
_LABELLED = {
    "hit_tokens": ("tier", "Prompt tokens reused by tenant, by where they came from (context, L1, L2, L3)"),
    "misses": ("reason", "Finished requests that missed by tenant, by the cause the tenant was shown"),
    "miss_tokens": ("reason", "Prompt tokens computed because of a miss by tenant, by the cause the tenant was shown"),
}


@dataclass
class LlamaCounts:
    """llama-server's counters, as its /metrics names them (see the module docstring for what each counts here)."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    tokens_predicted: int = 0
    tokens_predicted_seconds: float = 0.0
    requests_processing: int = 0
    requests_deferred: int = 0

    def add(self, record) -> None:
        self.prompt_tokens += max(0, record.prompt_tokens - record.matched_tokens)
        self.prompt_seconds += max(0.0, record.ttft_ms - record.queue_ms) / 1e3
        self.tokens_predicted += record.gen_tokens
        self.tokens_predicted_seconds += max(0.0, record.total_ms - record.ttft_ms) / 1e3


class _LlamaSeries:
    """llama-server's families (`llamacpp:*`), read off LlamaCounts at render time."""

    def __init__(self, counts: LlamaCounts, lock: threading.Lock) -> None:
        self._counts, self._lock = counts, lock

    def collect(self):
        with self._lock:
            c = LlamaCounts(**asdict(self._counts))
        for name, value, doc in (
                ("prompt_tokens", c.prompt_tokens, "Number of prompt tokens processed."),
                ("prompt_seconds", c.prompt_seconds, "Prompt process time"),
                ("tokens_predicted", c.tokens_predicted, "Number of generation tokens processed."),
                ("tokens_predicted_seconds", c.tokens_predicted_seconds, "Predict process time")):
            family = CounterMetricFamily(f"llamacpp:{name}", doc)   # the family adds llama-server's _total
            family.add_metric([], value)
            yield family
        for name, value, doc in (
                ("prompt_tokens_seconds", c.prompt_tokens / c.prompt_seconds if c.prompt_seconds else 0.0,
                 "Average prompt throughput in tokens/s."),
                ("predicted_tokens_seconds",
                 c.tokens_predicted / c.tokens_predicted_seconds if c.tokens_predicted_seconds else 0.0,
                 "Average generation throughput in tokens/s."),
                ("requests_processing", c.requests_processing, "Number of requests processing."),
                ("requests_deferred", c.requests_deferred, "Number of requests deferred.")):
            yield GaugeMetricFamily(f"llamacpp:{name}", doc, value=value)


@dataclass
class TenantCounts:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)    # by tier
    misses: dict[str, int] = field(default_factory=dict)        # by reason
    miss_tokens: dict[str, int] = field(default_factory=dict)   # by reason


class ServeMetrics:
    def __init__(self, tenants_kept: int = TENANTS_KEPT) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvbridge_serve_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("kvbridge_serve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("kvbridge_serve_cached_tokens",
                                     "Prompt tokens restored or shared instead of prefilled", registry=r)
        self.completion_tokens = Counter("kvbridge_serve_completion_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("kvbridge_serve_ttft_seconds", "Time to first token of finished requests",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tier = Counter("kvbridge_serve_requests_by_tier", "Finished requests by where their reused KV came from",
                            ["tier"], registry=r)
        self.hit_tokens = Counter("kvbridge_serve_hit_tokens", "Prompt tokens reused, by where they came from "
                                  "(context: cells resident in the scheduler; L1, L2, L3: the store's tiers)", ["tier"],
                                  registry=r)
        self.misses = Counter("kvbridge_serve_misses", "Finished requests that missed, by the cause of the first "
                              "prompt token not reused (a full hit is not counted)", ["reason"], registry=r)
        self.miss_tokens = Counter("kvbridge_serve_miss_tokens", "Prompt tokens computed because of a miss, by its "
                                   "cause", ["reason"], registry=r)
        for reason in MISS_REASONS:   # every cause present from the start, so rates and rules see zeros
            self.misses.labels(reason)
            self.miss_tokens.labels(reason)
        for tier in HIT_TIERS:   # likewise every tier: a series born at its first hit makes rate() overshoot
            self.hit_tokens.labels(tier)
        self._state_gauge = Gauge("kvbridge_serve_engine",
                                  "The engine's live state (running, waiting, swapped, free blocks...)", ["field"],
                                  registry=r)
        self._kept = tenants_kept
        self._tenants: OrderedDict[str, TenantCounts] = OrderedDict()   # least recently served first
        self._groups: dict[str, str] = {}   # tenant -> its cache group's salt (group_of), for bytes held
        self._lock = threading.Lock()       # the GUI's lab reads tenant_usage from its own thread
        self.llama = LlamaCounts()          # llama-server's names for the same requests (operator's view only)
        r.register(_LlamaSeries(self.llama, self._lock))

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def finished(self, endpoint: str, record, tenant: str = "default", cache_salt: str = "",
                 shown=None) -> Callable[[], None] | None:
        """A request answered; `shown`: the miss as its client saw it (kvbridge.serve.misses.MissView), which the
        tenant's series count (the record's own cause when not given). Returns what to run once the answer has
        left (the probe across other salts' namespaces, then the operator's count of the true cause), or None
        when everything is counted already."""
        self.answered(endpoint, 200)
        hits = parse_hit_tiers(record.hit_tiers)
        missed = max(0, record.prompt_tokens - record.matched_tokens)
        shown_reason = record.miss_reason if shown is None else ("" if shown.reason == "hit" else shown.reason)
        with self._lock:
            counts = self._tenants.pop(tenant, None) or TenantCounts()
            self._tenants[tenant] = counts                       # the most recently served, last
            self._groups[tenant] = group_of(cache_salt)
            while len(self._tenants) > self._kept:
                forgotten, _ = self._tenants.popitem(last=False)
                self._groups.pop(forgotten, None)
            counts.requests += 1
            counts.prompt_tokens += record.prompt_tokens
            counts.cached_tokens += record.matched_tokens
            counts.completion_tokens += record.gen_tokens
            for tier, n in hits.items():
                counts.hit_tokens[tier] = counts.hit_tokens.get(tier, 0) + n
            if shown_reason:
                counts.misses[shown_reason] = counts.misses.get(shown_reason, 0) + 1
                counts.miss_tokens[shown_reason] = counts.miss_tokens.get(shown_reason, 0) + missed
            self.llama.add(record)
        self.prompt_tokens.inc(record.prompt_tokens)
        self.cached_tokens.inc(record.matched_tokens)
        self.completion_tokens.inc(record.gen_tokens)
        if record.ttft_ms:
            self.ttft.observe(record.ttft_ms / 1e3)
        self.tier.labels(record.tier or "none").inc()
        for tier, n in hits.items():
            self.hit_tokens.labels(tier).inc(n)
        later = getattr(record, "operator_probe", None) if record.miss_reason == "none_stored" else None
        record.operator_probe = None   # taken: the record no longer holds the prompt's tokens for it
        if later is not None:
            return lambda: self._count_miss(_true_reason(later, record.miss_reason), missed)
        if record.miss_reason:
            self._count_miss(record.miss_reason, missed)
        return None

    def _count_miss(self, reason: str, missed: int) -> None:
        self.misses.labels(reason).inc()
        self.miss_tokens.labels(reason).inc(missed)

    @property
    def tenants_held(self) -> int:
        return len(self._tenants)

    def render(self, engine_state: dict[str, int],
               held: dict[str, dict[str, int]] | None = None) -> tuple[bytes, str]:
        """The operator's text; `engine_state` and `held` (engine.bytes_held(): {cache salt: {tier: bytes}})
        are what the app read off the engine (a thread's work, not this one's)."""
        for name, value in engine_state.items():
            self._state_gauge.labels(name).set(value)
        with self._lock:
            self.llama.requests_processing = engine_state.get("running", 0)
            self.llama.requests_deferred = engine_state.get("waiting", 0)
        with self._lock:
            tenants = list(self._tenants)
        return self._text(self.registry, tenants, held, with_bytes=True), CONTENT_TYPE_LATEST

    def render_tenant(self, tenant: str) -> tuple[bytes, str]:
        """One tenant's text: its own counters, and nothing else."""
        return self._text(CollectorRegistry(), [tenant], None, with_bytes=False), CONTENT_TYPE_LATEST

    def tenant_usage(self, held: dict[str, dict[str, int]] | None = None) -> dict[str, dict]:
        """{tenant: {requests, prompt_tokens, cached_tokens, completion_tokens, bytes_held: {tier: bytes}}}
        for every tenant kept (the GUI's serve panel and the operator's /metrics)."""
        by_group: dict[str, dict[str, int]] = {}
        for salt, tiers in (held or {}).items():
            group = by_group.setdefault(group_of(salt), {})
            for tier, size in tiers.items():
                group[tier] = group.get(tier, 0) + size
        with self._lock:
            return {tenant: {**{name: getattr(counts, name) for name in _COUNTERS},
                             "bytes_held": dict(by_group.get(self._groups[tenant], {}))}
                    for tenant, counts in sorted(self._tenants.items())}

    def counts(self, tenant: str) -> TenantCounts:
        """A copy of one tenant's counters (zeros when it has not been served, or was forgotten)."""
        with self._lock:
            return TenantCounts(**asdict(self._tenants.get(tenant) or TenantCounts()))

    def _text(self, registry: CollectorRegistry, tenants: list[str], held, with_bytes: bool) -> bytes:
        collector = _TenantSeries(self, tenants, held, with_bytes)
        registry.register(collector)
        try:
            return generate_latest(registry)
        finally:
            registry.unregister(collector)


def _true_reason(probe: Callable[[], tuple[str, str] | None], shown: str) -> str:
    """The cause the probe across other salts names, else `shown`; a store error is counted as `shown` (the
    probe is the operator's insight, never the request's failure), and logged."""
    try:
        cause = probe()
    except Exception as exc:   # a storage error after the answer left: the cause stays the one shown, logged
        log.warning("the probe across other cache salts failed (%r): counted as %s", exc, shown)
        return shown
    return cause[0] if cause else shown


class _TenantSeries:
    """The per-tenant families, for the tenants asked about (a tenant not served yet shows zeros)."""

    def __init__(self, metrics: ServeMetrics, tenants: list[str], held, with_bytes: bool) -> None:
        self._metrics, self._tenants, self._held, self._with_bytes = metrics, tenants, held, with_bytes

    def collect(self):
        counts = {t: self._metrics.counts(t) for t in self._tenants}
        for field, doc in _COUNTERS.items():
            family = CounterMetricFamily(f"kvbridge_serve_tenant_{field}", doc, labels=["tenant"])
            for tenant, c in counts.items():
                family.add_metric([tenant], getattr(c, field))
            yield family
        for name, (label, doc) in _LABELLED.items():
            family = CounterMetricFamily(f"kvbridge_serve_tenant_{name}", doc, labels=["tenant", label])
            for tenant, c in counts.items():
                for value, n in sorted(getattr(c, name).items()):
                    family.add_metric([tenant, value], n)
            yield family
        if self._with_bytes:
            family = GaugeMetricFamily("kvbridge_serve_tenant_bytes_held",
                                       "Bytes of KV the store holds in the tenant's cache, by tier (a cache group's "
                                       "is shown for each member)", labels=["tenant", "tier"])
            for tenant, usage in self._metrics.tenant_usage(self._held).items():
                for tier, size in usage["bytes_held"].items():
                    family.add_metric([tenant, tier], size)
            yield family
