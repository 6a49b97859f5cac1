"""scripts/start.sh --background: the URL it prints answers at once, and a GUI that cannot start is
reported with its log instead of a URL that refuses connections."""
from __future__ import annotations

import os
import socket
import subprocess
import urllib.request

import pytest

from kvbridge.settings import WORK_DIR

PID_FILE = WORK_DIR / ".kvbridge.pid"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PID_FILE.exists(), reason=f"a KVBridge GUI of this checkout is running ({PID_FILE}); "
                                                 "stop it with scripts/stop.sh to run these tests"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(name: str, *args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(WORK_DIR / "scripts" / name), *args],
                          cwd=WORK_DIR, env=env, capture_output=True, text=True, timeout=timeout)


def test_background_start_prints_the_url_only_when_it_answers(tmp_path):
    port = free_port()
    env = {**os.environ, "KVB_PORT": str(port), "KVB_L2_DIR": str(tmp_path / "l2")}
    started = run_script("start.sh", "--background", env=env)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        url = f"http://127.0.0.1:{port}"
        assert "running in the background" in started.stdout and url in started.stdout
        with urllib.request.urlopen(url + "/", timeout=5) as response:   # at once: no wait, no retry
            assert response.status == 200
    finally:
        stopped = run_script("stop.sh", env=env, timeout=60)
    assert stopped.returncode == 0, stopped.stderr
    assert not PID_FILE.exists()


def test_background_start_that_fails_shows_the_log_not_a_url(tmp_path):
    with socket.socket() as taken:   # the port is in use: the GUI cannot bind and exits
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "KVB_PORT": str(port), "KVB_L2_DIR": str(tmp_path / "l2")}
        started = run_script("start.sh", "--background", env=env)
    assert started.returncode != 0
    assert "exited before it served the page" in started.stderr
    assert "running in the background" not in started.stdout
    assert not PID_FILE.exists()
