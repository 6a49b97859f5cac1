"""Before llama.cpp is loaded into this process: does this build run on this CPU at all?

A CPU may advertise instructions its hypervisor will not execute (AMX tiles on some cloud VMs); a
llama.cpp built for them dies by a signal at its first decode, and in-process that would take the
GUI or the caller's script down with it. So the first start of the in-process engine per build runs
kvbridge/backends/smoke_decode.py (the same check ./scripts/setup.sh runs after every build) in a child
process; only when the child decodes does the engine load llama.cpp here. A build that passed is
remembered in the virtual environment beside the build record, keyed by the library files and the
model, so later starts pay nothing. Deliberately left out: re-checking on every start (a build does not change without its
files changing).
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from kvbridge.errors import EngineUnavailable
from kvbridge.settings import SOURCE_CHECKOUT, WORK_DIR, setup_command
from kvbridge.settings.build_record import build_record
from kvbridge.settings.paths import BUILD_RECORD

log = logging.getLogger(__name__)
SMOKE_SCRIPT = Path(__file__).with_name("smoke_decode.py")   # run by path, so the child imports no kvbridge
CHECKED_DIR = BUILD_RECORD.parent / "kvbridge-build-checked"
SMOKE_TIMEOUT_S = 180.0
CRASH_HOOK_VAR = "KVB_SMOKE_CRASH_VARIANTS"   # smoke_decode.py's test hook
EXIT_ENVIRONMENT = 3   # smoke_decode.py: the environment is wrong (no llama_cpp, no model), not the build


def installed_variant(record: Path = BUILD_RECORD) -> str:
    """The instruction-set variant ./scripts/setup.sh installed ('unknown' without a build record)."""
    return str(build_record(record).get("variant") or "unknown")


def _library_files() -> list[Path]:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return []
    lib_dir = Path(list(spec.submodule_search_locations)[0]) / "lib"
    return sorted(lib_dir.glob("*.so*")) if lib_dir.is_dir() else []


def build_identity(model: Path) -> str:
    """Digest of the llama.cpp libraries (path, size, mtime, inode) and the model file: what a smoke decode vets.

    The smoke decode's test hook (which makes it crash on purpose) is part of it: a check made
    without the hook does not vouch for one made with it.
    """
    parts = [f"hook={os.environ.get(CRASH_HOOK_VAR, '')}"]
    for path in [*_library_files(), model]:
        try:
            st = path.stat()
        except OSError:
            continue
        parts.append(f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def ensure_llama_cpp_runs(model: Path, checked_dir: Path | None = None) -> None:
    """Smoke-decode `model` in a child process unless this build already passed; EngineUnavailable when it crashes."""
    marker = (checked_dir or CHECKED_DIR) / build_identity(model)
    if marker.exists() or not SMOKE_SCRIPT.is_file():
        return
    variant = installed_variant()
    argv = [sys.executable, str(SMOKE_SCRIPT), "llama", "--model", str(model), "--variant", variant]
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, cwd=WORK_DIR)
    except subprocess.TimeoutExpired:
        raise EngineUnavailable(
            f"llama.cpp did not finish a test decode of {model.name} in a child process within "
            f"{SMOKE_TIMEOUT_S:.0f} s, so it was not loaded here. Run {setup_command()} to check and rebuild it.") from None
    if run.returncode == 0:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(run.stdout.strip()[-2000:] + "\n")
        return
    if run.returncode == EXIT_ENVIRONMENT:
        # not the build's fault (llama_cpp missing, model unreadable): the in-process load says what is wrong
        log.warning("llama.cpp smoke decode could not run: %s", run.stderr.strip()[-500:])
        return
    how = (f"was killed by {signal.Signals(-run.returncode).name}" if run.returncode < 0
           else f"failed (exit code {run.returncode})")
    raise EngineUnavailable(
        f"llama.cpp {how} during a test decode of {model.name} in a child process, so it was not loaded into "
        f"this one: this build of llama-cpp-python (instruction set '{variant}') uses CPU instructions this "
        f"machine cannot run. {rebuild_advice()}")


def rebuild_advice() -> str:
    """How to replace a build that crashes: the ladder in a checkout (its record still vouches for the build,
    so it goes first), else pip with safer flags."""
    if SOURCE_CHECKOUT is not None:
        return (f"Remove its build record and set up again: rm {BUILD_RECORD} && ./scripts/setup.sh (it tests each "
                "build and steps down to a safer instruction set), or choose the flags yourself with KVB_LLAMA_CMAKE_ARGS.")
    from kvbridge.settings.install import extra_requirements

    # pinned (kvbridge's llama extra, the version KVBridge reads the state of), so pip cannot pull another version
    pinned = next((r for r in extra_requirements("llama") if r.startswith("llama-cpp-python==")), "")
    if not pinned:   # no kvbridge metadata: the version installed now
        from importlib.metadata import version

        pinned = f"llama-cpp-python=={version('llama-cpp-python')}"
    return ("Reinstall it with flags this CPU runs, e.g. CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX512=OFF' "
            f"{sys.executable} -m pip install --force-reinstall --no-deps --no-cache-dir --no-binary llama-cpp-python "
            f"'{pinned}' (it compiles: about 5 minutes on 2 cores).")
