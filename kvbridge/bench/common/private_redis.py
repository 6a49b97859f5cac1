"""A private Redis for a benchmark: Debian's `redis-server` as a child process, stopped after the run.

Place in the flow: `bench-l3` and `bench --from-tier L3` start one when KVB_L3_URL is not set, point
the store's L3 at it and stop it after (SIGTERM, SIGKILL if it does not go within a bound). It
listens on a free loopback port, keeps nothing (`--save ''`, `--appendonly no`) and writes its log
in a temp dir that is removed with it, so nothing of the user's (a server on 6379, a dump file)
is touched. It gets maxmemory with allkeys-lru, as .env.example asks of a real L3.
"""
from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

from kvbridge.errors import KVBridgeError

log = logging.getLogger(__name__)
REDIS_SERVER = "redis-server"
STARTUP_S = 20.0
STOP_S = 10.0
MAXMEMORY = "2gb"     # far above what a bench stores (a few hundred MB): nothing is evicted mid-run


class RedisServerMissing(KVBridgeError):
    """No redis-server binary: the message says how to install one."""


def find_redis_server(binary: str | None = None) -> str:
    """The redis-server to run (PATH, then Debian's /usr/bin); RedisServerMissing naming ./scripts/setup.sh."""
    found = shutil.which(binary or REDIS_SERVER) or (shutil.which("/usr/bin/redis-server") if binary is None else None)
    if found is None:
        raise RedisServerMissing(
            f"{binary or REDIS_SERVER} was not found, and the bench needs a Redis for L3: run ./scripts/setup.sh --test "
            "(it installs Debian's redis-server; or apt-get install redis-server), or set KVB_L3_URL to a Redis/Valkey server of your own.")
    return found


class PrivateRedis:
    """redis-server on 127.0.0.1:<free port>, answering PING; `url` is what KVB_L3_URL would be."""

    def __init__(self, directory: Path, binary: str | None = None, maxmemory: str = MAXMEMORY,
                 port: int | None = None) -> None:
        self.directory = directory
        self.log_path = directory / "redis.log"
        self.port = port or _free_port()   # a port of its own, or the one a restart comes back on
        self.url = f"redis://127.0.0.1:{self.port}/0"
        command = [find_redis_server(binary), "--port", str(self.port), "--bind", "127.0.0.1",
                   "--save", "", "--appendonly", "no", "--dir", str(directory), "--logfile", str(self.log_path),
                   "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru", "--daemonize", "no"]
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while not _answers_ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise KVBridgeError(f"the bench's redis-server on port {self.port} did not answer PING "
                                    f"(exit {self.proc.poll()}); its log ends: {self.log_tail()}")
            time.sleep(0.02)

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL now: L3 gone without a goodbye, as when its host dies (the bench's "L3 stopped" case)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=STOP_S)

    def stop(self, timeout_s: float = STOP_S) -> int | None:
        """SIGTERM (nothing to save, so it exits at once), SIGKILL after `timeout_s`; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("the bench's redis-server (pid %d) ignored SIGTERM for %.0f s: killed", self.pid, timeout_s)
                self.kill()
        return self.proc.returncode


@contextlib.contextmanager
def private_redis(binary: str | None = None, attempts: int = 3) -> Iterator[PrivateRedis]:
    """A private redis-server for the duration of a bench; a free port taken meanwhile is retried."""
    find_redis_server(binary)     # the clear error before any temp dir or child exists
    with tempfile.TemporaryDirectory(prefix="kvb-bench-redis-") as temp:
        server = None
        for attempt in range(1, attempts + 1):
            try:
                server = PrivateRedis(Path(temp), binary)
                break
            except KVBridgeError as exc:
                if attempt == attempts or "Address already in use" not in str(exc):
                    raise
        try:
            yield server
        finally:
            server.stop()


def _answers_ping(port: int) -> bool:
    """One inline PING on a fresh socket; True on +PONG (redis-py is not needed to know it is up)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
