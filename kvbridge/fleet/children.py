"""The fleet's child processes: each started with its output in its own log file, its ready line read
back from that file, and stopped by pid (SIGTERM, a bounded wait, then SIGKILL).

Children stay in the caller's process group, so a signal to that group (Ctrl-C in a terminal,
`kill -TERM -PGID`) reaches every one of them as well as the fleet. Three rules keep a stop from
leaving any of them behind:
- `spawn_held()`: the stop signals are blocked while a child is started and recorded, so a stop
  handler never runs between the fork and the record (it runs right after, and stop() finds the child);
- each child asks the kernel for SIGTERM when the fleet dies (PR_SET_PDEATHSIG), so a SIGKILLed fleet
  still stops its children, and ignores SIGHUP (a closed terminal stops the fleet, which stops them in order);
- a child is known by pid, start time (/proc/PID/stat) and command line, so a record of it outlives the
  fleet without ever naming a stranger that reuses the pid (kvbridge.fleet.record).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from kvbridge.errors import EngineUnavailable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1
TCP_LISTEN = "0A"


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


@contextlib.contextmanager
def spawn_held():
    """Stop signals wait (blocked, not lost) until the block ends: start a child and record it inside."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _in_child(fleet_pid: int):
    """What a child does between fork and exec: die with the fleet, ignore hangups, take signals again."""
    libc = ctypes.CDLL(None, use_errno=True)    # looked up before the fork: nothing to load in the child
    # the kernel sends it when the forking *thread* ends: only the main thread lives as long as the fleet
    with_parent = threading.current_thread() is threading.main_thread()

    def setup() -> None:
        if with_parent:
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
            if os.getppid() != fleet_pid:    # the fleet died before prctl: nobody would send the signal
                os._exit(1)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)        # kept across exec
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)   # spawn_held's block is inherited
    return setup


# --- who a process is: pid, start time, command line -------------------------------------------------
def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (/proc/PID/stat field 22); None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[19])


def is_running(pid: int, recorded_start: int | None) -> bool:
    """Whether `pid` is still the process that started at `recorded_start` and has not exited (a zombie
    waiting for its parent to reap it has)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = text[text.rindex(")") + 2:].split()
    return fields[0] != "Z" and int(fields[19]) == recorded_start


def cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0")[:-1]] if raw else []


def owns_listener(pid: int, port: int) -> bool:
    """Whether a socket listening on 127.0.0.1:port is one of `pid`'s open files: the answer on the port is
    that process's, not another local process's that bound the port first."""
    inodes = set()
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        address, _, hex_port = local.partition(":")
        if state == TCP_LISTEN and int(hex_port, 16) == port and address in ("0100007F", "00000000"):
            inodes.add(f"socket:[{inode}]")
    if not inodes:
        return False
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in inodes:
                return True
        except OSError:
            continue
    return False


class Child:
    """One process of the fleet, its stdout and stderr in `log_path`."""

    def __init__(self, name: str, argv: list[str], env: dict, log_path: Path, hint: str) -> None:
        self.name = name
        self.log_path = log_path
        self.hint = hint                      # the setting or flag to change when it fails to start
        self.argv = list(argv)
        with open(log_path, "ab") as log:     # the child holds its own descriptor; ours closes at once
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, preexec_fn=_in_child(os.getpid()))
        self.start_time = start_time(self.proc.pid)

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
