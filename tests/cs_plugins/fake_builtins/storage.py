from __future__ import annotations

import abc

from kvbridge.cache_server.module import DiscoverableModule
from tests.cs_plugins import EVENTS


class TierModuleBase(DiscoverableModule, abc.ABC):
    """Abstract: discovery must skip it."""

    @abc.abstractmethod
    def tier_names(self) -> list[str]: ...


class StorageModule(TierModuleBase):
    module_name = "storage"

    def __init__(self, context, config: dict) -> None:
        super().__init__(context)
        self.config = config

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context, build_ctx.config_for(cls))

    def tier_names(self) -> list[str]:
        return ["l1"]

    def register_handlers(self, router) -> None:
        router.handle("store_inline", lambda call: "stored")

    def report_status(self) -> dict:
        return {"store": self.context.store}

    def close(self) -> None:
        EVENTS.append("storage.close")
