"""KVBridge as a package: pyproject.toml against the pinned requirements, and the wheel in a clean venv.

The wheel test is what a user of `pip install kvbridge` meets: the wheel is built from this checkout
(pip's isolated build, setuptools from PyPI), installed with its dependencies into a new virtual
environment without llama-cpp-python, and run from a folder outside the checkout with its own
XDG_DATA_HOME. It needs PyPI (the machine's package registry), as scripts/setup.sh does.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kvbridge.settings import WORK_DIR

PYPROJECT = tomllib.loads((WORK_DIR / "pyproject.toml").read_text())
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==(\S+)")


def pins(path: Path) -> dict[str, str]:
    """name -> version of every `name==version` line."""
    found = {}
    for line in path.read_text().splitlines():
        match = PIN.match(line.strip())
        if match:
            found[canonicalize_name(match.group(1))] = match.group(2)
    return found


def declared(*groups: str) -> dict[str, Requirement]:
    """pyproject's requirements: the dependencies ("") and the named extras, self-references left out."""
    project = PYPROJECT["project"]
    lines = [line for group in groups
             for line in (project["dependencies"] if group == "" else project["optional-dependencies"][group])]
    reqs = [Requirement(line) for line in lines]
    return {canonicalize_name(r.name): r for r in reqs if canonicalize_name(r.name) != "kvbridge"}


RUNTIME_GROUPS = ("", "llama", "gui", "serve", "cache-server", "redis", "fleet")


@pytest.mark.parametrize("requirements, groups", [("requirements.txt", RUNTIME_GROUPS),
                                                  ("requirements-test.txt", ("test",))])
def test_every_pin_is_declared_and_inside_its_range(requirements, groups):
    """The scripts install the pins, pip resolves the ranges: the same packages, each pin inside its range."""
    pinned, wanted = pins(WORK_DIR / requirements), declared(*groups)
    assert sorted(pinned) == sorted(wanted), (
        f"{requirements} pins {sorted(set(pinned) - set(wanted))} that pyproject.toml does not declare, and "
        f"pyproject.toml declares {sorted(set(wanted) - set(pinned))} that {requirements} does not pin")
    outside = {name: f"{version} not in {wanted[name].specifier}"
               for name, version in pinned.items() if not wanted[name].specifier.contains(version, prereleases=True)}
    assert not outside, f"pins outside pyproject.toml's ranges: {outside}"


def test_the_all_extra_holds_every_runtime_extra():
    everything = Requirement(PYPROJECT["project"]["optional-dependencies"]["all"][0])
    assert everything.extras == set(RUNTIME_GROUPS[1:])


def test_the_console_script_is_the_module_entry_point():
    assert PYPROJECT["project"]["scripts"] == {"kvbridge": "kvbridge.__main__:main"}
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from this checkout, installed into a new venv; (venv's bin, a work folder, env)."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheels, venv, work = tmp / "wheels", tmp / "venv", tmp / "work"
    work.mkdir()
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
                            "-w", str(wheels), str(WORK_DIR)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("kvbridge-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                          str(wheel)], capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("KVB_") and key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(XDG_DATA_HOME=str(tmp / "data"), HOME=str(tmp / "home"))
    return venv / "bin", work, env


def run_in(installed, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    bin_dir, work, env = installed
    return subprocess.run([str(bin_dir / argv[0]), *argv[1:]], cwd=work, env=env, capture_output=True, text=True,
                          timeout=timeout)


CHECK = """
import json, kvbridge
from kvbridge import CachedEngine, Settings, make_backend
from kvbridge.settings import DATA_HOME, SOURCE_CHECKOUT, WORK_DIR
from kvbridge.bench.common.scenarios import scenario_specs
import importlib.util
print(json.dumps({"version": kvbridge.__version__, "file": kvbridge.__file__, "checkout": str(SOURCE_CHECKOUT),
                  "data_home": str(DATA_HOME), "work_dir": str(WORK_DIR), "problems": Settings.from_env().validate(),
                  "llama_cpp": importlib.util.find_spec("llama_cpp") is not None,
                  "scenarios": [s.key for s in scenario_specs()]}))
"""


def test_the_wheel_imports_and_finds_its_places_outside_the_checkout(installed):
    bin_dir, work, env = installed
    done = run_in(installed, "python", "-c", CHECK)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert not seen["llama_cpp"] and "site-packages" in seen["file"] and seen["checkout"] == "None"
    assert seen["data_home"] == str(Path(env["XDG_DATA_HOME"]) / "kvbridge")
    assert Path(seen["work_dir"]).resolve() == work.resolve()
    assert {"doc-qa", "rag"} <= set(seen["scenarios"])   # the package data (documents, corpus) came along
    # nothing fetched yet: the one problem is the missing model, and it names the installed package's command
    assert seen["problems"] and all("kvbridge setup" in p and "scripts/" not in p for p in seen["problems"]), \
        seen["problems"]


def test_the_console_script_answers_help(installed):
    done = run_in(installed, "kvbridge", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: kvbridge ") and "setup" in done.stdout and "serve" in done.stdout
    setup_help = run_in(installed, "kvbridge", "setup", "--help")
    assert setup_help.returncode == 0 and "--model" in setup_help.stdout


def test_the_wheel_reads_only_an_env_file_it_is_told_of(installed):
    """Not the current folder's `.env` (whatever folder it runs in); the one KVB_ENV_FILE names (or
    the user's ~/.config/kvbridge/.env: tests/test_env_file.py)."""
    bin_dir, work, env = installed
    (work / ".env").write_text("KVB_CHUNK_SIZE=64\n")
    code = "from kvbridge import Settings; print(Settings.from_env().chunk_size)"
    try:
        folder = run_in(installed, "python", "-c", code)
        named = subprocess.run([str(bin_dir / "python"), "-c", code], cwd=work, capture_output=True, text=True,
                               env={**env, "KVB_ENV_FILE": str(work / ".env")}, timeout=120)
    finally:
        (work / ".env").unlink()
    assert folder.returncode == 0 and folder.stdout.strip() == "256", folder.stderr
    assert named.returncode == 0 and named.stdout.strip() == "64", named.stderr
