"""The cache server's metrics in one place: a private Prometheus registry and what the loop records.

The server core records request latencies and refused requests here; the store's own numbers
(hits per tier, evictions, leases, pressure) are read from ServerStore.stats() when Prometheus
scrapes (kvbridge.cache_server.modules.metrics registers that collector and serves the text).
Names follow Prometheus conventions under the `kvbridge_` prefix.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# request kinds whose latency has its own histogram (the lookup / retrieve / store)
_TIMED = {"lookup": "lookup", "retrieve": "retrieve", "store_prepare": "store", "store_commit": "store",
          "store_inline": "store"}


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.request_errors = Counter("kvbridge_request_errors", "Requests answered with an error, by code",
                                      ["code"], registry=self.registry)
        self.requests = Counter("kvbridge_requests", "Requests served, by kind", ["kind"], registry=self.registry)
        self.lookup_requested_tokens = Counter("kvbridge_lookup_requested_tokens",
                                               "Tokens covered by the chunk hashes clients looked up",
                                               registry=self.registry)
        self.lookup_hit_tokens = Counter("kvbridge_lookup_hit_tokens",
                                         "Tokens covered by the leading chunks a lookup found", registry=self.registry)
        self.latency = {name: Histogram(f"kvbridge_{name}_seconds", f"Time to serve a {name} request in the server",
                                        buckets=_LATENCY_BUCKETS, registry=self.registry)
                        for name in sorted(set(_TIMED.values()))}

    def observe_request(self, kind: str, seconds: float) -> None:
        self.requests.labels(kind).inc()
        timed = _TIMED.get(kind)
        if timed:
            self.latency[timed].observe(seconds)

    def count_error(self, code: str) -> None:
        self.request_errors.labels(code).inc()

    def count_lookup(self, requested_tokens: int, hit_tokens: int) -> None:
        self.lookup_requested_tokens.inc(requested_tokens)
        self.lookup_hit_tokens.inc(hit_tokens)

    def value(self, name: str, labels: dict | None = None) -> float:
        """One sample's current value (0 when absent): for status and tests."""
        return self.registry.get_sample_value(name, labels or {}) or 0.0
