#!/usr/bin/env python3
"""Which instruction set llama.cpp is built with, for both engines, and proof that it runs here.

The problem: a CPU may advertise instructions (AMX on some cloud VMs) that its hypervisor will
not execute, so a build that uses them dies at its first decode. The answer is a ladder of build
variants, fastest first and safest last; each is built, then vetted by a smoke decode in a child
process (kvbridge/backends/smoke_decode.py), and the first one that runs is kept:

    claimed  GGML_NATIVE=OFF, every extension ggml uses that /proc/cpuinfo claims, AMX included
    no-amx   the same, AMX off
    avx2     AVX/AVX2/FMA/F16C only: AVX-512 and AMX off

A rung equal to an earlier one is dropped (without AMX, claimed is no-amx). The first rung spells
the flags out instead of GGML_NATIVE=ON (-march=native): it compiles the same kernels, AMX
included, and prefilled 7% faster here (Docs/Research.md, "Build variants"). GGML_NATIVE=ON is the
only rung off x86, and a KVB_LLAMA_CMAKE_ARGS away on x86.

KVB_LLAMA_CMAKE_ARGS (environment, else .env) replaces the ladder with exactly those flags.
The choice is recorded in .venv/kvbridge-build.json; scripts/build_llama_server.sh reads it and
builds llama-server with the same flags, so both engines run the same kernels and their greedy
outputs match. The record's stamp covers requirements.txt and the requested flags: a change of
either rebuilds.

Deliberately left out: a failed compile does not step down the ladder (a missing compiler or
network breaks every rung alike).

Commands (stdlib only; setup.sh runs them with .venv's python):
    check                 exit 0 when the recorded build is current, else say why and exit 1
    install               build llama-cpp-python down the ladder, smoke each build, record the winner
    server-args           the recorded cmake flags, one per line (for build_llama_server.sh)
    smoke-server BINARY   smoke-test a llama-server binary with the recorded variant's name
    source                fetch the pinned sdist into build/ and print its vendored llama.cpp folder
    jobs                  parallel compile jobs for every build: KVB_BUILD_JOBS (environment, else .env),
                          else every core
    compile --log FILE --label TEXT -- COMMAND...
                          run a build command with its output into FILE, showing the compile's own
                          progress (build_llama_server.sh's cmake --build); on failure the log's tail

Every compile writes its whole output to a log (its path said before it starts) and shows the
progress the build itself prints: ninja's "[N/M]" steps or make's "[ NN%]", through
kvbridge/settings/progress.py (loaded by path: a bar on a terminal, a line per tenth in a log).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SMOKE_SCRIPT = REPO_ROOT / "kvbridge" / "backends" / "smoke_decode.py"   # run by path: it imports no kvbridge
DEFAULT_MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_RECORD = REPO_ROOT / ".venv" / "kvbridge-build.json"
RECORD_FORMAT = "kvbridge-build v1"
CMAKE_ARGS_VAR = "KVB_LLAMA_CMAKE_ARGS"
JOBS_VAR = "KVB_BUILD_JOBS"
CUSTOM = "custom"  # the variant name of flags the user chose
EXIT_DOES_NOT_RUN, EXIT_ENVIRONMENT = 1, 3  # smoke_decode.py's exit codes


def _load_progress():
    """kvbridge/settings/progress.py, by path: stdlib only, so this script needs no installed kvbridge."""
    spec = importlib.util.spec_from_file_location("kvbridge_build_progress",
                                                  REPO_ROOT / "kvbridge" / "settings" / "progress.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


progress = _load_progress()


class BuildError(RuntimeError):
    """Something the user must act on; the message is written for a person."""


def say(message: str, tag: str = "setup") -> None:
    print(f"[{tag}] {message}", flush=True)


# ---------------------------------------------------------------------------------------------
# the ladder


@dataclass(frozen=True)
class Variant:
    name: str
    cmake_args: tuple[str, ...]
    about: str

    @property
    def cmake_args_text(self) -> str:
        return shlex.join(self.cmake_args)


AMX = (("amx_tile", "GGML_AMX_TILE"), ("amx_int8", "GGML_AMX_INT8"), ("amx_bf16", "GGML_AMX_BF16"))
AVX512_EXTRAS = (("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"),
                 ("avx512_bf16", "GGML_AVX512_BF16"))
# GGML_AVX512 compiles with -mavx512f/cd/vl/dq/bw (ggml-cpu/CMakeLists.txt): all five or none
AVX512_BASE = {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The instruction-set flags the CPU claims (first 'flags' line), empty where unknown."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def explicit_x86(flags: set[str], extensions: bool, amx: bool) -> tuple[str, ...]:
    """GGML_NATIVE=OFF with every x86 option spelled out: ON where the CPU claims it (and, for
    AVX-VNNI and AVX-512, where extensions are wanted; for AMX, where amx), OFF otherwise."""
    def on(option: str, wanted: bool) -> str:
        return f"-D{option}={'ON' if wanted else 'OFF'}"

    use_avx512 = extensions and AVX512_BASE <= flags
    args = ["-DGGML_NATIVE=OFF", on("GGML_SSE42", "sse4_2" in flags), on("GGML_AVX", "avx" in flags),
            on("GGML_AVX2", "avx2" in flags), on("GGML_FMA", "fma" in flags), on("GGML_F16C", "f16c" in flags),
            on("GGML_BMI2", "bmi2" in flags), on("GGML_AVX_VNNI", extensions and "avx_vnni" in flags),
            on("GGML_AVX512", use_avx512)]
    args += [on(option, use_avx512 and flag in flags) for flag, option in AVX512_EXTRAS]
    # ggml's AMX kernels are built on AVX512-VNNI (ggml-cpu/amx): no AVX-512, no AMX
    args += [on(option, amx and use_avx512 and flag in flags) for flag, option in AMX]
    return tuple(args)


# the avx2 rung asks for these whatever /proc/cpuinfo says: it is the floor, and a CPU without
# them needs KVB_LLAMA_CMAKE_ARGS anyway (the error message says so)
AVX2_FLOOR = {"sse4_2", "avx", "avx2", "fma", "f16c"}


NATIVE = Variant("native", ("-DGGML_NATIVE=ON",), "-march=native, every instruction the CPU claims")


def build_ladder(flags: set[str], machine: str) -> list[Variant]:
    """Fastest first, safest last; a rung whose flags equal an earlier one's is dropped."""
    if machine.lower() not in ("x86_64", "amd64"):
        return [NATIVE]
    ladder = [Variant("claimed", explicit_x86(flags, extensions=True, amx=True),
                      "every extension the CPU claims, AMX included"),
              Variant("no-amx", explicit_x86(flags, extensions=True, amx=False), "the claimed AVX/AVX-512 set, AMX off"),
              Variant("avx2", explicit_x86(AVX2_FLOOR | (flags & {"bmi2"}), extensions=False, amx=False),
                      "AVX2/FMA/F16C only, AVX-512 and AMX off")]
    unique: list[Variant] = []
    for variant in ladder:
        if all(variant.cmake_args != kept.cmake_args for kept in unique):
            unique.append(variant)
    return unique


# ---------------------------------------------------------------------------------------------
# what was asked for: KVB_LLAMA_CMAKE_ARGS from the environment or .env, else the ladder


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a .env file, never executed: comments, blank lines, 'export ' and one
    level of matching quotes are handled; a later line wins, as in python-dotenv."""
    values: dict[str, str] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return values
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        key = key.removeprefix("export ").strip()
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif " #" in value:
            value = value.split(" #", 1)[0].rstrip()
        values[key] = value
    return values


def requested_cmake_args(environ: Mapping[str, str], env_file: Path) -> str | None:
    """The user's flags, or None for the ladder. The environment wins over .env even when empty
    (as for every KVB_ setting); an empty value means the default, the ladder."""
    raw = environ[CMAKE_ARGS_VAR] if CMAKE_ARGS_VAR in environ else read_env_file(env_file).get(CMAKE_ARGS_VAR, "")
    return raw.strip() or None


def plan(environ: Mapping[str, str], env_file: Path, flags: set[str], machine: str) -> list[Variant]:
    """The variants to try, in order: the user's flags alone, or the ladder."""
    user_args = requested_cmake_args(environ, env_file)
    if user_args is None:
        return build_ladder(flags, machine)
    try:
        args = tuple(shlex.split(user_args))
    except ValueError as error:
        raise BuildError(f"{CMAKE_ARGS_VAR}={user_args!r} cannot be split into arguments ({error}); "
                         f"quote as in a shell command line") from None
    return [Variant(CUSTOM, args, f"{CMAKE_ARGS_VAR} ({user_args})")]


def pinned_version(requirements: Path) -> str:
    for line in requirements.read_text().splitlines():
        if line.startswith("llama-cpp-python=="):
            return line.split("==", 1)[1].split()[0]
    raise BuildError(f"no pinned 'llama-cpp-python==VERSION' line in {requirements}")


def stamp_parts(requirements: Path, variants: list[Variant]) -> dict[str, str]:
    """What decides a rebuild: the requirements and the requested flags (user's or the ladder's).
    pyproject.toml is not part of it: its pins are requirements.txt's (tests/test_packaging.py), so a change
    there reinstalls only the checkout itself (scripts/setup.sh step 2b), never the 5-minute compile."""
    requested = json.dumps([[v.name, *v.cmake_args] for v in variants])
    return {"requirements_sha256": hashlib.sha256(requirements.read_bytes()).hexdigest(),
            "requested_sha256": hashlib.sha256(requested.encode()).hexdigest()}


def build_jobs(environ: Mapping[str, str], env_file: Path) -> int:
    """Parallel compile jobs: KVB_BUILD_JOBS (environment, else .env), else every core. Every compile
    (llama-cpp-python's here, llama-server's in build_llama_server.sh) uses this number."""
    raw = (environ[JOBS_VAR] if JOBS_VAR in environ else read_env_file(env_file).get(JOBS_VAR, "")).strip()
    if not raw:
        return os.cpu_count() or 1
    if not raw.isdigit() or int(raw) < 1:
        raise BuildError(f"{JOBS_VAR}={raw!r} is not a number of parallel compile jobs; use a whole number "
                         f"of 1 or more, or leave it empty for every core ({os.cpu_count() or 1} here)")
    return int(raw)


# ---------------------------------------------------------------------------------------------
# the record: magic, format version and checksum; anything that does not match means "rebuild"


def record_checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_record(path: Path, body: dict) -> None:
    body = {"format": RECORD_FORMAT, **body}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({**body, "checksum": record_checksum(body)}, indent=2) + "\n")
    partial.replace(path)


def read_record(path: Path) -> dict | None:
    """The record, or None when missing, unreadable, of another format or failing its checksum."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
        return None
    checksum = data.pop("checksum", None)
    return data if checksum == record_checksum(data) else None


def why_rebuild(record: dict | None, parts: dict[str, str]) -> str | None:
    """None when the recorded build is current, else the reason in words."""
    if record is None:
        return "no valid build record (first install, or the stamp format changed)"
    if record.get("requirements_sha256") != parts["requirements_sha256"]:
        return "requirements.txt changed since the last install"
    if record.get("requested_sha256") != parts["requested_sha256"]:
        return f"the requested build flags changed ({CMAKE_ARGS_VAR}, or the ladder for this CPU)"
    return None


# ---------------------------------------------------------------------------------------------
# building and smoke-testing


def pip_build_commands(python: str, version: str) -> list[list[str]]:
    """Build llama-cpp-python from source with $CMAKE_ARGS. --no-cache-dir: pip's wheel cache keys
    on the sdist, not on CMAKE_ARGS, so it would hand back a build made with other flags.
    --no-deps keeps --force-reinstall to this one package; the second call adds its dependencies.
    --verbose puts cmake's own output (the flags it compiled with) into the build log."""
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    return [pip + ["--verbose", "--no-cache-dir", "--force-reinstall", "--no-deps", "--no-binary", "llama-cpp-python",
                   f"llama-cpp-python=={version}"],
            pip + ["--quiet", f"llama-cpp-python=={version}"]]


def shown_path(path: Path) -> str:
    """The path as a person reads it: relative to the current directory when inside it."""
    try:
        return str(path.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def run_logged(step: list[str] | str, out, env: Mapping[str, str], bar) -> int:
    """Run one build command (argv, or a shell line in tests) with its output into `out`; each line that is
    a compile step (ninja's [N/M], make's [ NN%]) advances `bar`. Returns the exit status."""
    process = subprocess.Popen(step, shell=isinstance(step, str), env=dict(env), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, errors="replace")
    try:
        for line in process.stdout:
            out.write(line)
            if found := progress.build_step(line):
                done, total, bar.unit = found
                bar.update(done, total)
            elif bar.done == 0 and (milestone := progress.build_milestone(line)):
                print(f"{bar.label}: {milestone}…", flush=True)   # before the first step, so no bar to break
    finally:
        returncode = process.wait()
        out.flush()
        bar.finish()
    return returncode


def log_tail(log: Path, lines: int) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def run_build(variant: Variant, commands: list[list[str]] | str, log: Path, jobs: int, tag: str = "setup") -> None:
    """Run the build step (argv lists, or one shell command in tests) with CMAKE_ARGS and `jobs` parallel compiles."""
    env = {**os.environ, "CMAKE_ARGS": variant.cmake_args_text, "FORCE_CMAKE": "1", "KVB_BUILD_VARIANT": variant.name,
           "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        steps = [commands] if isinstance(commands, str) else commands
        for step in steps:
            out.write(f"$ CMAKE_ARGS={shlex.quote(env['CMAKE_ARGS'])} {step if isinstance(step, str) else shlex.join(step)}\n")
            out.flush()
            bar = progress.Progress(f"[{tag}] compiling llama-cpp-python '{variant.name}'")
            if run_logged(step, out, env, bar) != 0:
                raise BuildError(f"building llama-cpp-python as '{variant.name}' failed (full log: {log}):\n"
                                 f"{log_tail(log, 25)}")


def compile_main(argv: list[str]) -> int:
    """`compile --log FILE --label TEXT -- COMMAND...`: a build command, logged, with its progress shown."""
    parser = argparse.ArgumentParser(prog="build_variants.py compile")
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--label", required=True, help="what is compiled, e.g. llama-server")
    parser.add_argument("--tag", default="setup", help="prefix of the progress lines")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("compile needs a command after --")
    args.log.parent.mkdir(parents=True, exist_ok=True)
    with args.log.open("w") as out:
        out.write(f"$ {shlex.join(command)}\n")
        out.flush()
        returncode = run_logged(command, out, os.environ, progress.Progress(f"[{args.tag}] compiling {args.label}"))
    if returncode != 0:
        print(f"{log_tail(args.log, 40)}\n[{args.tag}] ERROR: compiling {args.label} failed "
              f"(exit {returncode}; full log: {shown_path(args.log)})", file=sys.stderr)
        return 1
    return 0


@dataclass(frozen=True)
class SmokeOutcome:
    ok: bool
    detail: str          # "runs" or how it failed, e.g. "crashed (SIGILL)"
    result: dict | None  # the smoke script's JSON line when ok


def run_smoke(argv: list[str], timeout: float) -> SmokeOutcome:
    """Run smoke_decode.py as a child and read its fate; an environment problem raises BuildError."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return SmokeOutcome(False, f"hung (no result within {timeout:.0f} s)", None)
    last = (done.stderr.strip().splitlines() or [""])[-1]
    if done.returncode < 0:
        return SmokeOutcome(False, f"crashed ({signal.Signals(-done.returncode).name})", None)
    if done.returncode == EXIT_ENVIRONMENT:
        raise BuildError(f"the smoke decode cannot run: {last} (not an instruction-set problem; "
                         f"run ./scripts/setup.sh, or check the model file)")
    if done.returncode != 0:
        detail = "\n".join(done.stderr.strip().splitlines()[-4:]) if done.returncode == EXIT_DOES_NOT_RUN else last
        return SmokeOutcome(False, f"failed (exit {done.returncode}: {detail})", None)
    return SmokeOutcome(True, "runs", json.loads(done.stdout.strip().splitlines()[-1]))


def smoke_llama_argv(python: str, model: Path, variant: str) -> list[str]:
    return [python, str(SMOKE_SCRIPT), "llama", "--model", str(model), "--variant", variant]


def install(variants: list[Variant], build_step, python: str, model: Path, record: Path,
            parts: dict[str, str], version: str, smoke_timeout: float, log_dir: Path, tag: str = "setup",
            jobs: int = 1) -> dict:
    """Down the ladder: build, smoke, keep the first that runs; write the record and return it."""
    # the installed library is about to change: an old record must not vouch for it (nor tell
    # build_llama_server.sh its flags) until a build has passed its smoke decode
    record.unlink(missing_ok=True)
    tried: list[dict] = []
    for index, variant in enumerate(variants):
        log = log_dir / f"llama-cpp-python-{variant.name}.log"
        if tried:
            say(f"rebuilding llama-cpp-python as '{variant.name}' ({variant.about}); its log: {shown_path(log)}…", tag)
        else:
            say(f"building llama-cpp-python {version} as '{variant.name}' ({variant.about}); "
                f"it compiles from source with {jobs} parallel job(s) ({JOBS_VAR}), about 5 minutes on 2 cores; "
                f"its log: {shown_path(log)}…", tag)
        run_build(variant, build_step(variant), log, jobs, tag)
        say(f"smoke decode of build '{variant.name}' in a child process…", tag)
        outcome = run_smoke(smoke_llama_argv(python, model, variant.name), smoke_timeout)
        tried.append({"variant": variant.name, "cmake_args": variant.cmake_args_text, "smoke": outcome.detail})
        if outcome.ok:
            say(f"build '{variant.name}' runs here (greedy text {outcome.result['text']!r})", tag)
            body = {"variant": variant.name, "cmake_args": list(variant.cmake_args), "about": variant.about,
                    "llama_cpp_python": version, **parts, "smoke": outcome.result, "tried": tried,
                    "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
            write_record(record, body)
            return body
        if variant.name == CUSTOM:
            raise BuildError(f"llama-cpp-python built with {CMAKE_ARGS_VAR}='{variant.cmake_args_text}' does not "
                             f"run on this machine: its smoke decode {outcome.detail}. Change or empty "
                             f"{CMAKE_ARGS_VAR} (environment or .env) and run ./scripts/setup.sh again.")
        if index + 1 < len(variants):
            say(f"smoke decode of build '{variant.name}' {outcome.detail}; this CPU does not run what it claims. "
                f"Stepping down to '{variants[index + 1].name}' ({variants[index + 1].about})…", tag)
    lines = "\n".join(f"  {t['variant']:8} {t['smoke']:30} {t['cmake_args']}" for t in tried)
    raise BuildError(f"no build variant of llama-cpp-python runs on this machine:\n{lines}\n"
                     f"Set {CMAKE_ARGS_VAR} (environment or .env) to flags for this CPU, e.g. "
                     f"'-DGGML_NATIVE=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF', "
                     f"and run ./scripts/setup.sh again.")


# ---------------------------------------------------------------------------------------------
# the vendored llama.cpp source (for llama-server and the variant benchmark)


def fetch_source(python: str, version: str, build_dir: Path) -> Path:
    """Download and unpack the pinned sdist once into build/; return its vendor/llama.cpp."""
    target = build_dir / f"llama-cpp-python-{version}"
    source = target / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (target / ".complete").is_file() and source.is_dir():
        return source
    build_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build_dir) as tmp:
        # pip's own lines (and its bar on a terminal) go to stderr: this command's stdout is the folder's path
        print(f"downloading the llama-cpp-python {version} source (about 80 MB) into {shown_path(build_dir)}…",
              file=sys.stderr, flush=True)
        pip_progress = [] if sys.stderr.isatty() else ["--progress-bar", "off"]
        subprocess.run([python, "-m", "pip", "download", "--disable-pip-version-check", *pip_progress, "--no-deps",
                        "--no-binary", ":all:", f"llama-cpp-python=={version}", "-d", tmp], check=True,
                       stdout=sys.stderr)
        sdists = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            raise BuildError(f"pip did not produce a llama-cpp-python {version} sdist")
        unpacked = Path(tmp) / "unpacked"
        with tarfile.open(sdists[0]) as archive:
            archive.extractall(unpacked, filter="data")
        if target.exists():
            shutil.rmtree(target)
        unpacked.replace(target)
    (target / ".complete").write_text(version + "\n")
    return source


def server_does_not_run(record: dict, variants: list[Variant], detail: str) -> str:
    """The message when llama-server fails with the flags llama-cpp-python runs with.

    The server does not step down on its own: both engines must share one instruction set, and
    that choice is setup.sh's (it rebuilds llama-cpp-python too). The message names the next rung."""
    message = (f"llama-server built as '{record['variant']}' ({shlex.join(record['cmake_args'])}) does not run "
               f"here: its smoke decode {detail}. llama-cpp-python runs with the same flags.")
    names = [v.name for v in variants]
    if record["variant"] in names and names.index(record["variant"]) + 1 < len(variants):
        lower = variants[names.index(record["variant"]) + 1]
        message += (f" To move both engines to '{lower.name}': {CMAKE_ARGS_VAR}='{lower.cmake_args_text}' "
                    f"./scripts/setup.sh && ./scripts/build_llama_server.sh")
    return message


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compile"]:
        return compile_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("check", "install", "server-args", "smoke-server", "source", "plan", "jobs",
                                            "compile"))
    parser.add_argument("binary", nargs="?", help="smoke-server: the llama-server binary")
    parser.add_argument("--python", default=sys.executable, help="the interpreter to build for and smoke with")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--record", type=Path, default=DEFAULT_RECORD)
    parser.add_argument("--env-file", type=Path, default=REPO_ROOT / ".env")
    parser.add_argument("--requirements", type=Path, default=REPO_ROOT / "requirements.txt")
    parser.add_argument("--build-command", help="tests: a shell command replacing the pip build "
                        "(it sees CMAKE_ARGS and KVB_BUILD_VARIANT)")
    parser.add_argument("--smoke-timeout", type=float, default=180.0)
    parser.add_argument("--log-dir", type=Path, default=REPO_ROOT / "build" / "logs")
    parser.add_argument("--tag", default="setup", help="prefix of the progress lines")
    parser.add_argument("--cpuinfo", type=Path, default=Path("/proc/cpuinfo"),
                        help="tests: read the CPU's claimed flags from this file instead")
    args = parser.parse_args(argv)

    try:
        variants = plan(os.environ, args.env_file, cpu_flags(args.cpuinfo), platform.machine())
        parts = stamp_parts(args.requirements, variants)
        if args.command == "jobs":
            print(build_jobs(os.environ, args.env_file))
            return 0
        if args.command == "plan":
            for variant in variants:
                print(f"{variant.name:8} {variant.cmake_args_text}")
            return 0
        if args.command == "check":
            reason = why_rebuild(read_record(args.record), parts)
            if reason:
                print(reason)
                return 1
            return 0
        if args.command == "install":
            version = pinned_version(args.requirements)
            build_step = ((lambda variant: args.build_command) if args.build_command
                          else (lambda variant: pip_build_commands(args.python, version)))
            install(variants, build_step, args.python, args.model, args.record, parts, version,
                    args.smoke_timeout, args.log_dir, args.tag, build_jobs(os.environ, args.env_file))
            return 0
        if args.command == "source":
            print(fetch_source(args.python, pinned_version(args.requirements), REPO_ROOT / "build"))
            return 0
        record = read_record(args.record)
        if record is None:
            raise BuildError(f"no valid build record at {args.record}: run ./scripts/setup.sh first "
                             f"(it chooses the instruction set both engines use)")
        if args.command == "server-args":
            print("\n".join([f"variant={record['variant']}", *record["cmake_args"]]))
            return 0
        if not args.binary:
            parser.error("smoke-server needs the llama-server binary")
        outcome = run_smoke([args.python, str(SMOKE_SCRIPT), "server", "--model", str(args.model),
                             "--binary", args.binary, "--variant", record["variant"],
                             "--timeout", str(args.smoke_timeout)], args.smoke_timeout + 30)
        if not outcome.ok:
            raise BuildError(server_does_not_run(record, variants, outcome.detail))
        say(f"llama-server smoke decode: runs (greedy text {outcome.result['text']!r}; "
            f"llama-cpp-python's was {record['smoke']['text']!r})", args.tag)
        return 0
    except BuildError as error:
        print(f"[{args.tag}] ERROR: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
