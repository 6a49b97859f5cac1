"""Depends on the built-in lookup and overrides its core 'lookup' handler, wrapping the old one."""
from kvbridge.cache_server.module import DiscoverableModule
from tests.cs_plugins.fake_builtins.lookup import LookupModule


class FastLookup(DiscoverableModule):
    module_name = "fast_lookup"
    dependencies = (LookupModule,)

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)

    def register_handlers(self, router) -> None:
        self.inner = router.core("lookup")
        router.handle("lookup", self.lookup)   # owner defaults to this module

    def lookup(self, call):
        return "fast+" + self.inner.fn(call)
