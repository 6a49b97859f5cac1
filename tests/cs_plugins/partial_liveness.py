"""Three of the four InstanceLivenessTarget methods (no drop_instance_state): not a target."""
from kvbridge.cache_server.module import DiscoverableModule


class AlmostTarget(DiscoverableModule):
    module_name = "almost_target"

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)

    def touch_instance(self, instance_id: str) -> None:
        raise AssertionError("not a liveness target: must not be touched")

    def reap_stale_instances(self, reap_timeout_s: float, registration_grace_s: float) -> list[str]:
        return []

    def tracked_instance_count(self) -> int:
        return 0
