"""Processes the tests start as a person would: `python -m kvbridge ...` on a free loopback port, with
a clean KVB_ environment, waited for, and stopped with SIGTERM.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvbridge.settings import WORK_DIR


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**changes: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVB_")}
    env.update(GRADIO_ANALYTICS_ENABLED="False", **changes)
    return env


def wait_for(condition, what: str, log_path: Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"{what}: the process exited early:\n{log_path.read_text()}"
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s:\n{log_path.read_text()}"
        time.sleep(0.3)


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def start_kvbridge(args: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    with log_path.open("w") as log:
        return subprocess.Popen([sys.executable, "-m", "kvbridge", *args], cwd=WORK_DIR, stdout=log,
                                stderr=subprocess.STDOUT, env=env)


def answers(url: str) -> bool:
    import requests

    try:
        return requests.get(url, timeout=2).status_code == 200
    except (requests.ConnectionError, requests.Timeout):   # not listening yet, or busy starting: not ready
        return False


def fleet_env(tmp_path: Path, small: dict, project: Path, **extra: str) -> dict:
    """A `kvbridge fleet`'s environment: no KVB_ of the caller's, `small` settings, its own L2 and output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVB_")}
    env.update(small, KVB_L2_DIR=str(tmp_path / "l2"), KVB_OUTPUT_DIR=str(tmp_path / "output"), **extra)
    env["PYTHONPATH"] = str(project)
    return env


def group_members(pgid: int) -> list[str]:
    """'pid name' of every live process in the process group (zombies are gone already for our purpose)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(f"{stat.parent.name} {name}")
    return members


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:port."""
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0
