#!/usr/bin/env bash
# Build llama-server from the llama.cpp source vendored in the pinned llama-cpp-python sdist,
# so the server and the in-process binding share one llama.cpp version (and one KV layout).
# Result: .llama-server/<version>/bin/llama-server (git-ignored). Idempotent.
# Usage: scripts/build_llama_server.sh [--force]
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

force=0
for arg in "$@"; do
    case "$arg" in
        --force) force=1 ;;
        -h|--help) sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build_llama_server.sh: unknown option '$arg' (use --force or --help)" >&2; exit 2 ;;
    esac
done

version="$(sed -n 's/^llama-cpp-python==\([^[:space:]]*\).*/\1/p' requirements.txt | head -n1)"
if [[ -z "$version" ]]; then
    echo "build_llama_server.sh: no pinned 'llama-cpp-python==VERSION' line in requirements.txt" >&2
    exit 1
fi

install_dir="$REPO_ROOT/.llama-server/$version"
binary="$install_dir/bin/llama-server"

if [[ $force -eq 0 && -x "$binary" ]] && "$binary" --version >"$install_dir/version.txt" 2>&1; then
    echo "llama-server $version already built: $binary"
    exit 0
fi

for tool in cmake g++; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "build_llama_server.sh: '$tool' is missing; on Debian run: apt-get install -y cmake g++" >&2
        exit 1
    fi
done

if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then
    python="$REPO_ROOT/.venv/bin/python"
else
    python="$(command -v python3.11 || command -v python3)"
fi

work_dir="$(mktemp -d "${TMPDIR:-/tmp}/kvb-llama-server.XXXXXX")"
trap 'rm -rf "$work_dir"' EXIT

echo "building llama-server $version, about 5 minutes on 2 cores (longer when the CPUs are busy)…"
start_s=$SECONDS

"$python" -m pip download --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==$version" -d "$work_dir/sdist"
sdist="$(ls "$work_dir"/sdist/llama_cpp_python-*.tar.gz 2>/dev/null | head -n1 || true)"
if [[ -z "$sdist" ]]; then
    echo "build_llama_server.sh: pip did not produce a llama-cpp-python $version sdist" >&2
    exit 1
fi
tar -xzf "$sdist" -C "$work_dir"
source_dir="$(ls -d "$work_dir"/llama_cpp_python-*/vendor/llama.cpp | head -n1)"

generator=()
if command -v ninja >/dev/null 2>&1; then
    generator=(-G Ninja)
fi

# Static libraries: the binary then runs from any folder without an rpath into the build tree.
# GGML_NATIVE stays at its default (ON), as in llama-cpp-python's own build, so both engines run
# the same CPU kernels and greedy output matches token for token. LLAMA_USE_PREBUILT_UI=OFF:
# the web UI would be downloaded from Hugging Face; KVBridge only needs the HTTP API.
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
    >"$work_dir/cmake-configure.log" 2>&1 || {
    tail -n 30 "$work_dir/cmake-configure.log" >&2
    echo "build_llama_server.sh: cmake configure failed (log above)" >&2
    exit 1
}

cmake --build "$work_dir/build" --target llama-server -j "${KVB_BUILD_JOBS:-2}" \
    >"$work_dir/cmake-build.log" 2>&1 || {
    tail -n 40 "$work_dir/cmake-build.log" >&2
    echo "build_llama_server.sh: build failed (log above)" >&2
    exit 1
}

built="$(find "$work_dir/build" -type f -name llama-server -perm -u+x | head -n1)"
if [[ -z "$built" ]]; then
    echo "build_llama_server.sh: the build finished but no llama-server binary was found" >&2
    exit 1
fi

# Install atomically: a half-copied binary must never look like a finished build.
mkdir -p "$install_dir/bin"
cp "$built" "$install_dir/bin/llama-server.tmp"
mv -f "$install_dir/bin/llama-server.tmp" "$binary"
"$binary" --version >"$install_dir/version.txt" 2>&1 || {
    cat "$install_dir/version.txt" >&2
    echo "build_llama_server.sh: the built binary does not run" >&2
    exit 1
}

echo "llama-server $version built in $((SECONDS - start_s)) s: $binary"
