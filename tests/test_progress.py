"""Progress on the long steps: a bar on a terminal, a line per tenth in a log (kvbridge/settings/progress.py).

The compile's progress is read from the build's own output. The fixtures are real: an excerpt of
the log of this checkout's `pip install --verbose` build of llama-cpp-python 0.3.36 (scikit-build-core
driving ninja: "[N/193]") and the whole output of a small cmake project built with the Unix Makefiles
generator (make's "[ NN%]"), which is what scripts/build_llama_server.sh shows where ninja is missing.
The terminal case draws on a real pseudo-terminal. The first model load is the embedded model's.
"""
from __future__ import annotations

import ast
import importlib.util
import io
import os
import pty
import re
import sys
from pathlib import Path

import pytest

from kvbridge.settings.progress import Progress, build_milestone, build_step

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NINJA_LOG = FIXTURES / "llama-cpp-python-build-excerpt.txt"
MAKE_LOG = FIXTURES / "cmake-make-build.txt"


def test_the_progress_module_needs_only_the_standard_library():
    """scripts/build_variants.py loads it by path, before or without an installed kvbridge."""
    tree = ast.parse((FIXTURES.parent.parent / "kvbridge" / "settings" / "progress.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {name.split(".")[0] for name in imported} <= set(sys.stdlib_module_names) | {"__future__"}


class Clock:
    """Seconds that pass only when told to."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_in_a_log_a_line_per_tenth_at_most():
    shown, clock = io.StringIO(), Clock()
    progress = Progress("[setup] compiling", stream=shown, clock=clock)
    assert not progress.tty
    for done in range(1, 1001):
        clock.now += 0.3
        progress.update(done, 1000)
    progress.finish("compiled")
    lines = shown.getvalue().splitlines()
    assert lines[0] == "[setup] compiling: 0% (1/1000 steps)"
    assert lines[-2:] == ["[setup] compiling: 100% (1000/1000 steps)", "compiled"]
    assert len(lines) == 12 and "\r" not in shown.getvalue()


def test_on_a_terminal_one_line_redrawn():
    leader, follower = pty.openpty()
    clock = Clock()
    with os.fdopen(follower, "w") as terminal:
        progress = Progress("[setup] downloading model m", 4_000_000, unit="bytes", stream=terminal, clock=clock)
        assert progress.tty
        for done in range(0, 4_000_001, 400_000):
            clock.now += 1
            progress.update(done)
        progress.finish()
    drawn = read_all(leader)
    frames = drawn.split("\r")[1:]   # the terminal adds its own \r before a newline
    assert len(frames) >= 11 and drawn.count("\n") == 1
    assert frames[0].startswith("[setup] downloading model m [........................]   0% 0.0/4.0 MB")
    assert re.match(r"\[setup\] downloading model m \[#{24}\] 100% 4\.0/4\.0 MB, 0\.4 MB/s 11 s", frames[-2])


def test_a_redrawn_line_is_throttled():
    """A fast build on a terminal does not redraw a thousand times a second."""
    leader, follower = pty.openpty()
    with os.fdopen(follower, "w") as terminal:
        progress = Progress("x", stream=terminal, clock=Clock())   # time stands still
        for done in range(1, 501):
            progress.update(done, 500)
        progress.finish()
    drawn = read_all(leader)
    assert drawn.count("\r") <= 3 and "500/500 steps" in drawn


def read_all(leader: int) -> str:
    """Everything the terminal was sent: a pty hands it over in pieces (one read got only the first line in a full
    run), and once its other end is closed and drained a read fails with EIO."""
    chunks = []
    try:
        while chunk := os.read(leader, 65536):
            chunks.append(chunk)
    except OSError:
        pass
    finally:
        os.close(leader)
    return b"".join(chunks).decode()


def steps_of(log: Path) -> list[tuple[int, int, str]]:
    return [step for line in log.read_text().splitlines() if (step := build_step(line))]


def test_the_compilers_own_lines_are_read_as_steps():
    ninja = steps_of(NINJA_LOG)
    assert ninja[0] == (1, 193, "steps") and ninja[-1] == (193, 193, "steps") and len(ninja) == 10
    make = steps_of(MAKE_LOG)
    assert make[0] == (12, 100, "percent") and make[-1] == (100, 100, "percent") and len(make) == 10
    for other in ("  -- Install configuration: \"Release\"", "  *** Building project with Ninja...",
                  "warning: [-Wunused] x", "  [1/193]"):   # the last: a step line always names its command
        assert build_step(other) is None


@pytest.fixture(scope="module")
def build_variants():
    """scripts/build_variants.py as setup.sh runs it: by path, the progress module loaded by path too."""
    spec = importlib.util.spec_from_file_location("build_variants", FIXTURES.parent.parent / "scripts" / "build_variants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_variants"] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("log, last", [(NINJA_LOG, "100% (193/193 steps)"), (MAKE_LOG, "100%")])
def test_a_compile_shows_its_progress_and_keeps_its_whole_output_in_the_log(build_variants, tmp_path, capsys,
                                                                           log, last):
    kept = tmp_path / "build.log"
    assert build_variants.main(["compile", "--log", str(kept), "--label", "llama-server", "--",
                                "cat", str(log)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"[setup] compiling llama-server: {last}" and len(lines) <= 12
    assert kept.read_text().splitlines()[1:] == log.read_text().splitlines()


def test_what_a_pip_build_does_before_its_first_step_is_said():
    said = [m for line in NINJA_LOG.read_text().splitlines() if (m := build_milestone(line))]
    assert said == ["configuring with cmake"]
    assert build_milestone("  Downloading llama_cpp_python-0.3.36.tar.gz (76.6 MB)") == (
        "downloading its source llama_cpp_python-0.3.36.tar.gz (76.6 MB)")


def test_a_failed_compile_names_its_log(build_variants, tmp_path, capsys):
    kept = tmp_path / "build.log"
    assert build_variants.main(["compile", "--log", str(kept), "--label", "llama-server", "--",
                                "sh", "-c", "echo '[ 50%] Building CXX object x.o'; echo 'x.cpp:1: error'; exit 2"]) == 1
    err = capsys.readouterr().err
    assert "x.cpp:1: error" in err and f"compiling llama-server failed (exit 2; full log: {kept})" in err


@pytest.mark.live
def test_the_first_model_load_says_which_file_and_how_long(make_settings, capfd):
    pytest.importorskip("llama_cpp", reason="llama_cpp is missing: run ./scripts/setup.sh")
    from kvbridge.backends.llamacpp import LlamaCppBackend
    from kvbridge.backends.llama_cpp_model import model_path_for

    settings = make_settings(ctx_size=256)
    path = model_path_for(settings)
    if not path.is_file():
        pytest.skip(f"the embedded model {path} is missing: run ./scripts/setup.sh")
    backend = LlamaCppBackend(settings)
    backend.start()
    backend.stop()
    err = capfd.readouterr().err
    assert f"loading model {path.name} ({path.stat().st_size / 1e6:.1f} MB) into llama.cpp…" in err
    assert re.search(rf"model {re.escape(path.name)} loaded in \d+\.\d s", err)
