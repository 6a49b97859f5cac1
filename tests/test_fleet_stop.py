"""`kvbridge fleet` starts and stops without leaving anything: no process, no listening port, no /dev/shm
segment, no socket folder, no record, whatever signal arrives whenever it arrives; and it calls itself
ready only on its own router's answer.

Real parts throughout: the fleet command in a session of its own, real signals (SIGTERM, SIGINT, SIGHUP
to the fleet's pid alone, the hard case: its children must be stopped by the fleet, not by the signal;
SIGKILL, after which the children stop themselves and the next start cleans the rest), a real cache
server and its segment, real vllm-router, real `serve` workers (one per fleet, small settings).
"""
from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import process_helpers
from conftest import needs_model
from process_helpers import group_members, listening
from kvbridge.fleet.children import is_running, start_time

PROJECT = Path(__file__).resolve().parents[1]
ROUTER = Path(sys.executable).parent / "vllm-router"
needs_router = pytest.mark.skipif(not ROUTER.is_file(), reason=f"vllm-router is not installed beside "
                                                               f"{sys.executable}: run ./scripts/setup.sh")
pytestmark = pytest.mark.timeout(600)
SMALL = dict(KVB_CHUNK_SIZE="32", KVB_CTX_SIZE="1024", KVB_SCHED_KV_CELLS="2048", KVB_SCHED_MAX_RUNNING="1",
             KVB_SERVE_MAX_TOKENS="16", KVB_L1_BYTES="32MiB", KVB_CACHE_SERVER_PAGE_BYTES="64KiB",
             KVB_SERVE_DRAIN_TIMEOUT="5")


def fleet_env(tmp_path: Path, **extra: str) -> dict:
    return process_helpers.fleet_env(tmp_path, SMALL, PROJECT, **extra)


def segments_of(pid: int) -> list[Path]:
    return list(Path("/dev/shm").glob(f"kvbridge-{os.getuid()}-{pid}-*.pool"))


def restore_stop_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


# --- without a model ---------------------------------------------------------------------------------
def test_a_stop_signal_right_after_a_child_starts_still_stops_that_child(make_settings, tmp_path, monkeypatch):
    """The fleet's stop handler raises; a signal landing between the fork and the fleet's note of the child
    must not orphan it. The signal is sent from inside Popen, right after the fork."""
    from kvbridge.cli import fleet as cli_fleet
    from kvbridge.fleet import Fleet, children

    spawned: list[int] = []

    class SignalledPopen(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            spawned.append(self.pid)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    fleet = Fleet(make_settings(), workers=1, policy="round_robin")
    fleet.log_dir = tmp_path
    monkeypatch.setattr(children.subprocess, "Popen", SignalledPopen)
    previous = {sig: signal.signal(sig, cli_fleet._raise_stopped) for sig in children.STOP_SIGNALS}
    try:
        with pytest.raises(cli_fleet._Stopped):
            fleet._spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"], dict(os.environ),
                         "sleeper.log", "a test child")
        fleet.stop()
    finally:
        restore_stop_handlers(previous)
    assert len(spawned) == 1
    alive = start_time(spawned[0]) is not None
    if alive:
        os.kill(spawned[0], signal.SIGKILL)
    assert not alive, "the child started just before the stop signal outlived the fleet's stop"


def test_lists_workers_is_no_for_an_answer_it_cannot_read():
    from kvbridge.fleet.router import lists_workers

    answers = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            code, body = answers["now"]
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    workers = ["http://127.0.0.1:1001", "http://127.0.0.1:1002"]
    try:
        for code, body, expected in ((404, b"not here", False), (200, b"not json", False), (200, b"[]", False),
                                     (200, b"{}", False), (200, b'{"urls": ["http://127.0.0.1:1001"]}', False),
                                     (200, json.dumps({"urls": workers}).encode(), True)):
            answers["now"] = (code, body)
            assert lists_workers(url, workers) is expected, (code, body)
    finally:
        server.shutdown()
        server.server_close()


def test_a_cache_server_killed_at_stop_leaves_no_segment_and_no_files(make_settings, tmp_path, monkeypatch):
    """A cache server that outlives its SIGTERM bound is SIGKILLed; what it leaves (token and key files, its
    /dev/shm segment) goes with the stop. The server is stopped (SIGSTOP) so that SIGTERM cannot end it."""
    from kvbridge.cache_server.auth import token_file
    from kvbridge.cache_server.curve import key_file
    from kvbridge.fleet import Fleet, fleet as fleet_module
    from kvbridge.fleet.record import FleetRecord

    monkeypatch.setattr(fleet_module, "CACHE_SERVER_STOP_S", 2.0)
    settings = make_settings(l1_bytes=32 << 20, cache_server_page_bytes=64 << 10)
    fleet = Fleet(settings, workers=1, policy="round_robin", env=fleet_env(tmp_path))
    fleet.log_dir = tmp_path
    fleet._record = FleetRecord(tmp_path / "fleet.json", None)
    try:
        fleet._start_cache_server()
        pid = fleet._cache_server.pid
        segments = segments_of(pid)
        files = [token_file(fleet.store_url), key_file(fleet.store_url)]
        assert segments and all(path.exists() for path in files), (segments, files)
        os.kill(pid, signal.SIGSTOP)
    finally:
        fleet.stop()
    assert fleet._cache_server.proc.returncode == -signal.SIGKILL
    assert [path for path in segments + files if path.exists()] == []
    assert not (tmp_path / "fleet.json").exists()


def test_the_next_start_stops_what_a_killed_fleet_left_and_nothing_else(tmp_path):
    """A record whose fleet is gone: its child still running (same pid, start time, command line) is stopped,
    its socket folder removed, the record dropped. A process whose command line differs from the record
    (a stranger that took the pid) and the record of a fleet that still runs are left alone."""
    import tempfile

    from kvbridge.fleet.record import FORMAT, RECORD_NAME, clean_after_dead_fleets

    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    orphan = subprocess.Popen(sleep)
    stranger = subprocess.Popen(sleep + ["stranger"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_start = start_time(gone.pid)
    gone.wait()
    socket_dir = Path(tempfile.mkdtemp(prefix="kvb-fleet-"))
    (socket_dir / "worker-1.events").write_text("")

    def child(name, proc, argv):
        return {"name": name, "pid": proc.pid, "start_time": start_time(proc.pid), "cmdline": argv}

    dead = tmp_path / "dead"
    live = tmp_path / "live"
    for folder, fleet_pid, fleet_start in ((dead, gone.pid, gone_start or 1),
                                           (live, os.getpid(), start_time(os.getpid()))):
        folder.mkdir()
        (folder / RECORD_NAME).write_text(json.dumps({
            "format": FORMAT, "fleet": {"pid": fleet_pid, "start_time": fleet_start},
            "children": [child("worker-1", orphan, sleep), child("worker-2", stranger, sleep)],
            "socket_dir": str(socket_dir) if folder is dead else "", "store_url": ""}))
    try:
        cleaned = clean_after_dead_fleets(tmp_path)
        orphan_status = orphan.wait(timeout=20)
        assert stranger.poll() is None, "a process the record does not name exactly was stopped"
    finally:
        for proc in (orphan, stranger):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert orphan_status == -signal.SIGTERM
    assert f"worker-1 (pid {orphan.pid})" in cleaned and not any("worker-2" in line for line in cleaned)
    assert not socket_dir.exists() and not (dead / RECORD_NAME).exists()
    assert (live / RECORD_NAME).exists()


# --- real fleets ------------------------------------------------------------------------------------
def _records(tmp_path: Path) -> list[Path]:
    return list((tmp_path / "output" / "fleet").glob("*/fleet.json"))


def _moment_reached(tmp_path: Path, out: str, moment: str) -> dict | None:
    """The fleet's record once `moment` is reached: a child of that name recorded, or the ready line."""
    records = _records(tmp_path)
    if not records:
        return None
    try:
        record = json.loads(records[0].read_text())
    except (OSError, ValueError):
        return None
    names = [c["name"] for c in record["children"]]
    if moment == "ready":
        return record if "KVBridge fleet ready" in out and "  router: " in out else None
    return record if moment in names else None


def _ports(tmp_path: Path, out: str, record: dict) -> list[int]:
    text = out + "".join(p.read_text(errors="replace") for p in (tmp_path / "output" / "fleet").glob("*/*.log"))
    ports = {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", text + record.get("store_url", ""))}
    return sorted(ports)


@needs_model
@needs_router
@pytest.mark.parametrize("sig, moment", [(signal.SIGTERM, "cache server"), (signal.SIGINT, "worker-1"),
                                         (signal.SIGHUP, "ready"), (signal.SIGKILL, "ready")],
                         ids=["SIGTERM-as-the-cache-server-starts", "SIGINT-as-the-worker-loads", "SIGHUP-when-ready",
                              "SIGKILL-when-ready"])
def test_a_stop_signal_at_any_moment_leaves_nothing(tmp_path, sig, moment):
    out_path = tmp_path / "fleet.out"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvbridge", "fleet", "--workers", "1", "--policy", "kv_aware",
                                 "--port", "0"], cwd=PROJECT, env=fleet_env(tmp_path), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    pgid = proc.pid
    try:
        deadline = time.monotonic() + 300
        while not (record := _moment_reached(tmp_path, out_path.read_text(), moment)):
            assert proc.poll() is None, out_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"the fleet never reached {moment}:\n{out_path.read_text()[-3000:]}"
            time.sleep(0.05)
        os.kill(proc.pid, sig)                    # the fleet's pid alone: its children hear nothing
        status = proc.wait(timeout=240)
        deadline = time.monotonic() + 120         # after SIGKILL the children stop themselves (they drain)
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.3)
        left = group_members(pgid)
    finally:
        if group_members(pgid):
            os.killpg(pgid, signal.SIGKILL)
    out = out_path.read_text()
    assert left == [], f"processes of the fleet remain after {sig.name}: {left}"
    if sig == signal.SIGKILL:
        from kvbridge.fleet.record import clean_after_dead_fleets

        assert status == -signal.SIGKILL and _records(tmp_path), "the killed fleet left its record"
        clean_after_dead_fleets(tmp_path / "output" / "fleet")    # what the next start does first
    else:
        assert status == 0, out[-3000:]
    assert [c["name"] for c in record["children"] if is_running(c["pid"], c["start_time"])] == []
    cache_server = [c["pid"] for c in record["children"] if c["name"] == "cache server"]
    assert cache_server and segments_of(cache_server[0]) == []
    assert not Path(record["socket_dir"]).exists()
    assert _records(tmp_path) == []
    assert [p for p in _ports(tmp_path, out, record) if listening(p)] == []


@needs_model
@needs_router
def test_the_fleet_is_not_ready_on_an_answer_from_another_process_on_its_port(make_settings, tmp_path):
    """Another local process takes the router's port after the fleet chose it and answers /health and
    /list_workers as the router would (naming the fleet's own workers): the fleet must not call itself
    ready; the router cannot bind, exits, and the start fails naming it."""
    from kvbridge.errors import EngineUnavailable
    from kvbridge.fleet import Fleet

    settings = make_settings(ctx_size=1024, sched_kv_cells=2048, sched_max_running=1, serve_drain_timeout=5.0)
    fleet = Fleet(settings, workers=1, policy="round_robin", shared_cache=False, env=fleet_env(tmp_path))
    asked = []

    class Squatter(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            asked.append(self.path)
            body = json.dumps({"urls": [w.url for w in fleet.workers]} if self.path == "/list_workers" else {}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    squatter = http.server.ThreadingHTTPServer(("127.0.0.1", fleet.port), Squatter)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    try:
        with pytest.raises(EngineUnavailable, match="router"):
            fleet.start()
    finally:
        squatter.shutdown()
        squatter.server_close()
        fleet.stop()
    assert [c.name for c in fleet._started if is_running(c.pid, c.start_time)] == []
