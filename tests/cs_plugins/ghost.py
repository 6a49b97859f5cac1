"""Defines 'ghost'; tests never load it, so a dependency on it is missing."""
from kvbridge.cache_server.module import DiscoverableModule


class GhostModule(DiscoverableModule):
    module_name = "ghost"

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)
