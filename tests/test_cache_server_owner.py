"""Only the OS user who started the cache server can use it, by default: tested with a second,
unprivileged OS user that the test creates (CI runs as root, which file modes do not stop).

The guest is a real process that imports the project's own client, then drops to the guest's uid and
gid (the venv's python lives under /root, which the guest could not execute from), with a HOME of its
own, exactly as another account on the machine would run it with default settings: it cannot read
the owner's token, its hello is refused, it cannot open the shared-memory segment, and nothing it
does stores, reads or clears anything.
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

from cache_server_helpers import running_server
from kvbridge.cache_server.auth import token_file
from kvbridge.cache_server.client import CacheClient
from kvbridge.settings import PROJECT_ROOT
from kvbridge.store.objects import ObjectMeta

GUEST = "kvb-test-guest"
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                                reason="creating an unprivileged OS user needs root and useradd (CI runs as root)")

_GUEST_CLIENT = r"""
import json, os, sys
from kvbridge.cache_server.client import CacheClient
from kvbridge.cache_server.connection import CacheServerRefused, CacheServerUnavailable
from kvbridge.store.objects import ObjectMeta
uid, gid, home, url, token_path, shm_path = sys.argv[1:]
os.setgroups([]); os.setgid(int(gid)); os.setuid(int(uid))
os.environ["HOME"] = home
os.environ.pop("XDG_CACHE_HOME", None)
out = {"uid": os.getuid()}
try:
    open(token_path).read(); out["token"] = "read"
except PermissionError:
    out["token"] = "denied"
try:
    open(shm_path, "rb"); out["shm"] = "opened"
except PermissionError:
    out["shm"] = "denied"
try:
    with CacheClient(url, timeout_s=5) as client:
        out["hello"] = "accepted"
        out["store"] = client.store(b"p" * 16, b"planted KV", ObjectMeta(namespace="ns", n_tokens=1, tokens_digest=b"", kind="chunk"))[0]
        out["read"] = client.retrieve(b"o" * 16, "ns") is not None
except CacheServerRefused as exc:
    out["hello"] = "refused: " + str(exc)
except CacheServerUnavailable as exc:
    out["hello"] = "unavailable: " + str(exc)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def guest():
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


def test_another_os_user_cannot_read_plant_or_clear(guest, make_settings):
    entry, home = guest
    settings = make_settings()
    meta = ObjectMeta(namespace="ns", n_tokens=1, tokens_digest=b"", kind="chunk")
    with running_server(settings) as server, CacheClient(server.url, timeout_s=5) as owner:
        assert owner.store(b"o" * 16, b"the owner's KV", meta)[0]
        child = subprocess.run(
            [sys.executable, "-c", _GUEST_CLIENT, str(entry.pw_uid), str(entry.pw_gid), home, server.url,
             str(token_file(server.url)), str(server.store.segment.path)],
            capture_output=True, text=True, timeout=60, cwd=PROJECT_ROOT)
        assert child.returncode == 0, child.stderr[-2000:]
        out = json.loads(child.stdout.strip().splitlines()[-1])
        assert out["uid"] == entry.pw_uid
        assert out["token"] == "denied" and out["shm"] == "denied"
        assert out["hello"].startswith("refused:") and "only the OS user who started the server" in out["hello"]
        # the owner's object is intact and nothing was planted
        assert bytes(owner.retrieve(b"o" * 16, "ns").blob) == b"the owner's KV"
        assert owner.retrieve(b"p" * 16, "ns") is None
        assert server.metrics.value("kvbridge_request_errors_total", {"code": "unauthorized"}) >= 1
