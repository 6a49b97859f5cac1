from __future__ import annotations

from kvbridge.cache_server.module import DiscoverableModule
from tests.cs_plugins import EVENTS
from tests.cs_plugins.fake_builtins.storage import StorageModule


class ManagementModule(DiscoverableModule):
    """Built-in management: a 'reaper' (a flag standing in for its thread) over the liveness targets."""

    module_name = "management"
    dependencies = (StorageModule,)

    def __init__(self, context) -> None:
        super().__init__(context)
        self.reaper_running = True
        self.targets: list = []

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)

    def attach_liveness_targets(self, targets: list) -> None:
        self.targets = targets

    def report_status(self) -> dict:
        return {"targets": len(self.targets), "reaper_running": self.reaper_running}

    def quiesce(self) -> None:
        self.reaper_running = False
        EVENTS.append("management.quiesce")

    def close(self) -> None:
        EVENTS.append("management.close")
