"""What the browser tests share: Debian's Chromium driven by the PyPI `playwright` package (never
`playwright install`), the skips that name what is missing, and a `python -m kvbridge ...` process
started as a person starts it, on a free loopback port, stopped with SIGTERM.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbridge.settings import EMBEDDED_MODEL_PATH, PROJECT_ROOT

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic"]

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # setup installs it; say so instead of failing at import
    expect = sync_playwright = None

BROWSER_MARKS = [
    pytest.mark.browser,
    pytest.mark.live,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="/usr/bin/chromium missing (apt-get install chromium)"),
    pytest.mark.skipif(sync_playwright is None, reason="the playwright package is not installed (requirements.txt)"),
    pytest.mark.skipif(not EMBEDDED_MODEL_PATH.is_file(), reason=f"embedded model {EMBEDDED_MODEL_PATH} missing"),
]


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
        return subprocess.Popen([sys.executable, "-m", "kvbridge", *args], cwd=PROJECT_ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env=env)


def answers(url: str) -> bool:
    import requests

    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.ConnectionError:
        return False
