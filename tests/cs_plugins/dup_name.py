"""A second configured module named 'echo' (tests.cs_plugins.echo has the first)."""
from kvbridge.cache_server.module import DiscoverableModule


class OtherEcho(DiscoverableModule):
    module_name = "echo"

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)
