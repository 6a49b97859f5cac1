"""All four InstanceLivenessTarget methods, no base class beyond DiscoverableModule: a target."""
from kvbridge.cache_server.module import DiscoverableModule


class SessionTable(DiscoverableModule):
    module_name = "session_table"

    def __init__(self, context) -> None:
        super().__init__(context)
        self.touched: list[str] = []

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)

    def touch_instance(self, instance_id: str) -> None:
        self.touched.append(instance_id)

    def reap_stale_instances(self, reap_timeout_s: float, registration_grace_s: float) -> list[str]:
        return []

    def tracked_instance_count(self) -> int:
        return len(set(self.touched))

    def drop_instance_state(self, instance_id: str) -> None:
        self.touched = [i for i in self.touched if i != instance_id]
