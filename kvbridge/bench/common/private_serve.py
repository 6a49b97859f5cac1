"""A private `serve` and a llama-server for a benchmark: child processes on free loopback ports.

Place in the flow: bench-serve (kvbridge.bench.serve_bench) runs one of each, never both up at once;
the tenant probes (kvbridge.bench.probes.tenant_bench, tenant_timing) run ours with a tenants file.
OurServe is `python -m kvbridge serve --port P` with the caller's settings as its environment, ready
when its log says so, stopped with SIGTERM (running requests drain, the store flushes to L2);
TheirServe is llama-server as a ServerProcess. Both retry once on another port when the free port
they probed was taken before the bind. Clients talk to them through the openai SDK
(require_openai_sdk says clearly when it is missing).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from kvbridge.backends.llama_server.process import ServerProcess, free_port
from kvbridge.errors import EngineUnavailable, KVBridgeError
from kvbridge.settings import WORK_DIR, Settings, settings_to_env

OURS, THEIRS = "ours", "llama-server"
START_TIMEOUT_S = 180.0  # ours loads the model in the child; on a busy 2-core machine that takes a while
READY = "KVBridge serve ready on"


class OurServe:
    """`python -m kvbridge serve` as a child process with `settings` as its environment."""

    name = OURS

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.settings = settings
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> None:
        for attempt in (1, 2):
            port = free_port()
            # the caller's non-KVB environment (PATH, HOME...), every KVB_ setting from `settings`
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVB_")}
            env.update(settings_to_env(self.settings.replace(serve_port=port)))
            offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            with self.log_path.open("ab") as log:
                self.proc = subprocess.Popen([sys.executable, "-m", "kvbridge", "serve", "--port", str(port)],
                                             cwd=WORK_DIR, env=env, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL)
            self.url = f"http://127.0.0.1:{port}"
            if self._wait_ready(offset):
                return
            self.stop()
            # a free port can be taken between our probe and the child's bind: try another once
            if attempt == 2 or "port is in use" not in self.log_text(offset):
                raise KVBridgeError(f"the bench's serve did not get ready (exit {self.proc.returncode}); "
                                    f"its log {self.log_path} ends:\n{self.log_text(offset)[-2000:]}")

    def _wait_ready(self, offset: int) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while READY not in self.log_text(offset):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def log_text(self, offset: int = 0) -> str:
        with self.log_path.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def stop(self) -> int | None:
        """SIGTERM (running requests drain, the store flushes to L2); the exit status."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
        return proc.wait()


class TheirServe:
    """llama-server with `args` as a ServerProcess (its own process group, a private work dir)."""

    name = THEIRS

    def __init__(self, binary: Path, args: list[str], start_timeout_s: float) -> None:
        self.binary, self.args, self.start_timeout_s = binary, args, start_timeout_s
        self.server: ServerProcess | None = None
        self.props: dict = {}

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> None:
        for attempt in (1, 2):
            self.server = ServerProcess(self.binary, self.args, "127.0.0.1", free_port())
            self.server.start()
            try:
                self.server.wait_healthy(self.start_timeout_s)
                break
            except EngineUnavailable as exc:
                # a free port can be taken between our probe and the server's bind: try another once
                if attempt == 2 or "KVB_LLAMA_SERVER_PORT" not in str(exc):
                    raise
        try:
            self.props = requests.get(f"{self.url}/props", timeout=10).json()
        except (requests.RequestException, ValueError):
            self.props = {}   # only for the report's setup lines

    def log_tail(self) -> str:
        return self.server.log_tail(20) if self.server is not None else ""

    def stop(self) -> int | None:
        server, self.server = self.server, None
        proc = server.proc if server is not None else None
        if server is not None:
            server.stop()
        return proc.returncode if proc is not None else None


def require_openai_sdk() -> None:
    """The serve benches talk through the official openai SDK, a test package: a clear error when it is missing."""
    try:
        import openai  # noqa: F401
    except ImportError:
        raise EngineUnavailable("this bench talks to the servers through the official openai SDK, which is not "
                                "installed: run ./scripts/setup.sh --test, or pip install 'openai==3.57.0'") from None
