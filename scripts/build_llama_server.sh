#!/usr/bin/env bash
# Build llama-server from the llama.cpp source vendored in the pinned llama-cpp-python sdist,
# so the server and the in-process binding share one llama.cpp version (and one KV layout), with
# the instruction-set flags setup.sh chose and recorded for llama-cpp-python (.venv/kvbridge-build.json).
# Result: .llama-server/<version>/bin/llama-server (git-ignored). Idempotent; rebuilds when the flags change.
# Usage: scripts/build_llama_server.sh [--force]
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

force=0
for arg in "$@"; do
    case "$arg" in
        --force) force=1 ;;
        -h|--help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build_llama_server.sh: unknown option '$arg' (use --force or --help)" >&2; exit 2 ;;
    esac
done

version="$(sed -n 's/^llama-cpp-python==\([^[:space:]]*\).*/\1/p' requirements.txt | head -n1)"
if [[ -z "$version" ]]; then
    echo "build_llama_server.sh: no pinned 'llama-cpp-python==VERSION' line in requirements.txt" >&2
    exit 1
fi

python="$REPO_ROOT/.venv/bin/python"
if [[ ! -x "$python" ]]; then
    echo "build_llama_server.sh: no .venv; run ./scripts/setup.sh first (it chooses the instruction set both engines use)" >&2
    exit 1
fi
variants=("$python" "$REPO_ROOT/scripts/build_variants.py" --tag build_llama_server)

# The recorded variant and its cmake flags, one per line: "variant=NAME" then the flags.
recorded="$("${variants[@]}" server-args)" || exit 1
mapfile -t cmake_flags <<<"$recorded"
variant="${cmake_flags[0]#variant=}"
cmake_flags=("${cmake_flags[@]:1}")

install_dir="$REPO_ROOT/.llama-server/$version"
binary="$install_dir/bin/llama-server"
flags_file="$install_dir/cmake-flags.txt"   # the build's variant and flags, as server-args printed them
patches_file="$install_dir/patches.txt"     # the patch set the binary was built with (its stamp)

# KVBridge's patches to llama.cpp (patches/llama.cpp/*.patch, each says what it changes and why),
# applied in name order to a copy of the source. Their digest joins the build stamp and the build's
# commit (so /props' build_info, part of every namespace, names the patched build).
patch_files=("$REPO_ROOT"/patches/llama.cpp/*.patch)
[[ -e "${patch_files[0]}" ]] || patch_files=()
patch_id="$(cat /dev/null "${patch_files[@]}" | sha256sum | cut -c1-8)"
patches_stamp="patches=$patch_id $(for f in "${patch_files[@]}"; do printf '%s ' "$(basename "$f")"; done)"

if [[ $force -eq 0 && -x "$binary" ]] && "$binary" --version >"$install_dir/version.txt" 2>&1; then
    if [[ "$(cat "$flags_file" 2>/dev/null || true)" == "$recorded" \
          && "$(cat "$patches_file" 2>/dev/null || true)" == "$patches_stamp" ]]; then
        echo "llama-server $version already built as '$variant' with patches $patch_id: $binary"
        exit 0
    fi
    echo "llama-server $version was built with other flags than llama-cpp-python's '$variant' build, or other patches; rebuilding"
fi

for tool in cmake g++; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "build_llama_server.sh: '$tool' is missing; on Debian run: apt-get install -y cmake g++" >&2
        exit 1
    fi
done
if ! command -v patch >/dev/null 2>&1; then   # applies patches/llama.cpp
    if [[ "$(id -u)" -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "installing Debian's patch (it applies patches/llama.cpp)…"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends patch >/dev/null
    else
        echo "build_llama_server.sh: 'patch' is missing (it applies patches/llama.cpp); on Debian run: apt-get install -y patch" >&2
        exit 1
    fi
fi

work_dir="$(mktemp -d "${TMPDIR:-/tmp}/kvb-llama-server.XXXXXX")"
trap 'rm -rf "$work_dir"' EXIT

# The logs stay in build/logs (git-ignored) after the temporary work folder is gone.
log_dir="$REPO_ROOT/build/logs"
mkdir -p "$log_dir"
configure_log="$log_dir/llama-server-configure.log"
build_log="$log_dir/llama-server-build.log"
echo "building llama-server $version as '$variant' (${cmake_flags[*]}), about 5 minutes on 2 cores (longer when the CPUs are busy); its logs: build/logs/llama-server-configure.log, build/logs/llama-server-build.log…"
start_s=$SECONDS

# The pinned sdist, downloaded once and unpacked under build/ (git-ignored), is never modified:
# the patches go to a copy, so llama-cpp-python's builds from the same sdist stay upstream's.
pristine_dir="$("${variants[@]}" source)" || exit 1
upstream_number="$(git -C "$pristine_dir" rev-list --count HEAD 2>/dev/null || echo 0)"
upstream_commit="$(git -C "$pristine_dir" rev-parse --short HEAD 2>/dev/null || echo unknown)"
source_dir="$work_dir/llama.cpp"
cp -a "$pristine_dir" "$source_dir"
rm -f "$source_dir/.git"   # a link into the sdist's git metadata; the build's commit is passed below
for patch_file in "${patch_files[@]}"; do
    if ! patch -d "$source_dir" -p1 --forward --batch --dry-run --quiet <"$patch_file" >/dev/null; then
        echo "build_llama_server.sh: $(basename "$patch_file") does not apply to llama.cpp $upstream_commit;" \
             "update it for this llama-cpp-python version (patches/llama.cpp/)" >&2
        exit 1
    fi
    patch -d "$source_dir" -p1 --forward --batch --quiet <"$patch_file"
    # verify: every line the patch adds is now in the source
    while IFS= read -r added; do
        file="$(sed -n 's|^+++ b/\([^[:space:]]*\).*|\1|p' "$patch_file" | head -n1)"
        if ! grep -qF -- "$added" "$source_dir/$file"; then
            echo "build_llama_server.sh: $(basename "$patch_file") applied but '$added' is not in $file" >&2
            exit 1
        fi
    done < <(sed -n 's/^+\([^+].*KVBridge.*\)$/\1/p' "$patch_file")
    echo "applied $(basename "$patch_file")"
done
build_commit="$upstream_commit"
if [[ ${#patch_files[@]} -gt 0 ]]; then
    build_commit="$upstream_commit.kvb-$patch_id"
fi

generator=()
if command -v ninja >/dev/null 2>&1; then
    generator=(-G Ninja)
fi

# Static libraries: the binary then runs from any folder without an rpath into the build tree.
# The instruction-set flags come last, exactly those llama-cpp-python was built and smoke-tested
# with, so both engines run the same CPU kernels and greedy output matches token for token.
# LLAMA_USE_PREBUILT_UI=OFF: the web UI would be downloaded from Hugging Face; KVBridge only
# needs the HTTP API.
cmake -S "$source_dir" -B "$work_dir/build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_NUMBER="$upstream_number" \
    -DLLAMA_BUILD_COMMIT="$build_commit" \
    "${cmake_flags[@]}" \
    >"$configure_log" 2>&1 || {
    tail -n 30 "$configure_log" >&2
    echo "build_llama_server.sh: cmake configure failed (its last lines above; full log: build/logs/llama-server-configure.log)" >&2
    exit 1
}

jobs="$("${variants[@]}" jobs)" || exit 1   # KVB_BUILD_JOBS (environment, else .env), else every core
echo "compiling llama-server with $jobs parallel job(s) (KVB_BUILD_JOBS); about 5 minutes on 2 cores…"
# build_variants.py compile: the output into the log, ninja's [N/M] (make's [ NN%]) shown as progress;
# on failure it prints the log's last lines and its path
"$python" "$REPO_ROOT/scripts/build_variants.py" compile --tag build_llama_server --log "$build_log" --label llama-server -- \
    cmake --build "$work_dir/build" --target llama-server -j "$jobs" || exit 1

built="$(find "$work_dir/build" -type f -name llama-server -perm -u+x | head -n1)"
if [[ -z "$built" ]]; then
    echo "build_llama_server.sh: the build finished but no llama-server binary was found" >&2
    exit 1
fi

# A smoke decode before installing: a binary this CPU cannot run never replaces one that runs.
echo "smoke decode of llama-server '$variant' on a loopback port…"
"${variants[@]}" smoke-server "$built" || exit 1

# Install atomically: a half-copied binary must never look like a finished build. The flags file
# is written last, so an interrupted install is rebuilt next time.
mkdir -p "$install_dir/bin"
rm -f "$flags_file" "$patches_file"
cp "$built" "$install_dir/bin/llama-server.tmp"
mv -f "$install_dir/bin/llama-server.tmp" "$binary"
"$binary" --version >"$install_dir/version.txt" 2>&1 || {
    cat "$install_dir/version.txt" >&2
    echo "build_llama_server.sh: the built binary does not run" >&2
    exit 1
}

printf '%s\n' "$patches_stamp" >"$patches_file"
printf '%s\n' "$recorded" >"$flags_file"
echo "llama-server $version built as '$variant' in $((SECONDS - start_s)) s: $binary"
