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
