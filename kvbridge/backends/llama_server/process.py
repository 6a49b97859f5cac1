"""Starting and stopping a private llama-server child process, with no orphans left behind.

Place in the flow: LlamaServerBackend.start() -> **ServerProcess.start()** -> wait for /health;
LlamaServerBackend.stop() / interpreter exit -> **ServerProcess.stop()**.

The child runs in its own process group (Ctrl-C in a terminal reaches KVBridge, which then stops it
in order) and is stopped by stop(), by an atexit hook, and — when started from the main thread — by
the kernel if KVBridge dies (PR_SET_PDEATHSIG). PDEATHSIG fires when the *thread* that forked exits,
so it is not used from worker threads (a GUI may start engines on short-lived ones). A private
directory left by a KVBridge that was killed outright is removed at the next start.
"""
from __future__ import annotations

import atexit
import ctypes
import importlib.metadata
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import requests

from kvbridge.settings import DATA_HOME, SOURCE_CHECKOUT
from kvbridge.errors import EngineUnavailable

BUILD_SCRIPT = "scripts/build_llama_server.sh"
WORK_DIR_PREFIX = "kvb-llama-server-"
_PR_SET_PDEATHSIG = 1


def build_advice() -> str:
    """How to get a llama-server binary here: the build script in a checkout, else a checkout's build and the setting."""
    if SOURCE_CHECKOUT is not None:
        return f"Build it with ./{BUILD_SCRIPT} (about 5 minutes on 2 cores)"
    return (f"Build one with {BUILD_SCRIPT} in a KVBridge source checkout (about 5 minutes on 2 cores) "
            "and point KVB_LLAMA_SERVER_BIN at it")


def built_binary(version: str) -> Path:
    """Where scripts/build_llama_server.sh puts llama-server for a llama-cpp-python version (under DATA_HOME)."""
    return DATA_HOME / ".llama-server" / version / "bin" / "llama-server"


def built_build_info(version: str) -> str:
    """`b<build>-<commit>` of the pinned build, as llama-server reports it in /props (from its --version)."""
    binary = built_binary(version)
    info = binary.parent.parent / "version.txt"  # written by the build script
    if info.is_file():
        text = info.read_text(errors="replace")
    elif binary.is_file():
        try:
            run = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        text = run.stdout + run.stderr
    else:
        return ""
    match = re.search(r"build (\d+), commit ([\w.-]+)", text)
    return f"b{match.group(1)}-{match.group(2)}" if match else ""


def pinned_llama_cpp_version() -> str:
    """The llama-cpp-python version pinned in a checkout's requirements.txt (the build script reads the same
    line); in an installed package, the llama-cpp-python installed beside it ("" when none is)."""
    req = SOURCE_CHECKOUT / "requirements.txt" if SOURCE_CHECKOUT else None
    if req is not None and req.is_file():
        match = re.search(r"^llama-cpp-python==(\S+)", req.read_text(), re.M)
        return match.group(1) if match else ""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return ""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def scratch_dir() -> str:
    """Where a llama-server's private folder (slot files, log) goes: the system temp directory.

    Not /dev/shm, although slot files there never reach a disk: tmpfs keeps a file in 4 KiB pages
    (huge pages for shared memory are off unless an administrator turns them on), and a slot restore
    maps the whole file (patches/llama.cpp), so a 40 MB restore spent ~4.5 ms of its ~7 ms making
    and tearing down page-table entries. In a disk filesystem's page cache a file written with
    write() sits in large folios (ext4 on Linux 6.x, xfs) and the same restore takes 2.7 ms, the cost
    of one copy (Docs/Research.md §15). A save file is read and deleted within its request, before
    the kernel writes anything back; the one restore file per engine is written back in the background.
    """
    return tempfile.gettempdir()


OLD_SCRATCH_DIRS = ("/dev/shm",)   # where earlier versions put their folders (cleaned up at start too)


def remove_stale_work_dirs(parent: Path) -> None:
    """Remove private directories of KVBridge processes that no longer exist (killed, never cleaned up)."""
    for entry in parent.glob(f"{WORK_DIR_PREFIX}*-*"):
        owner = entry.name[len(WORK_DIR_PREFIX):].split("-", 1)[0]
        if not owner.isdigit() or int(owner) == os.getpid():
            continue
        try:
            os.kill(int(owner), 0)
        except ProcessLookupError:
            shutil.rmtree(entry, ignore_errors=True)  # a restore file left here would hold RAM on tmpfs
        except PermissionError:
            continue  # alive, another user's


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class ServerProcess:
    """One llama-server child with a private directory for its slot files and log."""

    def __init__(self, binary: Path, args: list[str], host: str, port: int):
        self.binary = binary
        self.args = args
        self.host = host
        self.port = port
        scratch = scratch_dir()
        for parent in (scratch, *OLD_SCRATCH_DIRS):
            if os.path.isdir(parent):
                remove_stale_work_dirs(Path(parent))
        # the owner's PID in the name lets a later start remove what a killed KVBridge left behind
        self.work_dir = Path(tempfile.mkdtemp(prefix=f"{WORK_DIR_PREFIX}{os.getpid()}-", dir=scratch))
        self.slot_dir = self.work_dir / "slots"
        self.slot_dir.mkdir()
        self.log_path = self.work_dir / "llama-server.log"
        self.proc: subprocess.Popen | None = None
        self._atexit = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        cmd = [str(self.binary), *self.args, "--host", self.host, "--port", str(self.port),
               "--slot-save-path", str(self.slot_dir)]
        in_main_thread = threading.current_thread() is threading.main_thread()
        with open(self.log_path, "wb") as log:
            try:
                self.proc = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=_die_with_parent if in_main_thread else None)
            except OSError as exc:
                self.cleanup()
                raise EngineUnavailable(
                    f"Cannot run llama-server {self.binary} (KVB_LLAMA_SERVER_BIN): {exc.strerror}. "
                    f"{build_advice()}, or point KVB_LLAMA_SERVER_BIN at a working binary.") from exc
        self._atexit = self.stop
        atexit.register(self._atexit)

    def wait_healthy(self, timeout_s: float) -> None:
        """Poll GET /health until 200; on exit or timeout stop the child and raise with its log tail."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is None or self.proc.poll() is not None:
                code = self.proc.returncode if self.proc is not None else None
                raise self._failure(f"llama-server exited with code {code} while starting")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise self._failure(f"llama-server did not become healthy within {timeout_s:g} s "
                                    f"(KVB_LLAMA_START_TIMEOUT)")
            time.sleep(0.2)

    def _failure(self, what: str) -> EngineUnavailable:
        tail = self.log_tail()
        self.stop()
        hint = ""
        if "bind" in tail.lower() or "address already in use" in tail.lower():
            hint = f" Port {self.port} is in use; choose another with KVB_LLAMA_SERVER_PORT (0 = any free port)."
        return EngineUnavailable(f"{what}.{hint}\nLast lines of its log:\n{tail}")

    def log_tail(self, n_lines: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n_lines:]) or "(empty log)"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the child's process group, wait, SIGKILL if needed; remove the private directory."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=grace_s)
        elif proc is not None:
            proc.wait()  # reap
        if self._atexit is not None:
            atexit.unregister(self._atexit)
            self._atexit = None
        self.cleanup()

    def cleanup(self) -> None:
        shutil.rmtree(self.work_dir, ignore_errors=True)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the child leads its own group (start_new_session)
    except ProcessLookupError:
        pass  # already gone
