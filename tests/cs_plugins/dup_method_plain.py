"""Claims 'echo.say' (a plain method of tests.cs_plugins.echo), also plain."""
from kvbridge.cache_server.module import DiscoverableModule, server_module_handler


class SayAgain(DiscoverableModule):
    module_name = "say_again"

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)

    @server_module_handler("echo.say")
    def say(self, payload: bytes) -> bytes:
        return payload
