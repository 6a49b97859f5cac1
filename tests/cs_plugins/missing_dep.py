"""Depends on GhostModule, which it imports (so it is not defined here and not loaded)."""
from kvbridge.cache_server.module import DiscoverableModule
from tests.cs_plugins.ghost import GhostModule


class HauntedModule(DiscoverableModule):
    module_name = "haunted"
    dependencies = (GhostModule,)

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)
