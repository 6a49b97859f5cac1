from kvbridge.cache_server.module import DiscoverableModule
from tests.cs_plugins.optional import OptionalModule


class NeedsOptional(DiscoverableModule):
    module_name = "needs_optional"
    dependencies = (OptionalModule,)

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)
