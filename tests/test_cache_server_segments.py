"""Stale-segment removal at a cache server's start never stops the start and never touches another
user's files: /dev/shm is world-writable, so any account can plant an entry named like one of the
owner's dead segments. Real OS accounts (the guest of test_cache_server_owner), real /dev/shm.

Two directions, because /dev/shm is sticky: a non-root owner cannot unlink another account's entry
(EPERM) and must not fail its start on that; a root owner can unlink anything and must not.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cache_server_helpers import local_url
from kvbridge.cache_server.server import CacheServer
from kvbridge.settings import WORK_DIR
from test_cache_server_owner import guest  # noqa: F401  (the fixture: a real unprivileged account)

SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd") or not SHM.is_dir(),
                                reason="a second OS account needs root and useradd, and the test needs /dev/shm")

# The owner's cache server, started as the guest account (imports first: the venv lives under /root).
_OWNER_SERVER = r"""
import dataclasses, json, os, sys
from kvbridge.cache_server.server import CacheServer
from kvbridge.cache_server.server_store import ServerStore
from kvbridge.cache_server.metrics import ServerMetrics
import kvbridge.cache_server.modules.storage, kvbridge.cache_server.modules.lookup
import kvbridge.cache_server.modules.management, kvbridge.cache_server.modules.metrics
from kvbridge.settings import Settings
uid, gid, home, url = sys.argv[1:]
os.setgroups([]); os.setgid(int(gid)); os.setuid(int(uid))
os.environ["HOME"] = home
os.environ.pop("XDG_CACHE_HOME", None)
settings = dataclasses.replace(Settings(), l1_bytes=1 << 20, cache_server_page_bytes=64 << 10, l2_enabled=False,
                               cache_server_metrics_port=0)
server = CacheServer(settings, url=url)   # removes stale segments, then creates its own
print(json.dumps({"started": True, "segment": str(server.store.segment.path)}), flush=True)
server.close()
"""


def dead_pid() -> int:
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def as_account(entry, *command: str) -> None:
    subprocess.run(["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups", *command],
                   check=True)


def test_another_accounts_entries_do_not_stop_a_non_root_owners_start(guest):  # noqa: F811
    """The owner is the unprivileged guest; root (another account to it) plants a link to one of the
    owner's own files and a file of its own, both named like the owner's dead segments."""
    entry, home = guest
    uid, pid = entry.pw_uid, dead_pid()
    owners_file = Path(tempfile.mkdtemp(prefix="kvb-owner-")) / "notes"
    owners_file.write_bytes(b"the owner's own file")
    os.chown(owners_file.parent, uid, entry.pw_gid)
    os.chown(owners_file, uid, entry.pw_gid)
    planted_link = SHM / f"kvbridge-{uid}-{pid}-0a0a.pool"
    planted_file = SHM / f"kvbridge-{uid}-{pid}-0b0b.pool"
    own_stale = SHM / f"kvbridge-{uid}-{pid}-0c0c.pool"
    try:
        planted_link.symlink_to(owners_file)
        planted_file.write_bytes(b"root's file")
        as_account(entry, "touch", str(own_stale))       # a real stale segment of the owner's
        child = subprocess.run([sys.executable, "-c", _OWNER_SERVER, str(uid), str(entry.pw_gid), home, local_url()],
                               capture_output=True, text=True, timeout=60, cwd=WORK_DIR)
        assert child.returncode == 0, child.stderr[-3000:]
        assert json.loads(child.stdout.strip().splitlines()[-1])["started"]
        assert planted_link.is_symlink() and os.readlink(planted_link) == str(owners_file)
        assert planted_file.read_bytes() == b"root's file"
        assert owners_file.read_bytes() == b"the owner's own file"
        assert not own_stale.exists()                     # what is the owner's was still cleaned up
        assert "left " in child.stderr and str(planted_link) in child.stderr
    finally:
        for path in (planted_link, planted_file, own_stale):
            path.unlink(missing_ok=True)
        shutil.rmtree(owners_file.parent, ignore_errors=True)


def test_a_root_owner_leaves_another_accounts_entries_alone(guest, make_settings):  # noqa: F811
    """The owner is root (the test process); the guest plants a link to a root-owned file and a file of
    its own, named like root's dead segments. Root could unlink them, so only the owner check stops it."""
    entry, _ = guest
    pid = dead_pid()
    roots_file = Path(tempfile.mkdtemp(prefix="kvb-root-")) / "notes"
    roots_file.write_bytes(b"root's own file")
    planted_link = SHM / f"kvbridge-0-{pid}-1a1a.pool"
    planted_file = SHM / f"kvbridge-0-{pid}-1b1b.pool"
    try:
        as_account(entry, "ln", "-s", str(roots_file), str(planted_link))
        as_account(entry, "sh", "-c", f"printf 'the guest wrote this' > {planted_file}")
        assert os.lstat(planted_link).st_uid == entry.pw_uid == os.lstat(planted_file).st_uid
        settings = make_settings(l1_bytes=1 << 20, cache_server_page_bytes=64 << 10, l2_enabled=False)
        CacheServer(settings, url=local_url()).close()   # the start's first step removes stale segments
        assert planted_link.is_symlink() and os.readlink(planted_link) == str(roots_file)
        assert planted_file.read_bytes() == b"the guest wrote this"
        assert roots_file.read_bytes() == b"root's own file"
    finally:
        for path in (planted_link, planted_file):
            path.unlink(missing_ok=True)
        shutil.rmtree(roots_file.parent, ignore_errors=True)
