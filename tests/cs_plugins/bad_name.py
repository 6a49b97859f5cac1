"""Uses the built-in name 'lookup' without subclassing LookupModule: startup must refuse it."""
from kvbridge.cache_server.module import DiscoverableModule


class ImpostorLookup(DiscoverableModule):
    module_name = "lookup"

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)
