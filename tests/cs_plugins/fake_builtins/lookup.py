from __future__ import annotations

from kvbridge.cache_server.module import DiscoverableModule, server_module_handler
from tests.cs_plugins import EVENTS
from tests.cs_plugins.fake_builtins.storage import StorageModule


class LookupModule(DiscoverableModule):
    """Built-in lookup; a liveness target (it keeps per-client state)."""

    module_name = "lookup"
    dependencies = (StorageModule,)

    def __init__(self, context, storage) -> None:
        super().__init__(context)
        self.storage = storage
        self.instances: set[str] = set()

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context, build_ctx.require(StorageModule))

    def register_handlers(self, router) -> None:
        router.handle("lookup", self.lookup, owner=self.module_name)

    def lookup(self, call):
        return "lookup"

    @server_module_handler("lookup.debug")
    def debug(self, payload: bytes) -> bytes:
        return b"builtin:" + payload

    def touch_instance(self, instance_id: str) -> None:
        self.instances.add(instance_id)

    def reap_stale_instances(self, reap_timeout_s: float, registration_grace_s: float) -> list[str]:
        return []

    def tracked_instance_count(self) -> int:
        return len(self.instances)

    def drop_instance_state(self, instance_id: str) -> None:
        self.instances.discard(instance_id)

    def close(self) -> None:
        EVENTS.append(f"{self.module_name}.close")   # drops every instance's state
        self.instances.clear()
