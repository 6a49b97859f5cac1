"""The llama.cpp build runs on the machine it was built on, whatever its CPU claims (issue 9, section 0).

scripts/build_variants.py walks a ladder of instruction sets (claimed, no-amx, avx2), vetting each
build with a smoke decode in a child process (kvbridge/backends/smoke_decode.py). This machine's CPU runs
every instruction it claims, so the fallback is exercised through the smoke script's test hook
KVB_SMOKE_CRASH_VARIANTS: the named variants' smoke child dies by a real SIGILL. The ladder tests
give the script a Sapphire Rapids /proc/cpuinfo (--cpuinfo), so they walk the issue's ladder:
AMX refused, then AVX-512 refused.

Rebuilding llama-cpp-python takes about 5 minutes per rung on 2 cores, too slow for a test. The
ladder's build step is a command (--build-command), so these tests substitute one that only logs
the CMAKE_ARGS it was given and reuse the installed library; everything else is real: the ladder,
the smoke child, the signal, the record and the stamp.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "scripts" / "build_variants.py"
MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bv = load_script("build_variants")
VERSION = bv.pinned_version(REPO_ROOT / "requirements.txt")
SERVER_BINARY = REPO_ROOT / ".llama-server" / VERSION / "bin" / "llama-server"

needs_llama = pytest.mark.skipif(
    not MODEL.is_file() or importlib.util.find_spec("llama_cpp") is None,
    reason=f"llama_cpp or the embedded model {MODEL} is missing: run ./scripts/setup.sh")

# Sapphire Rapids as a cloud VM reports it (abridged to what the ladder reads)
SPR_FLAGS = set("sse4_2 avx avx2 fma f16c bmi2 avx_vnni avx512f avx512cd avx512vl avx512dq avx512bw "
                "avx512vbmi avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16".split())
HASWELL_FLAGS = set("sse4_2 avx avx2 fma f16c bmi2".split())
ZEN4_FLAGS = set("sse4_2 avx avx2 fma f16c bmi2 avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi "
                 "avx512_vnni avx512_bf16".split())
LADDER = bv.build_ladder(SPR_FLAGS, "x86_64")


@pytest.fixture(autouse=True)
def no_user_build_settings(monkeypatch):
    """The user's own flags or a leftover test hook must not steer these tests."""
    monkeypatch.delenv(bv.CMAKE_ARGS_VAR, raising=False)
    monkeypatch.delenv("KVB_SMOKE_CRASH_VARIANTS", raising=False)


def cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in (bv.CMAKE_ARGS_VAR, "KVB_SMOKE_CRASH_VARIANTS")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout)


def spr_cpuinfo(tmp_path: Path) -> Path:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                       f"flags\t\t: fpu {' '.join(sorted(SPR_FLAGS))}\n")
    return cpuinfo


def fake_install(tmp_path: Path, crash: str = "", env: dict | None = None, env_file: Path | None = None):
    """The real ladder (for a Sapphire Rapids CPU) and smoke child; the build step only logs 'variant|CMAKE_ARGS'."""
    build_log = tmp_path / "builds.txt"
    record = tmp_path / "build.json"
    done = cli("install", "--record", str(record), "--env-file", str(env_file or tmp_path / "none.env"),
               "--cpuinfo", str(spr_cpuinfo(tmp_path)),
               "--log-dir", str(tmp_path / "logs"),
               "--build-command", f'echo "$KVB_BUILD_VARIANT|$CMAKE_ARGS" >> {build_log}',
               env={"KVB_SMOKE_CRASH_VARIANTS": crash, **(env or {})})
    builds = build_log.read_text().splitlines() if build_log.exists() else []
    return done, builds, bv.read_record(record)


# -- the ladder ---------------------------------------------------------------------------------


def test_ladder_for_a_cpu_that_claims_amx():
    ladder = bv.build_ladder(SPR_FLAGS, "x86_64")
    assert [v.name for v in ladder] == ["claimed", "no-amx", "avx2"]
    avx512_set = ("-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                  "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=ON", "-DGGML_AVX512=ON",
                  "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON")
    assert ladder[0].cmake_args == avx512_set + ("-DGGML_AMX_TILE=ON", "-DGGML_AMX_INT8=ON", "-DGGML_AMX_BF16=ON")
    assert ladder[1].cmake_args == avx512_set + ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")
    avx2 = dict(arg.removeprefix("-D").split("=") for arg in ladder[2].cmake_args)
    assert avx2["GGML_NATIVE"] == "OFF" and avx2["GGML_AVX2"] == avx2["GGML_FMA"] == avx2["GGML_F16C"] == "ON"
    assert {k for k, v in avx2.items() if v == "ON"} == {"GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA",
                                                         "GGML_F16C", "GGML_BMI2"}


def test_ladder_drops_rungs_equal_to_an_earlier_one():
    # without AMX the claimed set is the no-amx set; without AVX-512 or AVX-VNNI it is the AVX2 set
    zen4 = bv.build_ladder(ZEN4_FLAGS, "x86_64")
    assert [v.name for v in zen4] == ["claimed", "avx2"] and "-DGGML_AVX512=ON" in zen4[0].cmake_args
    assert [v.name for v in bv.build_ladder(HASWELL_FLAGS, "x86_64")] == ["claimed"]


def test_ladder_off_x86_is_native_only():
    assert bv.build_ladder(set(), "aarch64") == [bv.NATIVE]
    assert bv.NATIVE.cmake_args == ("-DGGML_NATIVE=ON",)


def test_every_ladder_option_exists_in_the_vendored_ggml():
    ggml = (REPO_ROOT / "build" / f"llama-cpp-python-{VERSION}" / f"llama_cpp_python-{VERSION}"
            / "vendor" / "llama.cpp" / "ggml" / "CMakeLists.txt")
    if not ggml.is_file():
        pytest.skip(f"{ggml} not fetched (scripts/build_variants.py source fetches it)")
    options = set(re.findall(r"option\((GGML_\w+)", ggml.read_text()))
    used = {arg.removeprefix("-D").split("=")[0] for v in bv.build_ladder(SPR_FLAGS, "x86_64") for arg in v.cmake_args}
    assert used <= options, f"not options of this ggml: {sorted(used - options)}"


def test_rebuild_bypasses_pips_wheel_cache():
    first, second = bv.pip_build_commands("python", "1.2.3")
    assert {"--no-cache-dir", "--force-reinstall", "--no-deps"} <= set(first) and "llama-cpp-python==1.2.3" in first
    assert "--force-reinstall" not in second  # only fills in the dependencies


# -- what the user asked for, and the stamp -----------------------------------------------------


def test_env_file_is_parsed_not_executed(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("# comment\nexport KVB_A='x y'\nKVB_B=\"q\"\nKVB_C=1 # trailing\nKVB_D=$(touch pwned)\n"
                        "not a line\nKVB_A=later\n")
    assert bv.read_env_file(env_file) == {"KVB_A": "later", "KVB_B": "q", "KVB_C": "1", "KVB_D": "$(touch pwned)"}
    assert not (tmp_path / "pwned").exists()


def test_stamp_follows_cmake_args_from_env_and_env_file(tmp_path):
    env_file = tmp_path / ".env"
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("llama-cpp-python==1.2.3\n")

    def stamp(environ: dict) -> dict:
        return bv.stamp_parts(requirements, bv.plan(environ, env_file, SPR_FLAGS, "x86_64"))

    ladder = stamp({})
    env_file.write_text(f"{bv.CMAKE_ARGS_VAR}=-DGGML_NATIVE=OFF\n")
    from_file = stamp({})
    assert from_file["requested_sha256"] != ladder["requested_sha256"]
    from_env = stamp({bv.CMAKE_ARGS_VAR: "-DGGML_NATIVE=OFF -DGGML_AVX512=OFF"})
    assert from_env["requested_sha256"] not in (ladder["requested_sha256"], from_file["requested_sha256"])
    # the environment wins over .env, even set empty (empty means the default: the ladder)
    assert stamp({bv.CMAKE_ARGS_VAR: ""}) == ladder
    assert bv.plan({bv.CMAKE_ARGS_VAR: "-DGGML_AVX=OFF"}, env_file, SPR_FLAGS, "x86_64")[0].cmake_args == (
        "-DGGML_AVX=OFF",)
    # pyproject.toml beside the requirements never decides a rebuild (setup.sh reinstalls only the checkout)
    before = stamp({})
    requirements.with_name("pyproject.toml").write_text("[project]\nname = 'changed'\n")
    assert stamp({}) == before
    requirements.write_text("llama-cpp-python==1.2.4\n")
    assert stamp({})["requirements_sha256"] != ladder["requirements_sha256"]
    with pytest.raises(bv.BuildError, match=bv.CMAKE_ARGS_VAR):
        stamp({bv.CMAKE_ARGS_VAR: "-DX='unbalanced"})


def test_record_that_does_not_verify_means_rebuild(tmp_path):
    record = tmp_path / "build.json"
    bv.write_record(record, {"variant": "native", "requirements_sha256": "a", "requested_sha256": "b"})
    parts = {"requirements_sha256": "a", "requested_sha256": "b"}
    assert bv.why_rebuild(bv.read_record(record), parts) is None
    assert "requirements.txt changed" in bv.why_rebuild(bv.read_record(record), {**parts, "requirements_sha256": "z"})
    assert "requested build flags" in bv.why_rebuild(bv.read_record(record), {**parts, "requested_sha256": "c"})
    record.write_text(record.read_text().replace('"native"', '"avx2"'))
    assert bv.read_record(record) is None and "no valid build record" in bv.why_rebuild(None, parts)


# -- the real ladder with the real smoke child --------------------------------------------------


@needs_llama
@pytest.mark.live
def test_smoke_decode_of_the_installed_build_passes():
    done = subprocess.run(bv.smoke_llama_argv(sys.executable, MODEL, "native"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["text"].strip() and "libggml-cpu" in result["libggml_cpu"]


@needs_llama
@pytest.mark.live
@pytest.mark.slow
@pytest.mark.parametrize("crash", [1, 2])
def test_ladder_steps_down_past_builds_that_crash(tmp_path, crash):
    crashing = [v.name for v in LADDER[:crash]]
    done, builds, record = fake_install(tmp_path, crash=",".join(crashing))
    assert done.returncode == 0, done.stderr
    chosen = LADDER[crash]
    # each rung was built with its own flags, in ladder order, and stopped at the first that runs
    assert builds == [f"{v.name}|{v.cmake_args_text}" for v in LADDER[:crash + 1]]
    for name in crashing:
        assert f"smoke decode of build '{name}' crashed (SIGILL)" in done.stdout
    assert f"Stepping down to '{chosen.name}'" in done.stdout
    assert record["variant"] == chosen.name and record["cmake_args"] == list(chosen.cmake_args)
    assert [t["smoke"] for t in record["tried"]] == ["crashed (SIGILL)"] * crash + ["runs"]


@needs_llama
@pytest.mark.live
@pytest.mark.slow
def test_every_variant_crashing_is_a_clear_error(tmp_path):
    bv.write_record(tmp_path / "build.json", {"variant": "avx2", "cmake_args": []})  # from an earlier install
    done, builds, record = fake_install(tmp_path, crash=",".join(v.name for v in LADDER))
    assert not (tmp_path / "build.json").exists()
    assert done.returncode == 1 and record is None
    assert len(builds) == len(LADDER)
    assert "no build variant of llama-cpp-python runs on this machine" in done.stderr
    assert bv.CMAKE_ARGS_VAR in done.stderr
    for variant in LADDER:
        assert re.search(rf"{re.escape(variant.name)}\s+crashed \(SIGILL\)", done.stderr)


@needs_llama
@pytest.mark.live
def test_user_flags_replace_the_ladder_and_a_crash_names_them(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text(f"{bv.CMAKE_ARGS_VAR}='-DGGML_NATIVE=OFF -DGGML_AVX512=OFF'\n")
    done, builds, record = fake_install(tmp_path, crash="custom", env_file=env_file)
    assert done.returncode == 1 and record is None
    assert builds == ["custom|-DGGML_NATIVE=OFF -DGGML_AVX512=OFF"]  # no ladder behind the user's flags
    assert f"built with {bv.CMAKE_ARGS_VAR}='-DGGML_NATIVE=OFF -DGGML_AVX512=OFF' does not run" in done.stderr
    assert "crashed (SIGILL)" in done.stderr


@needs_llama
@pytest.mark.live
def test_check_rebuilds_when_the_flags_change(tmp_path):
    env_file = tmp_path / ".env"
    done, _, record = fake_install(tmp_path, env_file=env_file)
    assert done.returncode == 0 and record["variant"] == LADDER[0].name
    check = ("check", "--record", str(tmp_path / "build.json"), "--env-file", str(env_file),
             "--cpuinfo", str(spr_cpuinfo(tmp_path)))
    assert cli(*check).returncode == 0
    env_file.write_text(f"{bv.CMAKE_ARGS_VAR}=-DGGML_NATIVE=OFF\n")
    changed = cli(*check)
    assert changed.returncode == 1 and bv.CMAKE_ARGS_VAR in changed.stdout
    # the environment wins over .env: set empty, it asks for the ladder again, which is what was built
    assert cli(*check, env={bv.CMAKE_ARGS_VAR: ""}).returncode == 0
    assert cli(*check, env={bv.CMAKE_ARGS_VAR: "-DGGML_AVX=OFF"}).returncode == 1
    # another CPU asks for another ladder (a .venv carried to a machine without AMX)
    assert cli(*check[:-1], str(tmp_path / "no-such-cpuinfo"), env={bv.CMAKE_ARGS_VAR: ""}).returncode == 1


# -- llama-server: same flags, own smoke decode -------------------------------------------------


needs_server = pytest.mark.skipif(not SERVER_BINARY.is_file(),
                                  reason=f"{SERVER_BINARY} not built: run ./scripts/build_llama_server.sh")


@needs_llama
@needs_server
@pytest.mark.live
@pytest.mark.parametrize("crash, ok", [("", True), ("native", False)])
def test_server_smoke_decode(tmp_path, crash, ok):
    record = tmp_path / "build.json"
    bv.write_record(record, {"variant": "native", "cmake_args": ["-DGGML_NATIVE=ON"], "smoke": {"text": "x"}})
    done = cli("smoke-server", str(SERVER_BINARY), "--record", str(record), "--tag", "t",
               env={"KVB_SMOKE_CRASH_VARIANTS": crash})
    if ok:
        assert done.returncode == 0, done.stderr
        assert "llama-server smoke decode: runs" in done.stdout
    else:
        assert done.returncode == 1
        assert "llama-server died by SIGILL during the first decode" in done.stderr


@needs_server
def test_both_engines_were_built_with_the_same_flags():
    record = bv.read_record(bv.DEFAULT_RECORD)
    flags_file = SERVER_BINARY.parent.parent / "cmake-flags.txt"
    if record is None or not flags_file.is_file():
        pytest.skip("run ./scripts/setup.sh and ./scripts/build_llama_server.sh first")
    assert flags_file.read_text().splitlines() == [f"variant={record['variant']}", *record["cmake_args"]]


@pytest.mark.parametrize("value, jobs", [("", os.cpu_count() or 1), ("3", 3), (" 1 ", 1)])
def test_build_jobs_come_from_kvb_build_jobs(tmp_path, value, jobs):
    """Every compile (llama-cpp-python's, llama-server's) asks build_variants.py how many jobs: KVB_BUILD_JOBS."""
    assert bv.build_jobs({"KVB_BUILD_JOBS": value}, tmp_path / "none.env") == jobs


def test_build_jobs_from_env_file_and_a_bad_value_names_the_variable(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("KVB_BUILD_JOBS=5\n")
    assert bv.build_jobs({}, env_file) == 5
    with pytest.raises(bv.BuildError, match="KVB_BUILD_JOBS='two'"):
        bv.build_jobs({"KVB_BUILD_JOBS": "two"}, env_file)
    done = subprocess.run([sys.executable, str(SCRIPT), "jobs"],
                          env={**os.environ, "KVB_BUILD_JOBS": "0"}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "KVB_BUILD_JOBS='0'" in done.stderr


def test_the_llama_cpp_python_build_is_given_the_jobs(tmp_path):
    """run_build hands the number to CMake (CMAKE_BUILD_PARALLEL_LEVEL), which scikit-build-core's cmake obeys."""
    log = tmp_path / "build.log"
    bv.run_build(bv.Variant("custom", ("-DX=1",), "test"), 'echo "jobs=$CMAKE_BUILD_PARALLEL_LEVEL"', log, 3)
    assert "jobs=3" in log.read_text()
