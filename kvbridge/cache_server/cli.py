"""`python -m kvbridge cache-server`: build the server from settings and flags, serve until SIGTERM/SIGINT.

Modules come from KVB_CACHE_SERVER_MODULES (a JSON list) first, then each --server-module flag (one
JSON object or a list). A clean stop closes the modules in reverse order, flushes L1 to L2 and
removes the shared-memory segment; the exit status is 0.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys

from kvbridge.cache_server.module import ModuleSpec, parse_module_specs
from kvbridge.settings import Settings

log = logging.getLogger("kvbridge.cache_server")


def module_specs(settings: Settings, flags: list[str]) -> list[ModuleSpec]:
    specs = parse_module_specs(settings.cache_server_modules, "KVB_CACHE_SERVER_MODULES") \
        if settings.cache_server_modules.strip() else []
    for flag in flags:
        specs += parse_module_specs(flag, "--server-module")
    return specs


def run(settings: Settings, url: str | None, flags: list[str], metrics_port: int | None) -> int:
    from kvbridge.cache_server.server import CacheServer

    if not logging.getLogger().handlers or logging.getLogger().level > logging.INFO:
        logging.getLogger("kvbridge.cache_server").setLevel(logging.INFO)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger("kvbridge.cache_server").addHandler(handler)
        logging.getLogger("kvbridge.cache_server").propagate = False
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1 PID`: every thread's stack on stderr
    server = CacheServer(settings, url=url, module_specs=module_specs(settings, flags), metrics_port=metrics_port)
    try:
        server.bind()
        previous = {sig: signal.signal(sig, lambda signum, frame: server.stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
        print(f"cache server ready on {server.url} (pid {os.getpid()})", flush=True)
        try:
            server.serve_forever()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        log.info("stopping: closing modules, flushing L1 to L2, releasing shared memory")
    finally:
        server.close()
    log.info("stopped cleanly")
    return 0
