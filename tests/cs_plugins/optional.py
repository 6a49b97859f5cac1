"""Runs only when configured with {"enabled": true}, like metrics without a port."""
from kvbridge.cache_server.module import DiscoverableModule


class OptionalModule(DiscoverableModule):
    module_name = "optional"

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context) if build_ctx.config_for(cls).get("enabled") else None
