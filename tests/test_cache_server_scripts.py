"""scripts/cache_server.sh and scripts/cleanup.sh around real cache-server processes: start answers a
ping, a second start refuses, stop leaves nothing in /dev/shm (cleanly or by SIGKILL), and cleanup
removes the segment of a killed server while a live server's segment and L2 directory stay.

Every server gets a free port, an 8 MiB L1 and a temporary L2 and HOME. cleanup.sh runs from a copy of
the checkout in tmp_path (its .venv and kvbridge linked): it cleans its own output/ and ~, never the
real checkout's run results. It does remove every stale segment of this user, as it would for anyone.
"""
from __future__ import annotations

import os
import pty
import select
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.cache_server.auth import token_file
from kvbridge.cache_server.client import CacheClient
from kvbridge.cache_server.curve import key_file
from kvbridge.settings import WORK_DIR
from tests.redis_helpers import RedisServer, needs_redis

SCRIPT = WORK_DIR / "scripts" / "cache_server.sh"
PID_FILE = WORK_DIR / ".kvbridge-cache-server.pid"
SHM = Path("/dev/shm")

pytestmark = [
    pytest.mark.live,
    pytest.mark.timeout(40),
    pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this system"),
    pytest.mark.skipif(PID_FILE.exists(), reason=f"a cache server of this checkout is running ({PID_FILE}); "
                                                 "stop it with scripts/cache_server.sh stop to run these tests"),
]

# close() blocks: SIGTERM cannot finish in time, so stop has to fall back to SIGKILL.
SLOW_CLOSE_PLUGIN = '''
import time

from kvbridge.cache_server.module import DiscoverableModule


class SlowClose(DiscoverableModule):
    module_name = "slow_close"

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)

    def close(self) -> None:
        time.sleep(60)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def segments_of(pid: int) -> list[Path]:
    return sorted(SHM.glob(f"kvbridge-{os.getuid()}-{pid}-*.pool"))


def alive(pid: int) -> bool:
    """Running and not a zombie (a zombie's cmdline is empty)."""
    try:
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


@pytest.fixture
def server_env(tmp_path) -> dict:
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVB_")}
    return {**env, "HOME": str(home), "KVB_L2_DIR": str(tmp_path / "l2"), "KVB_L1_BYTES": "8MiB",
            "KVB_CACHE_SERVER_PAGE_BYTES": "64KiB", "KVB_CACHE_SERVER_METRICS_PORT": "0",
            "KVB_CACHE_SERVER_URL": f"tcp://127.0.0.1:{free_port()}"}


def script(*args: str, env: dict, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], cwd=WORK_DIR, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def stop_afterwards(server_env):
    """Whatever a test leaves running is stopped (SIGKILL at once: its state does not matter then)."""
    yield
    if PID_FILE.exists():
        script("stop", "--timeout", "0", env=server_env)


def recorded() -> tuple[int, str]:
    pid, url = PID_FILE.read_text().splitlines()
    return int(pid), url


def test_start_status_second_start_and_stop(server_env, stop_afterwards):
    url = f"tcp://127.0.0.1:{free_port()}"   # through --url, not the environment: arguments reach the server
    started = script("start", "--url", url, env=server_env)
    assert started.returncode == 0, started.stdout + started.stderr
    assert "running in the background" in started.stdout and url in started.stdout
    pid, recorded_url = recorded()
    assert recorded_url == url and alive(pid)
    assert len(segments_of(pid)) == 1

    client = CacheClient(url, timeout_s=3)   # at once: the script returned only once the server listens
    try:
        client.ping()
    finally:
        client.close()

    status = script("status", env=server_env)
    assert status.returncode == 0 and f"running (pid {pid}) on {url}" in status.stdout

    again = script("start", env=server_env)
    assert again.returncode == 1
    assert f"already running (pid {pid} on {url})" in again.stderr
    assert recorded() == (pid, url)

    stopped = script("stop", env=server_env)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "stopped." in stopped.stdout and "SIGKILL" not in stopped.stdout   # a clean stop, no last resort
    assert not alive(pid)
    assert segments_of(pid) == [] and not PID_FILE.exists()
    assert (Path(server_env["KVB_L2_DIR"]) / ".kvbridge-owner.lock").exists()

    status = script("status", env=server_env)
    assert status.returncode == 3 and "not running" in status.stdout


def test_start_that_fails_shows_the_log_and_records_nothing(server_env, stop_afterwards):
    with socket.socket() as taken:   # the port is in use: the server cannot bind and exits
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        started = script("start", "--url", f"tcp://127.0.0.1:{taken.getsockname()[1]}", env=server_env)
    assert started.returncode == 1
    assert "exited before it listened" in started.stderr and "Address already in use" in started.stderr
    assert "running in the background" not in started.stdout
    assert not PID_FILE.exists()


def test_stop_falls_back_to_sigkill_and_removes_the_segment(server_env, stop_afterwards, tmp_path):
    (tmp_path / "kvb_slow_close.py").write_text(SLOW_CLOSE_PLUGIN)
    env = {**server_env, "PYTHONPATH": str(tmp_path)}
    started = script("start", "--server-module", '{"module_path": "kvb_slow_close"}', env=env)
    assert started.returncode == 0, started.stdout + started.stderr
    pid, url = recorded()
    [segment] = segments_of(pid)
    assert token_file(url).exists() and key_file(url).exists()

    stopped = script("stop", "--timeout", "2", env=env)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "sending SIGKILL" in stopped.stdout
    assert f"removed its leftover shared memory {segment}" in stopped.stdout
    assert not alive(pid) and not segment.exists() and not PID_FILE.exists()
    assert not token_file(url).exists() and not key_file(url).exists(), stopped.stdout   # its files too


# -- cleanup.sh --------------------------------------------------------------------------------------

def start_server(env: dict, l2_dir: Path) -> subprocess.Popen:
    """A cache server as a child of this test (so that it can be killed and reaped here)."""
    process = subprocess.Popen([sys.executable, "-m", "kvbridge", "cache-server", "--url",
                                f"tcp://127.0.0.1:{free_port()}"], cwd=WORK_DIR,
                               env={**env, "KVB_L2_DIR": str(l2_dir)},
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = process.stdout.readline()
    assert line.startswith("cache server ready on"), line
    return process


@pytest.fixture
def checkout_copy(tmp_path) -> Path:
    """scripts/cleanup.sh in a checkout of its own: its output/ is a temporary one."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    (root / "output").mkdir()
    shutil.copy2(WORK_DIR / "scripts" / "cleanup.sh", root / "scripts" / "cleanup.sh")
    (root / ".venv").symlink_to(WORK_DIR / ".venv")
    (root / "kvbridge").symlink_to(WORK_DIR / "kvbridge")
    (root / "output" / "kvbridge-run.csv").write_text("a run result\n")
    return root


def cleanup(root: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    """Without a terminal on stdin (as from cron or CI): it never waits for an answer."""
    return subprocess.run([str(root / "scripts" / "cleanup.sh"), *args], cwd=root, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=30)


def test_cleanup_removes_a_killed_servers_segment_not_a_live_ones(server_env, checkout_copy, tmp_path):
    killed_l2, live_l2 = tmp_path / "killed-l2", tmp_path / "live-l2"
    killed = start_server(server_env, killed_l2)
    live = start_server(server_env, live_l2)
    try:
        [killed_segment] = segments_of(killed.pid)
        [live_segment] = segments_of(live.pid)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=10)
        assert killed_segment.exists()   # nobody removed it: what cleanup.sh is for

        env = {**server_env, "KVB_L2_DIR": str(killed_l2)}   # its lock file is left, but no one holds it
        listed = cleanup(checkout_copy, "--dry-run", env=env)
        assert listed.returncode == 0, listed.stderr
        assert str(killed_segment) in listed.stdout and str(killed_l2) in listed.stdout
        assert str(live_segment) not in listed.stdout
        assert killed_segment.exists()

        cleaned = cleanup(checkout_copy, env=env)
        assert cleaned.returncode == 0, cleaned.stderr
        assert not killed_segment.exists() and not killed_l2.exists()
        assert not (checkout_copy / "output" / "kvbridge-run.csv").exists()
        assert live_segment.exists()

        # The live server's L2 directory holds only KVBridge files, but the server holds its lock.
        cleaned = cleanup(checkout_copy, env={**server_env, "KVB_L2_DIR": str(live_l2)})
        assert cleaned.returncode == 0, cleaned.stderr
        assert f"leaving {live_l2} alone: a running KVBridge process uses it" in cleaned.stderr
        assert live_l2.exists() and live_segment.exists()
        assert live.poll() is None
    finally:
        for process in (killed, live):
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=20)
    assert live.returncode == 0 and not live_segment.exists()   # a clean stop takes its segment along


# -- cleanup.sh and L3 ---------------------------------------------------------------------------------
L3_PASSWORD = "l3-pw-never-printed"
OURS = [f"team-a:obj:{i:02x}".encode() + b"ab" * 31 for i in range(3)]     # KVB_L3_PREFIX=team-a
KEPT = [b"app:thing", b"kvb:obj:" + b"cd" * 32, b"team-ab:obj:" + b"ef" * 32]   # an application's, other prefixes


@pytest.fixture
def l3_server():
    with RedisServer(password=L3_PASSWORD) as server:
        with server.client() as c:
            for name in OURS + KEPT:
                c.set(name, b"v" * 100)
        yield server


def l3_env(server_env: dict, checkout: Path, server: RedisServer) -> dict:
    """KVB_L3_URL and the prefix from the checkout's .env, the password's variable from the environment."""
    (checkout / ".env").write_text(f"KVB_L3_URL={server.url}  # the shared Redis\nKVB_L3_PREFIX='team-a'\n")
    return {**server_env, "KVB_L3_PASSWORD_ENV": "KVB_TEST_REDIS_PASSWORD", "KVB_TEST_REDIS_PASSWORD": L3_PASSWORD}


def keys_on(server: RedisServer) -> set[bytes]:
    with server.client() as c:
        return set(c.keys(b"*"))


@needs_redis
@pytest.mark.timeout(90)   # three runs of the script, each starting Python twice or three times
def test_cleanup_removes_kvbridges_l3_keys_only_with_yes(server_env, checkout_copy, l3_server):
    env = l3_env(server_env, checkout_copy, l3_server)
    found = f"L3 redis://127.0.0.1:{l3_server.port}/0 (KVB_L3_PREFIX=team-a): 3 KVBridge keys under team-a:obj:*"

    listed = cleanup(checkout_copy, "--dry-run", env=env)
    assert listed.returncode == 0, listed.stderr
    assert found in listed.stdout and "Would remove them after asking (--yes: without asking)." in listed.stdout
    assert keys_on(l3_server) == set(OURS + KEPT)

    unasked = cleanup(checkout_copy, env=env)   # no terminal to ask on, no --yes: kept, and it says how
    assert unasked.returncode == 0, unasked.stderr
    assert found in unasked.stdout and "Run scripts/cleanup.sh --yes to remove them." in unasked.stderr
    assert keys_on(l3_server) == set(OURS + KEPT)
    assert not (checkout_copy / "output" / "kvbridge-run.csv").exists()   # the files went without asking

    removed = cleanup(checkout_copy, "--yes", env=env)
    assert removed.returncode == 0, removed.stderr
    assert "Removed 3 KVBridge keys under team-a:obj:*" in removed.stdout
    assert keys_on(l3_server) == set(KEPT)

    for result in (listed, unasked, removed):
        assert L3_PASSWORD not in result.stdout + result.stderr


@needs_redis
def test_cleanup_with_l3_unreachable_is_one_line_and_cleans_the_rest(server_env, checkout_copy, l3_server):
    env = l3_env(server_env, checkout_copy, l3_server)
    l3_server.stop()
    cleaned = cleanup(checkout_copy, "--yes", env=env)
    assert cleaned.returncode == 0, cleaned.stderr
    assert "Removed:" in cleaned.stdout and not (checkout_copy / "output" / "kvbridge-run.csv").exists()
    [line] = [line for line in cleaned.stderr.splitlines() if "L3" in line]
    assert line.startswith(f"cleanup.sh: leaving L3 alone: L3 redis://127.0.0.1:{l3_server.port}/0")
    assert "Connection refused" in line and "Traceback" not in cleaned.stderr


@needs_redis
@pytest.mark.parametrize("answer, left", [("n", set(OURS + KEPT)), ("y", set(KEPT))])
def test_cleanup_asks_on_a_terminal(server_env, checkout_copy, l3_server, answer, left):
    env = l3_env(server_env, checkout_copy, l3_server)
    controller, terminal = pty.openpty()
    process = subprocess.Popen([str(checkout_copy / "scripts" / "cleanup.sh")], cwd=checkout_copy, env=env,
                               stdin=terminal, stdout=subprocess.PIPE, stderr=terminal, text=True)
    os.close(terminal)
    try:
        seen = b""
        while b"Remove them? [y/N]" not in seen:
            ready, _, _ = select.select([controller], [], [], 20)
            assert ready, f"no question within 20 s; the terminal showed {seen!r}"
            seen += os.read(controller, 4096)
        os.write(controller, answer.encode() + b"\n")
        out, _ = process.communicate(timeout=20)
    finally:
        os.close(controller)
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0
    assert keys_on(l3_server) == left
    assert ("L3's keys are kept." in out) == (answer == "n")
