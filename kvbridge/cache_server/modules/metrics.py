"""MetricsModule: Prometheus text on http://127.0.0.1:PORT/metrics (--metrics-port or KVB_CACHE_SERVER_METRICS_PORT).

Counters the server loop records live in kvbridge.cache_server.metrics.ServerMetrics (lookups by purpose, a
prompt's looked-up and hit tokens by tier, miss probes by outcome); the store's
numbers (hits per tier, evictions, refused stores, revoked leases, leases and pins, L1 usage and
pressure level, connected clients) are read from the store when Prometheus scrapes, by the
collector registered here. Without a port the module still exists (its status shows the numbers)
but no HTTP endpoint is opened.
"""
from __future__ import annotations

import logging

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvbridge.cache_server.module import DiscoverableModule, ModuleBuildContext

log = logging.getLogger("kvbridge.cache_server")
_LEVELS = {"OK": 0, "SOFT": 1, "HARD": 2, "CRITICAL": 3}


class StoreCollector:
    """Reads ServerStore.stats() and the client table at scrape time."""

    def __init__(self, context) -> None:
        self.context = context

    def describe(self):
        return []

    def collect(self):
        stats = self.context.store.stats()
        pool, counts = stats["pool"], stats["counts"]
        hits = CounterMetricFamily("kvbridge_hits", "Objects served, by the tier they were found in", labels=["tier"])
        for tier, n in stats["hits"].items():
            hits.add_metric([tier], n)
        yield hits
        yield CounterMetricFamily("kvbridge_misses", "Retrieves that found nothing", value=counts.get("misses", 0))
        yield CounterMetricFamily("kvbridge_stores", "Objects stored", value=counts.get("stores", 0))
        yield CounterMetricFamily("kvbridge_retrieves", "Objects retrieved (any tier)",
                                  value=sum(stats["hits"].values()))
        yield CounterMetricFamily("kvbridge_evictions", "Objects evicted from L1", value=pool["evictions"])
        refused = CounterMetricFamily("kvbridge_refused_stores", "Stores refused, by reason", labels=["reason"])
        for reason, n in sorted(pool["refused"].items()):
            refused.add_metric([reason], n)
        yield refused
        yield CounterMetricFamily("kvbridge_revoked_leases", "Write leases revoked under CRITICAL pressure",
                                  value=pool["revoked"])
        yield CounterMetricFamily("kvbridge_expired_leases", "Leases not released in time", value=pool["expired"])
        yield CounterMetricFamily("kvbridge_write_queue_full", "Disk writes dropped because the writer queue was full",
                                  value=counts.get("write_queue_full", 0))
        leases = GaugeMetricFamily("kvbridge_leases", "Live leases on L1 pages", labels=["kind"])
        leases.add_metric(["read"], pool["read_leases"])
        leases.add_metric(["write"], pool["write_leases"])
        yield leases
        yield GaugeMetricFamily("kvbridge_pinned_objects", "L1 objects held by a live read lease",
                                value=pool["leased_objects"])
        yield GaugeMetricFamily("kvbridge_l1_usage_ratio", "Share of L1 pages not free", value=pool["usage_ratio"])
        yield GaugeMetricFamily("kvbridge_l1_pressure_level", "0 OK, 1 SOFT, 2 HARD, 3 CRITICAL",
                                value=_LEVELS.get(pool["level"], 0))
        yield GaugeMetricFamily("kvbridge_l1_quarantined_pages", "Pages held back after a lease expired or was revoked",
                                value=pool["quarantined_pages"])
        yield GaugeMetricFamily("kvbridge_connected_clients", "Registered clients", value=len(self.context.clients))


class MetricsModule(DiscoverableModule):
    module_name = "metrics"

    def __init__(self, context, port: int) -> None:
        super().__init__(context)
        self.registry = context.metrics.registry
        context.metrics.show_tiers(context.store.tier_names)   # each tier's hit series at 0 before its first hit
        self.collector = StoreCollector(context)
        self.registry.register(self.collector)
        self.port = port
        self._http = None
        if port:
            self._http, _ = start_http_server(port, addr="127.0.0.1", registry=self.registry)
            log.info("Prometheus metrics on http://127.0.0.1:%d/metrics", port)

    @classmethod
    def create(cls, build_ctx: ModuleBuildContext) -> "MetricsModule":
        return cls(build_ctx.server_context, build_ctx.server_context.metrics_port or 0)

    def report_status(self) -> dict:
        metrics = self.context.metrics
        tiers = self.context.store.tier_names
        return {"endpoint": f"http://127.0.0.1:{self.port}/metrics" if self.port else "",
                "lookup_requested_tokens": metrics.value("kvbridge_lookup_requested_tokens_total"),
                "lookup_hit_tokens": metrics.value("kvbridge_lookup_hit_tokens_total"),
                "lookup_hit_tokens_by_tier": {tier: metrics.value("kvbridge_lookup_tier_hit_tokens_total",
                                                                  {"tier": tier}) for tier in tiers}}

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        try:
            self.registry.unregister(self.collector)
        except KeyError:
            pass
