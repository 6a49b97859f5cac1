"""scripts/serve.sh around real processes: start returns once the endpoint answers and prints its URL, a
second start refuses naming the pid, a stale PID file is cleaned, stop ends it with SIGTERM (SIGKILL only
as a last resort) and leaves no PID file, and a start that fails shows the log instead of a URL.

The script's side runs twice. Against a stand-in for `python -m kvbridge serve` in a copy of the checkout
(fast, and exactly the contract the script relies on: the line `KVBridge serve ready on http://HOST:PORT`
once bound, `--port`, a clean exit 0 on SIGTERM). Then against the real command on a free loopback port,
with a small KV pool and a temporary L2 and output directory, which shows the real server keeps it.
"""
from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import requests

from kvbridge.settings import EMBEDDED_MODEL_PATH, WORK_DIR

SCRIPT = WORK_DIR / "scripts" / "serve.sh"
PID_FILE = WORK_DIR / ".kvbridge-serve.pid"
READY = "KVBridge serve ready on "   # the contract with kvbridge/serve: this, then http://HOST:PORT as bound

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(PID_FILE.exists(), reason=f"a serve endpoint of this checkout is running ({PID_FILE}); "
                                                 "stop it with scripts/serve.sh stop to run these tests"),
]

# What scripts/serve.sh expects of `python -m kvbridge serve`, and nothing more. FAKE_SERVE_FAIL: exit 2
# before binding, as on a port in use; FAKE_SERVE_IGNORE_TERM: a drain that never ends.
FAKE_SERVE = '''
import argparse
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser(prog="kvbridge")
serve = parser.add_subparsers(dest="command", required=True).add_parser("serve")
serve.add_argument("--host", default=os.environ.get("KVB_SERVE_HOST", "127.0.0.1"))
serve.add_argument("--port", type=int, default=int(os.environ.get("KVB_SERVE_PORT", "8000")))
serve.add_argument("--engine", default="scheduler")
args = parser.parse_args()
print("loading the model...", flush=True)
if os.environ.get("FAKE_SERVE_FAIL"):
    sys.exit("error: " + os.environ["FAKE_SERVE_FAIL"])


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer((args.host, args.port), Health)


def drain(signum, frame):
    print("SIGTERM: draining", flush=True)
    threading.Thread(target=server.shutdown).start()


signal.signal(signal.SIGTERM, signal.SIG_IGN if os.environ.get("FAKE_SERVE_IGNORE_TERM") else drain)
host, port = server.server_address[:2]
print(f"KVBridge serve ready on http://{host}:{port}", flush=True)
server.serve_forever()
server.server_close()
print("drained, exiting 0", flush=True)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


def alive(pid: int) -> bool:
    """Running and not a zombie (a zombie's cmdline is empty)."""
    try:
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


def run(root: Path, *args: str, env: dict, timeout: float = 50) -> subprocess.CompletedProcess:
    return subprocess.run([str(root / "scripts" / "serve.sh"), *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout)


def recorded(pid_file: Path) -> tuple[int, str]:
    pid, url = pid_file.read_text().splitlines()
    return int(pid), url


# -- against the stand-in, in a copy of the checkout -----------------------------------------------

@pytest.fixture
def checkout(tmp_path) -> Path:
    """scripts/serve.sh with the stand-in as `kvbridge` (python -m finds the working directory's package
    first) and a setup.sh that only notes its arguments; .venv is the real one."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    (root / "kvbridge").mkdir()
    shutil.copy2(SCRIPT, root / "scripts" / "serve.sh")
    setup = root / "scripts" / "setup.sh"
    setup.write_text('#!/usr/bin/env bash\necho "$@" >"$(dirname "$0")/../setup-args"\n')
    setup.chmod(0o755)
    (root / ".venv").symlink_to(WORK_DIR / ".venv")
    (root / "kvbridge" / "__init__.py").write_text("")
    (root / "kvbridge" / "__main__.py").write_text(FAKE_SERVE)
    return root


@pytest.fixture
def env(tmp_path) -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("KVB_", "FAKE_SERVE_"))}


@pytest.fixture
def stop_afterwards(checkout, env):
    """Whatever a test leaves running is stopped (SIGKILL at once: its state does not matter then)."""
    yield
    if (checkout / ".kvbridge-serve.pid").exists():
        run(checkout, "stop", "--timeout", "0", env=env)


def test_start_status_second_start_and_stop(checkout, env, stop_afterwards):
    pid_file, log = checkout / ".kvbridge-serve.pid", checkout / "output" / "serve.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = run(checkout, "start", "--port", str(port), env=env)
    assert started.returncode == 0, started.stdout + started.stderr
    assert (checkout / "setup-args").read_text().split() == []   # what the server needs: no test packages
    assert "running in the background (pid " in started.stdout and f"base_url {url}/v1" in started.stdout
    pid, recorded_url = recorded(pid_file)
    assert recorded_url == url and alive(pid)
    assert requests.get(url + "/health", timeout=5).status_code == 200   # at once: the script waited for it

    status = run(checkout, "status", env=env)
    assert status.returncode == 0 and f"running (pid {pid}) on {url}" in status.stdout

    again = run(checkout, "start", env=env)
    assert again.returncode == 1
    assert f"already running (pid {pid} on {url})" in again.stderr and "scripts/serve.sh stop" in again.stderr
    assert recorded(pid_file) == (pid, url)

    stopped = run(checkout, "stop", env={**env, "KVB_SERVE_DRAIN_TIMEOUT": "2.5"})
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "up to 23 s" in stopped.stdout   # the drain (rounded up) and a margin to close the engine
    assert "stopped." in stopped.stdout and "SIGKILL" not in stopped.stdout
    assert "SIGTERM: draining" in log.read_text() and "drained, exiting 0" in log.read_text()
    assert not alive(pid) and not pid_file.exists() and not port_answers(port)

    status = run(checkout, "status", env=env)
    assert status.returncode == 3 and "not running" in status.stdout
    gone = run(checkout, "stop", env=env)
    assert gone.returncode == 0 and "not running (no PID file .kvbridge-serve.pid)" in gone.stdout


def test_start_that_fails_shows_the_log_and_records_nothing(checkout, env, stop_afterwards):
    log = checkout / "output" / "serve.log"
    log.parent.mkdir()
    log.write_text("KVBridge serve ready on http://127.0.0.1:1\n")   # an earlier run's: not this one's
    started = run(checkout, "start", env={**env, "FAKE_SERVE_FAIL": "port 8000 is in use"})
    assert started.returncode == 1
    assert "exited before it answered" in started.stderr and "error: port 8000 is in use" in started.stderr
    assert "127.0.0.1:1" not in started.stdout + started.stderr
    assert "running in the background" not in started.stdout
    assert not (checkout / ".kvbridge-serve.pid").exists()


def test_stop_falls_back_to_sigkill(checkout, env, stop_afterwards):
    started = run(checkout, "start", "--port", str(free_port()), env={**env, "FAKE_SERVE_IGNORE_TERM": "1"})
    assert started.returncode == 0, started.stdout + started.stderr
    pid, _ = recorded(checkout / ".kvbridge-serve.pid")

    stopped = run(checkout, "stop", "--timeout", "1", env=env)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "still running after 1 s; sending SIGKILL" in stopped.stdout and "stopped." in stopped.stdout
    assert not alive(pid) and not (checkout / ".kvbridge-serve.pid").exists()


def test_a_stale_pid_file_is_cleaned_and_its_number_never_signalled(checkout, env, stop_afterwards):
    pid_file = checkout / ".kvbridge-serve.pid"
    other = subprocess.Popen(["sleep", "60"])   # the number now belongs to something else
    try:
        pid_file.write_text(f"{other.pid}\nhttp://127.0.0.1:1\n")
        status = run(checkout, "status", env=env)
        assert status.returncode == 3 and "not running" in status.stdout
        stopped = run(checkout, "stop", "--timeout", "0", env=env)
        assert stopped.returncode == 0 and "stale PID file removed" in stopped.stdout
        assert not pid_file.exists() and other.poll() is None

        pid_file.write_text(f"{other.pid}\n")
        port = free_port()
        started = run(checkout, "start", "--port", str(port), env=env)
        assert started.returncode == 0, started.stdout + started.stderr
        assert recorded(pid_file)[1] == f"http://127.0.0.1:{port}" and other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_restart_passes_its_arguments_on(checkout, env, stop_afterwards):
    first_port, second_port = free_port(), free_port()
    assert run(checkout, "start", "--port", str(first_port), env=env).returncode == 0
    first_pid, _ = recorded(checkout / ".kvbridge-serve.pid")
    restarted = run(checkout, "restart", "--port", str(second_port), env=env)
    assert restarted.returncode == 0, restarted.stdout + restarted.stderr
    second_pid, url = recorded(checkout / ".kvbridge-serve.pid")
    assert not alive(first_pid) and alive(second_pid) and url == f"http://127.0.0.1:{second_port}"
    assert not port_answers(first_port) and port_answers(second_port)


def test_stop_sh_names_a_running_serve(checkout, env, stop_afterwards):
    """The GUI's stop.sh leaves the endpoint running and says so (its PID file is not the GUI's)."""
    shutil.copy2(WORK_DIR / "scripts" / "stop.sh", checkout / "scripts" / "stop.sh")
    assert run(checkout, "start", "--port", str(free_port()), env=env).returncode == 0
    pid, _ = recorded(checkout / ".kvbridge-serve.pid")
    stopped = subprocess.run([str(checkout / "scripts" / "stop.sh")], cwd=checkout, env=env, capture_output=True,
                             text=True, timeout=30)
    assert stopped.returncode == 0, stopped.stderr
    assert "KVBridge is not running" in stopped.stdout
    assert f"note: the serve endpoint (pid {pid}) keeps running; scripts/serve.sh stop stops it." in stopped.stdout
    assert alive(pid)


# -- against the real `python -m kvbridge serve` ---------------------------------------------------

@functools.cache
def serve_command_missing() -> str:
    """Why the real endpoint cannot run here, or "" (asked once, of the CLI itself)."""
    if not EMBEDDED_MODEL_PATH.is_file():
        return f"embedded model {EMBEDDED_MODEL_PATH} missing: run ./scripts/setup.sh"
    probe = subprocess.run([str(WORK_DIR / ".venv" / "bin" / "python"), "-m", "kvbridge", "serve", "--help"],
                           cwd=WORK_DIR, capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return f"`python -m kvbridge serve` is not a command of this checkout: {probe.stderr.strip()[-200:]}"
    return ""


@pytest.fixture
def real_env(tmp_path) -> dict:
    reason = serve_command_missing()
    if reason:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVB_")}
    return {**env, "KVB_SCHED_KV_CELLS": "1024", "KVB_CTX_SIZE": "1024", "KVB_L2_DIR": str(tmp_path / "l2"),
            "KVB_OUTPUT_DIR": str(tmp_path / "output")}


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.timeout(300)   # the model loads in ~20 s on a busy 2-core machine; setup.sh runs first
def test_the_real_endpoint_starts_answers_and_stops(real_env):
    port = free_port()   # through --port, not the environment: arguments reach the server
    url = f"http://127.0.0.1:{port}"
    started = run(WORK_DIR, "start", "--port", str(port), env=real_env, timeout=200)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert "running in the background (pid " in started.stdout and f"base_url {url}/v1" in started.stdout
        pid, recorded_url = recorded(PID_FILE)
        assert recorded_url == url and alive(pid)
        assert requests.get(url + "/health", timeout=10).status_code == 200   # at once: no wait, no retry

        status = run(WORK_DIR, "status", env=real_env)
        assert status.returncode == 0 and f"running (pid {pid}) on {url}" in status.stdout
        again = run(WORK_DIR, "start", "--port", str(free_port()), env=real_env)
        assert again.returncode == 1 and f"already running (pid {pid} on {url})" in again.stderr
    finally:
        stopped = run(WORK_DIR, "stop", env=real_env, timeout=120)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "stopped." in stopped.stdout and "SIGKILL" not in stopped.stdout   # SIGTERM was enough
    assert not alive(pid) and not PID_FILE.exists() and not port_answers(port)


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_real_endpoint_on_a_port_in_use_fails_with_its_log(real_env):
    with socket.socket() as taken:   # the port is in use: the server cannot bind and exits
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        started = run(WORK_DIR, "start", "--port", str(taken.getsockname()[1]), env=real_env, timeout=200)
    try:
        assert started.returncode == 1, started.stdout + started.stderr
        assert "exited before it answered" in started.stderr and "Address already in use" in started.stderr
        # said by serve itself before the model loads, naming the settings
        assert "Cannot serve on 127.0.0.1:" in started.stderr and "KVB_SERVE_PORT" in started.stderr
        assert "running in the background" not in started.stdout and not PID_FILE.exists()
    finally:
        if PID_FILE.exists():
            run(WORK_DIR, "stop", "--timeout", "0", env=real_env)
