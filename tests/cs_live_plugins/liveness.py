"""A liveness target: it tracks instances itself and records which ones the management reaper dropped."""
from __future__ import annotations

import json
import time

from kvbridge.cache_server.module import DiscoverableModule, server_module_handler


class LivenessProbeModule(DiscoverableModule):
    module_name = "liveness_probe"

    def __init__(self, context) -> None:
        super().__init__(context)
        self.seen: dict[str, float] = {}
        self.dropped: list[str] = []

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)

    def touch_instance(self, instance_id: str) -> None:
        self.seen[instance_id] = time.monotonic()

    def reap_stale_instances(self, reap_timeout_s: float, registration_grace_s: float) -> list[str]:
        now = time.monotonic()
        return [iid for iid, last in self.seen.items() if now - last > reap_timeout_s]

    def tracked_instance_count(self) -> int:
        return len(self.seen)

    def drop_instance_state(self, instance_id: str) -> None:
        self.seen.pop(instance_id, None)
        self.dropped.append(instance_id)

    @server_module_handler("liveness_probe.dropped")
    def dropped_ids(self, payload: bytes) -> bytes:
        return json.dumps(self.dropped).encode()
