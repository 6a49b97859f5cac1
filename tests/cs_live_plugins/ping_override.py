"""A module that depends on the management module and overrides its core PING handler (registered later)."""
from __future__ import annotations

from kvbridge.cache_server.calls import Answer
from kvbridge.cache_server.module import DiscoverableModule
from kvbridge.cache_server.modules.management import ManagementModule
from kvbridge.cache_server.protocol import Kind, PingReply


class PingOverrideModule(DiscoverableModule):
    module_name = "ping_override"
    dependencies = (ManagementModule,)

    def __init__(self, context) -> None:
        super().__init__(context)
        self.pings = 0

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)

    def register_handlers(self, router) -> None:
        self._original = router.core(Kind.PING)
        router.handle(Kind.PING, self.ping, owner=self.module_name)

    def ping(self, call):
        self.pings += 1
        answer = self._original.fn(call)
        return Answer(PingReply("overridden:" + answer.body.server_id, answer.body.server_time))

    def report_status(self) -> dict:
        return {"pings": self.pings}
