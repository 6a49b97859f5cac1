"""The fleet's child processes: each started with its output in its own log file, its ready line read
back from that file, and stopped by pid (SIGTERM, a bounded wait, then SIGKILL).

Children stay in the caller's process group, so a signal to that group (Ctrl-C in a terminal,
`kill -TERM -PGID`) reaches every one of them as well as the fleet.
"""
from __future__ import annotations

import re
import signal
import socket
import subprocess
import time
from pathlib import Path

from kvbridge.errors import EngineUnavailable


def free_port() -> int:
    """A loopback port nobody listens on now (the child binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Child:
    """One process of the fleet, its stdout and stderr in `log_path`."""

    def __init__(self, name: str, argv: list[str], env: dict, log_path: Path, hint: str) -> None:
        self.name = name
        self.log_path = log_path
        self.hint = hint                      # the setting or flag to change when it fails to start
        with open(log_path, "ab") as log:     # the child holds its own descriptor; ours closes at once
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def failure(self, what: str) -> EngineUnavailable:
        return EngineUnavailable(f"the fleet's {self.name} {what} ({self.hint}); the last lines of "
                                 f"{self.log_path}:\n{self.tail()}")

    def check_running(self) -> None:
        if not self.alive():
            raise self.failure(f"exited with status {self.proc.returncode} while starting")

    def wait_for_line(self, pattern: str, timeout_s: float) -> re.Match:
        """The first match of `pattern` in the log; EngineUnavailable if the child exits or takes too long."""
        deadline = time.monotonic() + timeout_s
        regex = re.compile(pattern)
        while True:
            match = regex.search(self.log_path.read_text(errors="replace"))
            if match:
                return match
            self.check_running()
            if time.monotonic() > deadline:
                raise self.failure(f"printed no ready line within {timeout_s:.0f} s")
            time.sleep(0.2)

    def terminate(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, deadline: float) -> bool:
        """Wait until `deadline` (time.monotonic()); True if it exited."""
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait(timeout=10)


def stop_all(children: list[Child], timeout_s: float) -> list[str]:
    """SIGTERM to each, a wait of at most timeout_s for all, SIGKILL to stragglers; returns their names."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + timeout_s
    stragglers = [child for child in children if not child.wait(deadline)]
    for child in stragglers:
        child.kill()
    return [child.name for child in stragglers]
