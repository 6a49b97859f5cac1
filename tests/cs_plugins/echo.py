"""An external module: depends on the built-in lookup, reads its config, serves two envelope methods."""
from __future__ import annotations

from kvbridge.cache_server.module import DiscoverableModule, server_module_handler
from tests.cs_plugins.fake_builtins.lookup import LookupModule


class EchoModule(DiscoverableModule):
    module_name = "echo"
    dependencies = (LookupModule,)

    def __init__(self, context, lookup, config: dict) -> None:
        super().__init__(context)
        self.lookup = lookup
        self.config = config
        self.zmq_server = None

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context, build_ctx.require(LookupModule), build_ctx.config_for(cls))

    @server_module_handler("echo.say")
    def say(self, payload: bytes) -> bytes:
        return self.config.get("prefix", "").encode() + payload

    @server_module_handler("echo.pin", requires_client_affinity=True)
    def pin(self, payload: bytes) -> bytes:
        return payload

    def register_zmq_services(self, server) -> None:
        self.zmq_server = server
