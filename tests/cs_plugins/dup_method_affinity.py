"""Claims 'echo.say' (a plain method of tests.cs_plugins.echo) as an affinity method."""
from kvbridge.cache_server.module import DiscoverableModule, server_module_handler


class PinnedSay(DiscoverableModule):
    module_name = "pinned_say"

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)

    @server_module_handler("echo.say", requires_client_affinity=True)
    def say(self, payload: bytes) -> bytes:
        return payload
