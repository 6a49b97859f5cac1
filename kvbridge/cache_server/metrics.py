"""The cache server's metrics in one place: a private Prometheus registry and what the loop records.

The server core records request latencies and refused requests here; the store's own numbers
(hits per tier, evictions, leases, pressure) are read from ServerStore.stats() when Prometheus
scrapes (kvbridge.cache_server.modules.metrics registers that collector and serves the text).
Names follow Prometheus conventions under the `kvbridge_` prefix.

Hit rate: only lookups made for a prompt's restore (protocol.Lookup.purpose "prompt") count tokens, so
`rate(kvbridge_lookup_tier_hit_tokens_total{tier="L1"}) / rate(kvbridge_lookup_requested_tokens_total)` is the
share of looked-up prompt tokens the server held in L1. A writer's checks ("store") and KV-event rechecks
("kv_events", issue 34) ask about objects just written or long published: counted apart, by purpose, in
kvbridge_lookups_total and kvbridge_lookup_hashes_total (deploy/prometheus/rules.yml, Docs/Prometheus.md).
"""
from __future__ import annotations

from collections import Counter as Tally
from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvbridge.cache_server.protocol import LOOKUP_PURPOSES, PROBE_OUTCOMES

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# request kinds whose latency has its own histogram (the lookup / retrieve / store)
_TIMED = {"lookup": "lookup", "retrieve": "retrieve", "store_prepare": "store", "store_commit": "store",
          "store_inline": "store", "store_granted": "store"}
OTHER_PURPOSE = "other"   # the label of a purpose this server does not know (a newer client): no client mints labels
HIT_RATE_PURPOSE = "prompt"


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.request_errors = Counter("kvbridge_request_errors", "Requests answered with an error, by code",
                                      ["code"], registry=r)
        self.requests = Counter("kvbridge_requests", "Requests served, by kind", ["kind"], registry=r)
        self.lookup_requested_tokens = Counter("kvbridge_lookup_requested_tokens",
                                               "Tokens covered by the chunk hashes clients looked up for a prompt",
                                               registry=r)
        self.lookup_hit_tokens = Counter("kvbridge_lookup_hit_tokens",
                                         "Tokens covered by the leading chunks a prompt's lookup found", registry=r)
        self.lookup_tier_hit_tokens = Counter("kvbridge_lookup_tier_hit_tokens",
                                              "Tokens covered by the leading chunks a prompt's lookup found, by the "
                                              "tier holding each chunk", ["tier"], registry=r)
        self.lookups = Counter("kvbridge_lookups", "Lookups served, by why the client asked (prompt, store, "
                               "kv_events)", ["purpose"], registry=r)
        self.lookup_hashes = Counter("kvbridge_lookup_hashes", "Chunk hashes looked up (result=asked) and found "
                                     "(result=hit), by purpose", ["purpose", "result"], registry=r)
        self.probe_misses = Counter("kvbridge_probe_misses", "Miss probes answered, by what they found first",
                                    ["outcome"], registry=r)
        self.latency = {name: Histogram(f"kvbridge_{name}_seconds", f"Time to serve a {name} request in the server",
                                        buckets=_LATENCY_BUCKETS, registry=r)
                        for name in sorted(set(_TIMED.values()))}
        # every series a rule reads exists from the start at 0, so rate() has a value before the first hit
        # (the tiers' once the store is known: show_tiers)
        for purpose in LOOKUP_PURPOSES:
            self.lookups.labels(purpose)
            for result in ("asked", "hit"):
                self.lookup_hashes.labels(purpose, result)
        for outcome in PROBE_OUTCOMES:
            self.probe_misses.labels(outcome)

    def show_tiers(self, tier_names: Sequence[str]) -> None:
        """Export each tier's hit-token series at 0 before its first hit."""
        for tier in tier_names:
            self.lookup_tier_hit_tokens.labels(tier)

    def observe_request(self, kind: str, seconds: float) -> None:
        self.requests.labels(kind).inc()
        timed = _TIMED.get(kind)
        if timed:
            self.latency[timed].observe(seconds)

    def count_error(self, code: str) -> None:
        self.request_errors.labels(code).inc()

    def count_lookup(self, n_asked: int, hit_tiers: Sequence[str], chunk_tokens: int = 0,
                     purpose: str = HIT_RATE_PURPOSE) -> None:
        """One lookup: `hit_tiers` the tier of each leading chunk found; only a prompt's lookup counts tokens."""
        purpose = purpose if purpose in LOOKUP_PURPOSES else OTHER_PURPOSE
        self.lookups.labels(purpose).inc()
        self.lookup_hashes.labels(purpose, "asked").inc(n_asked)
        self.lookup_hashes.labels(purpose, "hit").inc(len(hit_tiers))
        if purpose != HIT_RATE_PURPOSE:
            return
        self.lookup_requested_tokens.inc(n_asked * chunk_tokens)
        self.lookup_hit_tokens.inc(len(hit_tiers) * chunk_tokens)
        if chunk_tokens:
            for tier, n in Tally(hit_tiers).items():
                self.lookup_tier_hit_tokens.labels(tier).inc(n * chunk_tokens)

    def count_probe_miss(self, outcome: str) -> None:
        """One probe_miss answer, by the first thing it found (PROBE_OUTCOMES, in the explainer's order)."""
        self.probe_misses.labels(outcome if outcome in PROBE_OUTCOMES else "nothing").inc()

    def value(self, name: str, labels: dict | None = None) -> float:
        """One sample's current value (0 when absent): for status and tests."""
        return self.registry.get_sample_value(name, labels or {}) or 0.0
