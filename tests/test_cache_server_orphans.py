"""A writer dropped for silence while it may still write (SIGSTOP, a frozen VM, swap) must not write
into another object's pages when it resumes: its unfinished writes' pages stay quarantined until its
process is gone. Real processes and real signals: a child client prepares a write through shared
memory, is SIGSTOPped past the reap timeout, another client stores objects meanwhile, then the child
resumes, copies its bytes into the pages it was given and tries to commit.

What the writer claims at hello does not decide it (the writer lock does, kvbridge.cache_server.liveness):
the same run with a writer that claims a pid that does not exist, the pid of another live process, or
another host's name, and with a writer in a PID namespace of its own (as in a container sharing
/dev/shm), where its own pid names another process of the server's namespace.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from cache_server_helpers import running_server
from kvbridge.cache_server.client import CacheClient
from kvbridge.settings import WORK_DIR
from kvbridge.store.objects import ObjectMeta

PAGE = 64 << 10
OBJECT = 8 * PAGE
META = ObjectMeta(namespace="ns", n_tokens=1, tokens_digest=b"", kind="chunk")

_WRITER = r"""
import json, os, socket, sys
claim = json.loads(sys.argv[3])          # what this writer says about itself at hello, true or not
if "pid" in claim:
    os.getpid = lambda: claim["pid"]
if "hostname" in claim:
    socket.gethostname = lambda: claim["hostname"]
from kvbridge.cache_server import protocol
from kvbridge.cache_server.client import CacheClient
from kvbridge.cache_server.protocol import Kind
from kvbridge.store.objects import ObjectMeta
url, size = sys.argv[1], int(sys.argv[2])
client = CacheClient(url, timeout_s=5)
meta = protocol.WireMeta.of(ObjectMeta(namespace="ns", n_tokens=1, tokens_digest=b"", kind="chunk"))
prepared = client._call(Kind.STORE_PREPARE, protocol.StorePrepare(b"w" * 16, size, meta), protocol.PrepareReply)
print(json.dumps({"instance_id": client.instance_id, "pages": list(prepared.pages), "pid": os.getpid()}), flush=True)
sys.stdin.readline()                                   # the test SIGSTOPs us here, then lets us go on
client._segment.write(list(prepared.pages), b"\xee" * size)   # the copy a paused writer resumes with
try:
    reply = client._call(Kind.STORE_COMMIT, protocol.StoreCommit(prepared.lease_id), protocol.StoreReply)
    print(json.dumps({"commit": "stored" if reply.stored else reply.reason}), flush=True)
except Exception as exc:
    print(json.dumps({"commit": f"refused: {exc}"}), flush=True)
sys.stdin.readline()
"""


def wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(what)
        time.sleep(0.05)


def dead_pid() -> int:
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def writer_command(url: str, claim: str) -> list[str]:
    """The writer's command line, with the claim it makes at hello."""
    command = [sys.executable, "-c", _WRITER, url, str(OBJECT)]
    claims = {"its own pid": {}, "a pid that does not exist": {"pid": dead_pid()},
              "the pid of another live process": {"pid": os.getpid()}, "another host's name": {"hostname": "a-container"},
              "a PID namespace of its own": {}}
    if claim == "a PID namespace of its own":
        if os.geteuid() != 0 or not shutil.which("unshare"):
            pytest.skip("a PID namespace of its own needs root and unshare(1)")
        command = ["unshare", "--pid", "--fork", "--kill-child", *command]
    return [*command, json.dumps(claims[claim])]


def writer_pid(proc: subprocess.Popen) -> int:
    """The writer's pid as this namespace sees it (under unshare it is unshare's child)."""
    if os.path.basename(proc.args[0]) != "unshare":
        return proc.pid
    children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
    assert len(children) == 1, children
    return int(children[0])


CLAIMS = ["its own pid", "a pid that does not exist", "the pid of another live process", "another host's name",
          "a PID namespace of its own"]


@pytest.mark.parametrize("claim", CLAIMS)
def test_a_paused_writer_dropped_for_silence_cannot_overwrite_another_object(make_settings, claim):
    settings = make_settings(l1_bytes=48 * PAGE, cache_server_page_bytes=PAGE, cache_server_reap_timeout=1.0,
                             cache_server_registration_grace=1.0, l2_enabled=False)
    with running_server(settings) as server:
        writer = subprocess.Popen(writer_command(server.url, claim), cwd=WORK_DIR, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            prepared = json.loads(writer.stdout.readline())
            real_pid = writer_pid(writer)
            if claim == "a PID namespace of its own":
                assert prepared["pid"] != real_pid     # what it would claim names another process here
            os.kill(real_pid, signal.SIGSTOP)
            pool = server.store.pool
            wait_until(lambda: server.clients.get(prepared["instance_id"]) is None, 10,
                       "the paused writer was not dropped for silence")
            with CacheClient(server.url, timeout_s=5) as owner:
                mine = {bytes([i]) * 16: bytes([i]) * OBJECT for i in (1, 2)}
                for key, blob in mine.items():
                    assert owner.store(key, blob, META)[0]
                os.kill(real_pid, signal.SIGCONT)
                writer.stdin.write("go\n")
                writer.stdin.flush()
                result = json.loads(writer.stdout.readline())
                assert result["commit"].startswith("refused")          # its lease is no longer its own
                for key, blob in mine.items():                         # and it wrote into no object of ours
                    found = owner.retrieve(key, "ns")
                    assert bytes(found.blob) == blob and owner.intact(found)
                    owner.release([found])
                assert prepared["instance_id"] in pool.orphan_owners()
                assert pool.stats()["quarantined_pages"] == len(prepared["pages"])
            writer.stdin.write("done\n")
            writer.stdin.flush()
            writer.wait(timeout=30)
            wait_until(lambda: not pool.orphan_owners() and pool.stats()["quarantined_pages"] == 0, 10,
                       "the exited writer's pages were not released")
            pool.check_invariants()
        finally:
            if writer.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(writer_pid(writer), signal.SIGCONT)
                writer.kill()
                writer.wait()
