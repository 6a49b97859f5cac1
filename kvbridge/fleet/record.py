"""A running fleet's record of what it started, so that the next start cleans up after a SIGKILLed one.

Each start keeps `<its log folder>/fleet.json` (mode 0600, replaced atomically as each child is added):
the fleet's pid and start time, each child's name, pid, start time and command line, the private folder
of its KV-event sockets and its cache server's URL. A clean stop removes the record.

A start first reads every record under KVB_OUTPUT_DIR/fleet/. One whose fleet still runs (same pid and
start time) is left alone. One whose fleet is gone names what that fleet may have left: each child still
running under the recorded pid, start time and command line (never a stranger that reuses the pid) is
stopped (SIGTERM, then SIGKILL), the socket folder removed, and what its cache server left (token and key
files, the /dev/shm segment) forgotten through kvbridge.cache_server.leftovers. Children normally go by
themselves (they asked for SIGTERM at their parent's death); this is for one that did not.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path

from kvbridge.fleet.children import cmdline, is_running, start_time

log = logging.getLogger(__name__)
RECORD_NAME = "fleet.json"
FORMAT = "kvbridge fleet record v1"
SOCKET_DIR_PREFIX = "kvb-fleet-"
ROUTER_TITLE = "vllm::router"      # vllm-router's launcher renames itself (setproctitle) as it starts
STOP_WAIT_S = 10.0


class FleetRecord:
    """What this fleet started, kept on disk while it runs."""

    def __init__(self, path: Path, socket_dir: Path | None) -> None:
        self.path = path
        self.data = {"format": FORMAT, "fleet": {"pid": os.getpid(), "start_time": start_time(os.getpid())},
                     "children": [], "socket_dir": str(socket_dir or ""), "store_url": ""}
        self.save()

    def add(self, child) -> None:
        self.data["children"].append({"name": child.name, "pid": child.pid, "start_time": child.start_time,
                                      "cmdline": child.argv})
        self.save()

    def set_store_url(self, url: str) -> None:
        self.data["store_url"] = url
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(self.data, out)
        os.replace(tmp, self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def is_recorded_process(pid: int, recorded_start: int | None, recorded_argv: list[str]) -> bool:
    """Whether `pid` is still the process the record names: this user's, same start time, same command line
    (or vllm-router's own title, which replaces its command line)."""
    if not pid or recorded_start is None or not is_running(pid, recorded_start):
        return False
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
    except OSError:
        return False
    now = cmdline(pid)
    return now is not None and (now == recorded_argv or (bool(now) and now[0].strip().startswith(ROUTER_TITLE)))


def clean_after_dead_fleets(log_root: Path) -> list[str]:
    """Stop and remove what fleets that no longer run left under log_root; a line per thing cleaned."""
    cleaned: list[str] = []
    for path in sorted(log_root.glob(f"*/{RECORD_NAME}")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("fleet record %s is unreadable (%s): left alone", path, exc)
            continue
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            log.warning("fleet record %s is not a %r record: left alone", path, FORMAT)
            continue
        fleet = data.get("fleet") or {}
        if start_time(int(fleet.get("pid") or 0)) == fleet.get("start_time"):
            continue                  # that fleet still runs
        cleaned += _clean(data, path)
    return cleaned


def _clean(data: dict, path: Path) -> list[str]:
    cleaned = []
    alive = [c for c in data.get("children", [])
             if is_recorded_process(int(c.get("pid") or 0), c.get("start_time"), c.get("cmdline") or [])]
    for child in alive:
        _signal(child["pid"], signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    while any(is_running(c["pid"], c["start_time"]) for c in alive) and time.monotonic() < deadline:
        time.sleep(0.1)
    for child in alive:
        if is_running(child["pid"], child["start_time"]):
            _signal(child["pid"], signal.SIGKILL)
        cleaned.append(f"{child['name']} (pid {child['pid']})")
    if data.get("store_url"):
        from kvbridge.cache_server.leftovers import forget_server_files
        cleaned += [str(p) for p in forget_server_files(data["store_url"])]
    socket_dir = Path(data.get("socket_dir") or "")
    if socket_dir.name.startswith(SOCKET_DIR_PREFIX) and socket_dir.is_dir() and socket_dir.owner() == _me():
        shutil.rmtree(socket_dir, ignore_errors=True)
        cleaned.append(str(socket_dir))
    path.unlink(missing_ok=True)
    return cleaned


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _me() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name
