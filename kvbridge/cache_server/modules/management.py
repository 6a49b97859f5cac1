"""ManagementModule: ping, status, goodbye, and the liveness reaper that drops clients that went silent.

Every request touches the caller's instance id on every liveness target (the server does that).
The reaper runs every KVB_CACHE_SERVER_REAP_TIMEOUT / 4 seconds (0 disables it), asks each target
which instances it considers stale, and calls drop_instance_state(id) on every target for each:
the storage module then releases that client's leases, this module forgets the client (its next
request is answered "hello_required", and a live client simply says hello again).
"""
from __future__ import annotations

import logging
import threading
import time

from kvbridge.cache_server.calls import Answer, Call
from kvbridge.cache_server.module import DiscoverableModule, ModuleBuildContext
from kvbridge.cache_server.protocol import Kind, PingReply

log = logging.getLogger("kvbridge.cache_server")


class ManagementModule(DiscoverableModule):
    module_name = "management"

    def __init__(self, context) -> None:
        super().__init__(context)
        settings = context.settings
        self.reap_timeout_s = settings.cache_server_reap_timeout
        self.registration_grace_s = settings.cache_server_registration_grace
        self.targets: list = []
        self.reaped = 0
        self.reaper_runs = 0
        self._started = time.time()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    @classmethod
    def create(cls, build_ctx: ModuleBuildContext) -> "ManagementModule":
        return cls(build_ctx.server_context)

    def register_handlers(self, router) -> None:
        router.handle(Kind.PING, self.ping, owner=self.module_name, fast=True)
        router.handle(Kind.STATUS, self.status, owner=self.module_name)
        # after the client's earlier requests (its last commits), on its affinity thread
        router.handle(Kind.GOODBYE, self.goodbye, affinity=True, owner=self.module_name)

    def attach_liveness_targets(self, targets: list) -> None:
        self.targets = list(targets)
        if self.reap_timeout_s > 0 and self._reaper is None:
            self._reaper = threading.Thread(target=self._reap_loop, name="kvb-cs-reaper", daemon=True)
            self._reaper.start()

    # -- handlers --------------------------------------------------------------------------------
    def ping(self, call: Call) -> Answer:
        return Answer(PingReply(self.context.server_id, time.time()))

    def goodbye(self, call: Call) -> Answer:
        """A client closing cleanly: every target drops its state now rather than at the reap timeout."""
        for target in self.targets:
            target.drop_instance_state(call.instance_id)
        log.info("client %s said goodbye", call.instance_id[:8])
        return Answer(None)

    def status(self, call: Call) -> Answer:
        """Each module's report_status() under its module_name, plus the server's own facts under "server".
        Other clients appear by label, pid, priority and idle time, their ids cut to 8 characters."""
        modules = self.context.modules
        status = modules.status()
        status["server"] = {"server_id": self.context.server_id, "url": self.context.url,
                            "uptime_s": round(time.time() - self._started, 1), "modules": modules.describe(),
                            "tier_names": self.context.store.tier_names,
                            "metrics_port": self.context.metrics_port}
        for row in (status.get(self.module_name) or {}).get("clients", []):
            if row["instance_id"] != call.instance_id:   # another client's id is its lease handle: never in full
                row["instance_id"] = row["instance_id"][:8] + "…"
        return Answer(status)

    # -- the reaper ------------------------------------------------------------------------------
    def _reap_loop(self) -> None:
        interval = max(0.25, self.reap_timeout_s / 4)
        while not self._stop.wait(interval):
            try:
                self.reap_once()
            except Exception:   # one bad round must not end liveness checking: logged
                log.exception("liveness reaper round failed")

    def reap_once(self) -> list[str]:
        self.reaper_runs += 1
        stale: set[str] = set()
        for target in self.targets:
            stale.update(target.reap_stale_instances(self.reap_timeout_s, self.registration_grace_s))
        for instance_id in sorted(stale):
            log.info("client %s silent for over %.0f s: dropping its state", instance_id[:8], self.reap_timeout_s)
            for target in self.targets:
                target.drop_instance_state(instance_id)
        self.reaped += len(stale)
        return sorted(stale)

    # -- liveness target: the server's client table ----------------------------------------------
    def touch_instance(self, instance_id: str) -> None:
        """The server touches its client table itself on every request; nothing more to do."""

    def reap_stale_instances(self, reap_timeout_s: float, registration_grace_s: float) -> list[str]:
        return self.context.clients.stale(reap_timeout_s, registration_grace_s)

    def tracked_instance_count(self) -> int:
        return len(self.context.clients)

    def drop_instance_state(self, instance_id: str) -> None:
        self.context.clients.remove(instance_id)

    # -- module contract -------------------------------------------------------------------------
    def report_status(self) -> dict:
        return {"clients": self.context.clients.snapshot(), "reap_timeout_s": self.reap_timeout_s,
                "registration_grace_s": self.registration_grace_s, "reaped": self.reaped,
                "reaper_running": bool(self._reaper and self._reaper.is_alive()),
                "liveness_targets": [getattr(t, "module_name", type(t).__name__) for t in self.targets]}

    def quiesce(self) -> None:
        """Stop the reaper first, so no target is asked to drop state while targets close."""
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
