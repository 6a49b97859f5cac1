"""Only the OS user who started the cache server can use it, by default, and the owner's clients talk
only to the owner's server: tested with a second, unprivileged OS user that the test creates (CI runs
as root, which file modes do not stop).

The guest is a real process that imports the project's own code, then drops to the guest's uid and
gid (the venv's python lives under /root, which the guest could not execute from), with a HOME of its
own, exactly as another account on the machine would run it with default settings. As a client: it
cannot read the owner's token or key file (the folders above them are made searchable by every account
for the test, as a 0755 home is, so the files' own 0600 is what stops it), so its client refuses to connect; even knowing the
server's public key (not a secret) it is turned away in the handshake; it cannot open the
shared-memory segment; nothing it does stores, reads or clears anything. As a squatter: while the
owner's server is down it takes the owner's port with a server that says yes to any hello
(kvbridge.bench.probes.squatter), and no byte of the owner's KV reaches it.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cache_server_helpers import owner_store_after_its_server, running_server
from guest_account import GUEST, guest  # noqa: F401 (guest: a fixture)
from kvbridge.cache_server.auth import token_file
from kvbridge.cache_server.client import CacheClient, CacheServerRefused
from kvbridge.cache_server.curve import key_file
from kvbridge.settings import WORK_DIR
from kvbridge.store.objects import ObjectMeta

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                                reason="creating an unprivileged OS user needs root and useradd (CI runs as root)")

_GUEST_CLIENT = r"""
import json, os, sys
from kvbridge.cache_server.client import CacheClient
from kvbridge.cache_server.connection import CacheServerRefused, CacheServerUnavailable
from kvbridge.store.objects import ObjectMeta
uid, gid, home, url, token_path, key_path, shm_path, public_key = sys.argv[1:]
os.setgroups([]); os.setgid(int(gid)); os.setuid(int(uid))
os.environ["HOME"] = home
os.environ.pop("XDG_CACHE_HOME", None)
out = {"uid": os.getuid()}
try:
    open(token_path).read(); out["token"] = "read"
except PermissionError:
    out["token"] = "denied"
try:
    open(key_path).read(); out["key"] = "read"
except PermissionError:
    out["key"] = "denied"
try:
    open(shm_path, "rb"); out["shm"] = "opened"
except PermissionError:
    out["shm"] = "denied"
for name, server_key in (("hello", ""), ("hello_with_public_key", public_key)):
    try:
        with CacheClient(url, timeout_s=5, server_key=server_key) as client:
            out[name] = "accepted"
            out["store"] = client.store(b"p" * 16, b"planted KV", ObjectMeta(namespace="ns", n_tokens=1, tokens_digest=b"", kind="chunk"))[0]
            out["read"] = client.retrieve(b"o" * 16, "ns") is not None
    except CacheServerRefused as exc:
        out[name] = "refused: " + str(exc)
    except CacheServerUnavailable as exc:
        out[name] = "unavailable: " + str(exc)
print(json.dumps(out))
"""


@contextlib.contextmanager
def traversable_by_others(path: Path):
    """Every folder from `path` up to / searchable by every account, for the duration: the test's HOME is a
    private temp folder, and on a real machine ~ is often 0755, so the file's own mode must be what stops a
    reader (a token file written 0644 would be readable here)."""
    changed = []
    for folder in [path, *path.parents]:
        mode = stat.S_IMODE(folder.stat().st_mode)
        if not mode & stat.S_IXOTH:
            os.chmod(folder, mode | stat.S_IXOTH)
            changed.append((folder, mode))
    try:
        yield
    finally:
        for folder, mode in changed:
            os.chmod(folder, mode)


def test_another_os_user_cannot_read_plant_or_clear(guest, make_settings):
    entry, home = guest
    settings = make_settings()
    meta = ObjectMeta(namespace="ns", n_tokens=1, tokens_digest=b"", kind="chunk")
    with running_server(settings) as server, CacheClient(server.url, timeout_s=5) as owner, \
            traversable_by_others(token_file(server.url).parent):
        assert owner.store(b"o" * 16, b"the owner's KV", meta)[0]
        child = subprocess.run(
            [sys.executable, "-c", _GUEST_CLIENT, str(entry.pw_uid), str(entry.pw_gid), home, server.url,
             str(token_file(server.url)), str(key_file(server.url)), str(server.store.segment.path),
             server.keys.public],
            capture_output=True, text=True, timeout=60, cwd=WORK_DIR)
        assert child.returncode == 0, child.stderr[-2000:]
        out = json.loads(child.stdout.strip().splitlines()[-1])
        assert out["uid"] == entry.pw_uid
        assert out["token"] == "denied" and out["key"] == "denied" and out["shm"] == "denied"
        # its own home has no key file for the port: its client sends nothing at all
        assert out["hello"].startswith("refused:") and "no key to authenticate" in out["hello"]
        # knowing the public key, it gets as far as the handshake, where the server turns it away
        assert out["hello_with_public_key"].startswith("refused:")
        assert "only the OS user who started the server" in out["hello_with_public_key"]
        # the owner's object is intact and nothing was planted
        assert bytes(owner.retrieve(b"o" * 16, "ns").blob) == b"the owner's KV"
        assert owner.retrieve(b"p" * 16, "ns") is None
        assert server._zap.denied >= 1   # turned away in the handshake, before any message


_SQUAT_AS_GUEST = r"""
import json, os, sys
from kvbridge.bench.probes.squatter import parse_args, run   # before the uid drops (the venv is root's)
uid, gid, home, *argv = sys.argv[1:]
args = parse_args(argv)
os.setgroups([]); os.setgid(int(gid)); os.setuid(int(uid))
os.environ["HOME"] = home
os.environ.pop("XDG_CACHE_HOME", None)
print(json.dumps({"uid": os.getuid()}), flush=True)
sys.exit(run(args))
"""
OBJECT = bytes(range(256)) * 4096   # the owner's 1 MiB of KV


@pytest.mark.parametrize("squatter", ["says-yes", "curve"])
@pytest.mark.parametrize("owner_server", ["stopped", "crashed"])
def test_a_squatter_of_another_account_gets_no_byte_of_the_owners_kv(guest, make_settings, squatter, owner_server):
    """The owner's server stops (its key file goes) or crashes (its key file stays); the guest takes the port
    with a server that says yes to any hello. The owner's client, old or new, refuses naming the key file,
    its RemoteStore counts misses in bounded time, and the squatter receives nothing."""
    entry, home = guest
    meta = ObjectMeta(namespace="ns", n_tokens=1, tokens_digest=b"", kind="chunk")
    url, store = owner_store_after_its_server(make_settings(), owner_server, OBJECT, meta)
    watch = os.path.join(home, "owner-object.bin")   # for the squatter to look for among what it receives
    with open(watch, "wb") as f:
        f.write(OBJECT)
    os.chmod(watch, 0o644)
    args = [url, "--watch", watch] + (["--curve"] if squatter == "curve" else [])
    squat = subprocess.Popen([sys.executable, "-c", _SQUAT_AS_GUEST, str(entry.pw_uid), str(entry.pw_gid), home, *args],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=WORK_DIR)
    try:
        assert json.loads(squat.stdout.readline())["uid"] == entry.pw_uid
        assert squat.stdout.readline().strip() == "squatting", squat.stderr.read()[-2000:]
        started = time.monotonic()
        while not store.stats()["refused"]:
            assert store.get(b"o" * 16) is None                       # a miss, never the squatter's answer
            assert not store.put(b"n" * 16, OBJECT, meta)
            assert time.monotonic() - started < 10, "the owner's store never refused the squatter"
        with pytest.raises(CacheServerRefused) as refused:
            CacheClient(url, timeout_s=2)
        assert str(key_file(url)) in str(refused.value)
        squat.stdin.close()
        out = json.loads(squat.stdout.read().strip().splitlines()[-1])
        assert squat.wait(timeout=30) == 0
        assert out["messages"] == 0 and out["bytes"] == 0 and not out["saw_watched"], out
    finally:
        store.close()
        if squat.poll() is None:
            squat.kill()
            squat.wait(timeout=10)
