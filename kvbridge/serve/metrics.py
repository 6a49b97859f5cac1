"""Prometheus metrics of `serve` (GET /metrics), in a registry of its own, names under `kvbridge_serve_`."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


class ServeMetrics:
    def __init__(self) -> None:
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
        # per tenant (LMCache's user-specific usage): requests, prompt tokens, and how many were reused
        self.tenant_requests = Counter("kvbridge_serve_tenant_requests", "Finished requests by tenant", ["tenant"],
                                       registry=r)
        self.tenant_prompt_tokens = Counter("kvbridge_serve_tenant_prompt_tokens", "Prompt tokens by tenant",
                                            ["tenant"], registry=r)
        self.tenant_cached_tokens = Counter("kvbridge_serve_tenant_cached_tokens",
                                            "Prompt tokens reused from the tenant's own (or its group's) cache",
                                            ["tenant"], registry=r)
        self.tenant_bytes_held = Gauge("kvbridge_serve_tenant_bytes_held",
                                       "Bytes of KV the store holds in the tenant's cache, by tier (a cache "
                                       "group's is shown for each member)", ["tenant", "tier"], registry=r)
        self._salts: dict[str, set[str]] = {}   # tenant -> the cache salts its requests ran under
        self._totals: dict[str, dict[str, int]] = {}   # tenant -> the counters above, readable
        state = Gauge("kvbridge_serve_engine", "The engine's live state (running, waiting, swapped, free blocks...)",
                      ["field"], registry=r)
        self._state_gauge = state

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def finished(self, endpoint: str, record, tenant: str = "default", cache_salt: str = "") -> None:
        self.answered(endpoint, 200)
        self._salts.setdefault(tenant, set()).add(cache_salt)
        totals = self._totals.setdefault(tenant, {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
        totals["requests"] += 1
        totals["prompt_tokens"] += record.prompt_tokens
        totals["cached_tokens"] += record.matched_tokens
        self.tenant_requests.labels(tenant).inc()
        self.tenant_prompt_tokens.labels(tenant).inc(record.prompt_tokens)
        self.tenant_cached_tokens.labels(tenant).inc(record.matched_tokens)
        self.prompt_tokens.inc(record.prompt_tokens)
        self.cached_tokens.inc(record.matched_tokens)
        self.completion_tokens.inc(record.gen_tokens)
        if record.ttft_ms:
            self.ttft.observe(record.ttft_ms / 1e3)
        self.tier.labels(record.tier or "none").inc()

    def render(self, engine_state: dict[str, int],
               held: dict[str, dict[str, int]] | None = None) -> tuple[bytes, str]:
        """The text; `engine_state` and `held` (engine.bytes_held(): {cache salt: {tier: bytes}}) are what
        the app read off the engine (a thread's work, not this one's)."""
        for name, value in engine_state.items():
            self._state_gauge.labels(name).set(value)
        for tenant, usage in self.tenant_usage(held).items():
            for tier, size in usage["bytes_held"].items():
                self.tenant_bytes_held.labels(tenant, tier).set(size)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def tenant_usage(self, held: dict[str, dict[str, int]] | None = None) -> dict[str, dict]:
        """{tenant: {requests, prompt_tokens, cached_tokens, bytes_held: {tier: bytes}}} for every tenant
        that finished a request (the GUI's serve panel and /metrics)."""
        usage = {}
        for tenant, salts in sorted(self._salts.items()):
            by_tier: dict[str, int] = {}
            for salt in salts:
                for tier, size in ((held or {}).get(salt) or {}).items():
                    by_tier[tier] = by_tier.get(tier, 0) + size
            usage[tenant] = {**self._totals[tenant], "bytes_held": by_tier}
        return usage
