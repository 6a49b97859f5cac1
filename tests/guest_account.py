"""A second, unprivileged OS account for tests of what another local user can reach (KV events here;
tests/test_cache_server_owner.py does the same for the cache server).

The guest is a real process that imports what it needs as root (the venv's python lives where the guest
could not read it), then drops to the guest's uid and gid with a HOME of its own, as another account on
the machine would run. `subscribe_as_guest` makes it subscribe to KV-event endpoints (and ask each
replay socket for everything from sequence 0) for a while, and returns what it received.
"""
from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile

import pytest

GUEST = "kvb-test-guest"
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                                reason="creating an unprivileged OS user needs root and useradd (CI runs as root)")

_GUEST_SUBSCRIBER = r"""
import json, os, sys, time
import zmq                                      # before the uid drops (the venv is root's)
uid, gid, home, seconds, *endpoints = sys.argv[1:]
os.setgroups([]); os.setgid(int(gid)); os.setuid(int(uid))
os.environ["HOME"] = home
out = {"uid": os.getuid(), "messages": 0, "replay_frames": 0, "stat": {}}
ctx = zmq.Context()
subs, replays = [], []
for endpoint in endpoints:
    path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None
    if path:
        try:
            os.stat(path); out["stat"][endpoint] = "ok"
        except OSError as exc:
            out["stat"][endpoint] = type(exc).__name__
    sub = ctx.socket(zmq.SUB); sub.setsockopt(zmq.SUBSCRIBE, b""); sub.connect(endpoint); subs.append(sub)
    if path:                                    # the replay socket beside it: every kept batch from seq 0
        replay = ctx.socket(zmq.DEALER); replay.connect(endpoint + ".replay"); replays.append(replay)
poller = zmq.Poller()
for sock in subs + replays:
    poller.register(sock, zmq.POLLIN)
for replay in replays:
    try:
        replay.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
    except zmq.Again:
        pass
deadline = time.monotonic() + float(seconds)
while time.monotonic() < deadline:
    for sock, _ in poller.poll(200):
        frames = sock.recv_multipart()
        if sock in subs:
            out["messages"] += 1
        else:
            out["replay_frames"] += 1
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def guest():
    """(passwd entry, home) of an unprivileged account, created for the module if it does not exist."""
    created = subprocess.run(["id", GUEST], capture_output=True).returncode != 0
    if created:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", GUEST], check=True)
    home = tempfile.mkdtemp(prefix="kvb-guest-home-")
    entry = pwd.getpwnam(GUEST)
    os.chown(home, entry.pw_uid, entry.pw_gid)
    yield entry, home
    shutil.rmtree(home, ignore_errors=True)
    if created:
        subprocess.run(["userdel", GUEST], check=False)


def start_guest_subscriber(guest, endpoints: list[str], seconds: float) -> subprocess.Popen:
    """The guest subscribing to `endpoints` for `seconds`; read the result with guest_result()."""
    entry, home = guest
    return subprocess.Popen([sys.executable, "-c", _GUEST_SUBSCRIBER, str(entry.pw_uid), str(entry.pw_gid), home,
                             str(seconds), *endpoints], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tempfile.gettempdir())


def guest_result(proc: subprocess.Popen, timeout_s: float = 60) -> dict:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])
