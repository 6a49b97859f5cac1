"""An external module over the real built-ins: envelope methods of both kinds, one that raises, one slow."""
from __future__ import annotations

import json
import threading
import time

from kvbridge.cache_server.module import DiscoverableModule, server_module_handler
from kvbridge.cache_server.modules.storage import StorageModule


class LiveEchoModule(DiscoverableModule):
    module_name = "live_echo"
    dependencies = (StorageModule,)

    def __init__(self, context, storage, config: dict) -> None:
        super().__init__(context)
        self.storage = storage
        self.prefix = config.get("prefix", "").encode()
        self.threads: list[str] = []

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context, build_ctx.require(StorageModule), build_ctx.config_for(cls))

    @server_module_handler("live_echo.say")
    def say(self, payload: bytes) -> bytes:
        return self.prefix + payload

    @server_module_handler("live_echo.fail")
    def fail(self, payload: bytes) -> bytes:
        raise RuntimeError("the plugin could not do it")

    @server_module_handler("live_echo.slow", requires_client_affinity=True)
    def slow(self, payload: bytes) -> bytes:
        """Sleeps the given seconds on the caller's affinity thread; returns its start and end times."""
        started = time.monotonic()
        self.threads.append(threading.current_thread().name)
        time.sleep(float(payload or b"0"))
        return json.dumps([started, time.monotonic()]).encode()

    @server_module_handler("live_echo.holds", requires_client_affinity=True)
    def holds(self, payload: bytes) -> bytes:
        """Whether L1 holds the key (hex): on the affinity thread, so after the caller's earlier stores."""
        return b"yes" if self.context.store.pool.contains(bytes.fromhex(payload.decode())) else b"no"

    def report_status(self) -> dict:
        return {"prefix": self.prefix.decode()}
