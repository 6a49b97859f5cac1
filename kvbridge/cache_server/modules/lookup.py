"""LookupModule: how many leading chunk hashes the server holds, and in which tier each one is."""
from __future__ import annotations

from kvbridge.cache_server.calls import Answer, Call, RequestFailed
from kvbridge.cache_server.module import DiscoverableModule, ModuleBuildContext
from kvbridge.cache_server.protocol import Code, Kind, LookupReply

MAX_HASHES = 65536   # a 16M-token prompt at 256 tokens per chunk; more is a malformed request
MAX_CHUNK_TOKENS = 1 << 20   # tokens per hash, for the metrics only


class LookupModule(DiscoverableModule):
    module_name = "lookup"

    def __init__(self, context) -> None:
        super().__init__(context)
        self.lookups = 0
        self.hashes_asked = 0
        self.hashes_hit = 0

    @classmethod
    def create(cls, build_ctx: ModuleBuildContext) -> "LookupModule":
        return cls(build_ctx.server_context)

    def register_handlers(self, router) -> None:
        # On the caller's affinity thread, in order with that client's stores and releases.
        router.handle(Kind.LOOKUP, self.lookup, affinity=True, owner=self.module_name, fast=True)

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
        self.context.metrics.count_lookup(len(body.hashes) * body.chunk_tokens, found.n_hit * body.chunk_tokens)
        return Answer(LookupReply(found.n_hit, found.tiers))

    def report_status(self) -> dict:
        return {"lookups": self.lookups, "hashes_asked": self.hashes_asked, "hashes_hit": self.hashes_hit}
