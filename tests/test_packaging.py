"""KVBridge as a package: pyproject.toml against the pinned requirements, and the wheel in a clean venv.

The wheel test is what a user installing a clone with pip meets: the wheel is built from this checkout
(pip's isolated build), installed with its dependencies into a new virtual environment without
llama-cpp-python or any other extra, and run from a folder outside the checkout with its own
XDG_DATA_HOME. It reaches no package index: the build requires and the dependencies come from
build/wheelhouse/ (scripts/wheelhouse.sh, which scripts/setup.sh --test runs), at the versions
requirements.txt pins; where `unshare -n` is permitted, pip runs with no network at all. The same venv
runs every command that needs an extra, which must answer with the extra and a pip line, not a traceback.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kvbridge.cli.commands import COMMANDS
from kvbridge.cli.extras import COMMAND_EXTRAS, ENGINE_EXTRAS, EXTRA_INCLUDES, EXTRA_MODULES, for_missing_module
from kvbridge.settings import WORK_DIR
from kvbridge.settings.install import extra_requirements

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


RUNTIME_GROUPS = ("", "llama", "gui", "serve", "cache-server", "redis", "s3", "fleet")


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


@pytest.mark.parametrize("requirements, groups", [("requirements.txt", RUNTIME_GROUPS),
                                                  ("requirements-test.txt", ("test",))])
def test_every_range_starts_at_its_pin(requirements, groups):
    """A lower bound below the pin would promise versions nothing ever tested."""
    pinned, wanted = pins(WORK_DIR / requirements), declared(*groups)
    lower = {name: {s.version for s in wanted[name].specifier if s.operator in (">=", "==")} for name in pinned}
    off = {name: f"pinned {version}, range {wanted[name].specifier}"
           for name, version in pinned.items() if lower[name] != {version}}
    assert not off, f"ranges whose lower bound is not the pin: {off}"


def test_the_all_extra_holds_every_runtime_extra():
    everything = Requirement(PYPROJECT["project"]["optional-dependencies"]["all"][0])
    assert everything.extras == set(RUNTIME_GROUPS[1:])


def test_the_console_script_is_the_module_entry_point():
    assert PYPROJECT["project"]["scripts"] == {"kvbridge": "kvbridge.__main__:main"}
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"


def test_every_command_has_a_row_of_extras():
    assert sorted(COMMAND_EXTRAS) == sorted(c.name for c in COMMANDS)
    for name, needs in COMMAND_EXTRAS.items():
        assert set(needs.extras) | {e for extras in needs.when_flag.values() for e in extras} <= set(EXTRA_MODULES), name
        assert needs.engine in ("", "engine", "serve_engine"), name
    assert {e for extras in ENGINE_EXTRAS.values() for e in extras} <= set(EXTRA_MODULES)


def test_the_extras_modules_are_the_extras_packages():
    """EXTRA_MODULES names one import per distribution each runtime extra declares (this venv has them all)."""
    owners = {module: {canonicalize_name(d) for d in dists} for module, dists in metadata.packages_distributions().items()}
    assert set(EXTRA_MODULES) == set(RUNTIME_GROUPS[1:])
    for extra, modules in EXTRA_MODULES.items():
        brings = set(declared(extra)) | {d for inner in EXTRA_INCLUDES.get(extra, ()) for d in declared(inner)}
        imported = {d for module in modules for d in owners.get(module, ())}
        own = set(declared(extra))
        assert own == imported & own and imported <= brings, (extra, own, imported)


def test_the_pip_line_names_the_extras_requirements_not_kvbridge():
    """KVBridge is on no index: the advice names what the extra brings, self-references expanded."""
    assert extra_requirements("serve") == PYPROJECT["project"]["optional-dependencies"]["serve"]
    fleet = extra_requirements("fleet")
    assert not any(r.lower().startswith("kvbridge") for r in fleet)
    assert {"pyzmq", "starlette", "uvicorn", "vllm-router"} == {canonicalize_name(Requirement(r).name) for r in fleet}
    message = for_missing_module(ModuleNotFoundError("No module named 'zmq'", name="zmq"), "serve")
    assert "cache-server extra" in message and "-m pip install 'pyzmq>=" in message and "kvbridge[" not in message
    assert for_missing_module(ModuleNotFoundError("No module named 'nope'", name="nope"), "serve") == ""


WHEELHOUSE = WORK_DIR / "build" / "wheelhouse"


def network_cut() -> list[str]:
    """`unshare -n` (a network namespace with no interface up) where this user may make one, else nothing."""
    try:
        done = subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=30)
    except FileNotFoundError:
        return []
    return ["unshare", "-n"] if done.returncode == 0 else []


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from this checkout, installed into a new venv from build/wheelhouse/ only, with the
    network cut where `unshare -n` is permitted; (venv's bin, a work folder, env)."""
    if not (WHEELHOUSE / "FILLED_FROM").is_file():
        pytest.skip("build/wheelhouse/ is not filled: run scripts/wheelhouse.sh (scripts/setup.sh --test runs it)")
    tmp = tmp_path_factory.mktemp("wheel")
    wheels, venv, work = tmp / "wheels", tmp / "venv", tmp / "work"
    work.mkdir()
    offline = [*network_cut()]
    from_wheelhouse = ["--quiet", "--disable-pip-version-check", "--no-index", "--find-links", str(WHEELHOUSE)]
    built = subprocess.run([*offline, sys.executable, "-m", "pip", "wheel", *from_wheelhouse, "--no-deps",
                            "-w", str(wheels), str(WORK_DIR)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("kvbridge-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run([*offline, str(venv / "bin" / "python"), "-m", "pip", "install", *from_wheelhouse,
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


def test_the_wheel_installs_the_pinned_base_and_its_licence(installed):
    """The range resolved to the pins the wheelhouse holds; the metadata says the licence as SPDX."""
    code = ("import json; from importlib import metadata as m; d = m.distribution('kvbridge'); "
            "print(json.dumps({'numpy': m.version('numpy'), 'licence': d.metadata['License-Expression'], "
            "'urls': d.metadata.get_all('Project-URL'), 'files': [str(f) for f in d.files if 'LICENSE' in str(f)]}))")
    done = run_in(installed, "python", "-c", code)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["numpy"] == pins(WORK_DIR / "requirements.txt")["numpy"]
    assert seen["licence"] == PYPROJECT["project"]["license"] == "Apache-2.0" and seen["files"]
    assert {url.split(",")[0] for url in seen["urls"]} == set(PYPROJECT["project"]["urls"])


NEEDS_AN_EXTRA = [name for name, needs in COMMAND_EXTRAS.items() if needs.extras or needs.engine]


def test_every_command_without_its_extra_says_which_and_how_to_install_it(installed):
    """The base install only (the default engines run llama.cpp in-process, so they need llama too): each
    command exits non-zero before anything else, naming its extras and a pip line for their requirements."""
    bin_dir, work, env = installed
    runs = {name: subprocess.Popen([str(bin_dir / "kvbridge"), name], cwd=work, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
            for name in NEEDS_AN_EXTRA}
    for name, process in runs.items():
        out, err = process.communicate(timeout=120)
        needs = COMMAND_EXTRAS[name]
        extras = [*needs.extras, *(("llama",) if needs.engine else ())]
        assert process.returncode != 0 and "Traceback" not in err, (name, err)
        assert f"`kvbridge {name}` needs KVBridge's" in err and all(e in err for e in extras), (name, err)
        line = next(text for text in err.splitlines() if " -m pip install " in text)
        asked = {canonicalize_name(r.name): r.specifier
                 for r in map(Requirement, shlex.split(line.partition(" -m pip install ")[2]))}
        assert asked == {canonicalize_name(r.name): r.specifier
                         for r in map(Requirement, extra_requirements(*extras))}, (name, line)
        assert "kvbridge[" not in err, (name, err)
