"""Real cache servers for the tests: in a thread of the test process, or as a child process of its own.

Every server listens on loopback only, keeps its L2 under the test's tmp_path and a small pool
(settings from the `make_settings` fixture: small chunks, a private L2).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvbridge.cache_server.module import ModuleSpec
from kvbridge.cache_server.server import CacheServer

PROJECT = Path(__file__).resolve().parents[1]
SMALL_POOL = dict(l1_bytes=4 << 20, cache_server_page_bytes=64 << 10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_url() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@contextlib.contextmanager
def running_server(settings, modules: list[dict] = (), token: str = "", url: str | None = None):
    """A CacheServer serving from a thread; yields it (its .url, .store, .modules) and closes it after."""
    specs = [ModuleSpec(m["module_path"], m.get("config", {})) for m in modules]
    server = CacheServer(settings, url=url or local_url(), module_specs=specs, token=token)
    server.bind()
    thread = threading.Thread(target=server.serve_forever, name="test-cache-server", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(timeout=10)
        server.close()


def owner_store_after_its_server(settings, how: str, obj: bytes, meta):
    """The owner's RemoteStore, holding `obj` under key b"o" * 16, whose server then went away: "stopped"
    (a clean stop removes its key file) or "crashed" (what SIGKILL leaves: the dead server's key file).
    Returns (url, store); the caller closes the store."""
    from kvbridge.cache_server.client import CacheClient
    from kvbridge.cache_server.curve import key_file
    from kvbridge.cache_server.remote_store import RemoteStore

    with running_server(settings) as server:
        url = server.url
        store = RemoteStore(CacheClient(url, timeout_s=2), namespace="ns")
        assert store.put(b"o" * 16, obj, meta)
        left_behind = key_file(url).read_text()
    if how == "crashed":
        key_file(url).write_text(left_behind)
        os.chmod(key_file(url), 0o600)
    return url, store


def server_env(settings, **extra) -> dict:
    """The environment a child cache server (or engine) reads its settings from."""
    from kvbridge.settings import settings_to_env

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVB_")}
    env.update(settings_to_env(settings))
    env.update({k: str(v) for k, v in extra.items()})
    env["PYTHONPATH"] = str(PROJECT)
    return env


class ServerProcess:
    """`python -m kvbridge cache-server` as a child process; waits for its ready line."""

    def __init__(self, env: dict, url: str, args: list[str] = (), log_path: Path | None = None) -> None:
        self.url = url
        self.log_path = log_path
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", "kvbridge", "cache-server", "--url", url, *args],
                                     env=env, cwd=PROJECT, stdout=subprocess.PIPE, stderr=self._log)
        deadline = time.monotonic() + 30
        line = b""
        while b"ready" not in line:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"cache server did not start (exit {self.proc.returncode}); log: {self.tail()}")

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path else ""

    def terminate(self, timeout: float = 30) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        self.proc.stdout.close()
        if self.log_path:
            self._log.close()
