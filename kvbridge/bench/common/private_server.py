"""A private cache server for a benchmark: `python -m kvbridge cache-server` as a child process.

Place in the flow: `bench --cache-server`, `bench-restore` and `bench-cache-server` start one, point
an engine or a CacheClient at it and stop it after (SIGTERM: L1 flushed to its L2, the shared-memory
segment removed). It listens on a free loopback port, keeps its L2 and log in a temp dir and takes
every other setting (L1 = KVB_L1_BYTES, page size, watermarks) from the caller's settings; nothing
of the user's store is touched.
"""
from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from kvbridge.errors import KVBridgeError
from kvbridge.settings import WORK_DIR, Settings, settings_to_env

log = logging.getLogger(__name__)
STARTUP_S = 60.0


class PrivateCacheServer:
    """`python -m kvbridge cache-server` as a child of the bench, on a free loopback port; SIGTERM stops it.

    Its L2 and its log live in `directory`; its L1 is settings.l1_bytes. `engine_settings` are the
    caller's settings pointed at it (store_url).
    """

    def __init__(self, settings: Settings, directory: Path, url: str | None = None) -> None:
        self.log_path = directory / "cache-server.log"
        self.url = url or f"tcp://127.0.0.1:{_free_port()}"   # a restart comes back on the same address
        server_settings = settings.replace(l2_dir=str(directory / "l2"), store_url="")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVB_")}
        env.update(settings_to_env(server_settings))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WORK_DIR), env.get("PYTHONPATH")]))
        self.engine_settings = settings.replace(store_url=self.url)
        self.pool_bytes = settings.l1_bytes // settings.cache_server_page_bytes * settings.cache_server_page_bytes
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvbridge", "cache-server", "--url", self.url],
                                     env=env, cwd=WORK_DIR, stdout=subprocess.PIPE, stderr=self._log)
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        line = b""
        while b"cache server ready" not in line:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise KVBridgeError(f"the bench's cache server did not start (exit {self.proc.poll()}); "
                                    f"its log {self.log_path} ends: {self.log_tail()}")
            if select.select([self.proc.stdout], [], [], min(left, 1.0))[0]:
                line = self.proc.stdout.readline()

    def log_tail(self, chars: int = 2000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM (the server flushes L1 to L2 and removes its segment); its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        if not self._log.closed:
            self.proc.stdout.close()
            self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@contextlib.contextmanager
def private_cache_server(settings: Settings, attempts: int = 3) -> Iterator[PrivateCacheServer]:
    """A private server for the duration of a bench; a free port taken meanwhile by someone else is retried."""
    with tempfile.TemporaryDirectory(prefix="kvb-bench-cache-server-") as temp:
        server = None
        for attempt in range(1, attempts + 1):
            try:
                server = PrivateCacheServer(settings, Path(temp))
                break
            except KVBridgeError as exc:
                if attempt == attempts or "Address already in use" not in str(exc):
                    raise
        try:
            yield server
        finally:
            status = server.stop()
            if status != 0:
                log.warning("the bench's cache server exited with %s; its log ends: %s", status, server.log_tail())


def bench_client(server: PrivateCacheServer, use_shm: bool = True):
    from kvbridge.cache_server.auth import read_token
    from kvbridge.cache_server.client import CacheClient

    settings = server.engine_settings
    # a long timeout: a flush of a full pool to disk is one request, and a bench should wait, not miss
    return CacheClient(server.url, token=read_token(settings), timeout_s=max(settings.cache_server_timeout, 120.0),
                       use_shm=use_shm, label=f"bench, pid {os.getpid()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
