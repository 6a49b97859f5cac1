"""LookupModule: how many leading chunk hashes the server holds, and in which tier each one is; on a miss,
why not (probe_miss: the eviction ring, pending writes, namespaces held) and the recent evictions."""
from __future__ import annotations

from collections import Counter

from kvbridge.cache_server.calls import Answer, Call, RequestFailed
from kvbridge.cache_server.module import DiscoverableModule, ModuleBuildContext
from kvbridge.cache_server.protocol import (PROBE_OUTCOMES, Code, Kind, LookupReply, ProbeMissReply,
                                            RecentEvictionsReply, WireEviction)

MAX_HASHES = 65536   # a 16M-token prompt at 256 tokens per chunk; more is a malformed request
MAX_CHUNK_TOKENS = 1 << 20   # tokens per hash, for the metrics only
MAX_PROBE_KEYS = 256         # keys or probes one probe_miss may name (an explainer sends 2 and up to 16)
MAX_RECENT = 100_000         # evictions one recent_evictions call may return


class LookupModule(DiscoverableModule):
    module_name = "lookup"

    def __init__(self, context) -> None:
        super().__init__(context)
        self.lookups = 0
        self.hashes_asked = 0
        self.hashes_hit = 0
        self.probes: Counter[str] = Counter()   # probe_miss answers by outcome (PROBE_OUTCOMES)

    @classmethod
    def create(cls, build_ctx: ModuleBuildContext) -> "LookupModule":
        return cls(build_ctx.server_context)

    def register_handlers(self, router) -> None:
        # On the caller's affinity thread, in order with that client's stores and releases.
        router.handle(Kind.LOOKUP, self.lookup, affinity=True, owner=self.module_name, fast=True)
        # after the caller's earlier stores (a commit sent before is seen); may ask L3: a worker, not the loop
        router.handle(Kind.PROBE_MISS, self.probe_miss, affinity=True, owner=self.module_name)
        router.handle(Kind.RECENT_EVICTIONS, self.recent_evictions, owner=self.module_name)

    def lookup(self, call: Call) -> Answer:
        """How many leading hashes are stored (and where); chunk_tokens only feeds the token metrics."""
        body = call.body
        if len(body.hashes) > MAX_HASHES:
            raise RequestFailed(Code.BAD_REQUEST, f"a lookup takes at most {MAX_HASHES} hashes, got {len(body.hashes)}")
        if not 0 <= body.chunk_tokens <= MAX_CHUNK_TOKENS:   # the protocol fuzzer's find: a negative count
            raise RequestFailed(Code.BAD_REQUEST, f"lookup chunk_tokens must be 0 to {MAX_CHUNK_TOKENS}, "
                                                  f"got {body.chunk_tokens}")
        try:
            found = self.context.store.lookup(body.hashes, body.namespace)
        except ValueError as exc:   # a key that is not a hash
            raise RequestFailed(Code.BAD_REQUEST, f"bad lookup: {exc}") from None
        self.lookups += 1
        self.hashes_asked += len(body.hashes)
        self.hashes_hit += found.n_hit
        self.context.metrics.count_lookup(len(body.hashes), found.tiers, body.chunk_tokens, body.purpose)
        return Answer(LookupReply(found.n_hit, found.tiers))

    def probe_miss(self, call: Call) -> Answer:
        """What the server knows about the keys a client's restore missed (kvbridge.store.history.MissProbe)."""
        body = call.body
        if len(body.keys) > MAX_PROBE_KEYS or len(body.probes) > MAX_PROBE_KEYS:
            raise RequestFailed(Code.BAD_REQUEST, f"probe_miss takes at most {MAX_PROBE_KEYS} keys and "
                                                  f"{MAX_PROBE_KEYS} probes, got {len(body.keys)} and {len(body.probes)}")
        try:
            found = self.context.store.probe_miss(list(body.keys), list(body.probes))
        except ValueError as exc:   # a key that is not a hash
            raise RequestFailed(Code.BAD_REQUEST, f"bad probe_miss: {exc}") from None
        if body.keys:   # a probe without keys only asks which namespaces the server holds (an engine's start)
            outcome = _outcome(found)
            self.probes[outcome] += 1
            self.context.metrics.count_probe_miss(outcome)   # kvbridge_probe_misses_total{outcome}
        return Answer(ProbeMissReply([WireEviction.of(e) if e is not None else None for e in found.history],
                                     list(found.pending), list(found.found), dict(found.namespaces), dict(found.down)))

    def recent_evictions(self, call: Call) -> Answer:
        limit = call.body.limit
        if not 0 <= limit <= MAX_RECENT:
            raise RequestFailed(Code.BAD_REQUEST, f"recent_evictions limit must be 0 to {MAX_RECENT}, got {limit}")
        return Answer(RecentEvictionsReply([WireEviction.of(e) for e in self.context.store.recent_evictions(limit)]))

    def report_status(self) -> dict:
        return {"lookups": self.lookups, "hashes_asked": self.hashes_asked, "hashes_hit": self.hashes_hit,
                "miss_probes": {outcome: self.probes[outcome] for outcome in PROBE_OUTCOMES},
                "evictions_recorded": self.context.store.history.recorded}


def _outcome(found) -> str:
    """The outcome a probe points to, in the explainer's order (kvbridge.engine.misses)."""
    if any(entry is not None and entry.gone for entry in found.history):
        return "evicted"
    if any(found.pending):
        return "pending"
    if found.down:
        return "down"
    return "other_namespace" if any(found.found) else "nothing"
