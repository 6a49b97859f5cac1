#!/usr/bin/env bash
# Installs what LMCache's real TokenHasher needs, on CPU, without LMCache's CUDA wheel and its
# dependencies: numba into .venv, and the single file lmcache/v1/multiprocess/token_hasher.py from
# the lmcache wheel, extracted into .lmcache-hasher/ (git-ignored) with stand-in package files.
# kvbridge.engine.hashing.make_hasher(prefer_lmcache=True) and tests/test_lmcache_parity.py put that folder
# on sys.path when `import lmcache` does not work on its own. Idempotent: done steps are skipped.
# Usage: scripts/install_lmcache.sh [--force]
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

LMCACHE_VERSION="0.5.6"
NUMBA_VERSION="0.68.1"          # supports numpy 2.3 and Python 3.11; lmcache 0.5.6 pins no numba version
MEMBER="lmcache/v1/multiprocess/token_hasher.py"
TARGET="$REPO_ROOT/.lmcache-hasher"
STAMP="$TARGET/INSTALLED"
PY="$REPO_ROOT/.venv/bin/python"

say() { echo "[install_lmcache] $*"; }
die() { echo "[install_lmcache] ERROR: $*" >&2; exit 1; }

force=0
for arg in "$@"; do
    case "$arg" in
        --force) force=1 ;;
        -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option '$arg' (use --force or --help)" ;;
    esac
done

[[ -x "$PY" ]] || die ".venv is missing; run ./scripts/setup.sh first"

# 1. numba (the file imports numba.njit at module level).
if "$PY" -c "import numba, sys; sys.exit(numba.__version__ != '$NUMBA_VERSION')" 2>/dev/null; then
    say "numba $NUMBA_VERSION already installed"
else
    say "installing numba==$NUMBA_VERSION into .venv for the LMCache hashing parity test (about 30 s, ~50 MB)"
    "$PY" -m pip install --quiet --disable-pip-version-check "numba==$NUMBA_VERSION" \
        || die "pip could not install numba==$NUMBA_VERSION (is PyPI reachable?)"
fi

# 2. token_hasher.py out of the wheel, plus stand-ins for the package files it needs.
if [[ $force -eq 0 && -f "$TARGET/$MEMBER" && "$(cat "$STAMP" 2>/dev/null)" == "lmcache==$LMCACHE_VERSION" ]]; then
    say "lmcache==$LMCACHE_VERSION TokenHasher already in .lmcache-hasher/"
else
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    say "downloading the lmcache==$LMCACHE_VERSION wheel (no dependencies; only one file is kept; a few seconds)"
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary :all: \
        "lmcache==$LMCACHE_VERSION" -d "$work/wheel" \
        || die "pip could not download lmcache==$LMCACHE_VERSION (is PyPI reachable?)"
    wheel="$(ls "$work"/wheel/lmcache-*.whl | head -n 1)"
    staged="$work/stage"
    "$PY" - "$wheel" "$MEMBER" "$staged" <<'PYEOF'
"""Extract one member of the wheel and write the stand-ins it needs to import on CPU."""
import re, sys, zipfile
from pathlib import Path

wheel, member, staged = sys.argv[1], sys.argv[2], Path(sys.argv[3])
with zipfile.ZipFile(wheel) as archive:
    source = archive.read(member).decode("utf-8")
    licences = [n for n in archive.namelist() if re.search(r"\.dist-info/(licenses/)?LICEN[CS]E", n)]
    licence = archive.read(licences[0]).decode("utf-8") if licences else ""

# What this version imports, checked so a new version fails here and not at first use.
imports = set(re.findall(r"^\s*(?:from|import)\s+([\w.]+)", source, re.MULTILINE))
expected = {"typing", "os", "numba", "numpy", "lmcache.logging", "struct", "blake3", "vllm.v1.core"}
unexpected = sorted(imports - expected)
if unexpected:
    sys.exit(f"{member} imports {unexpected}, which this script does not provide; check the new version")

target = staged / member
target.parent.mkdir(parents=True)
target.write_text(source, encoding="utf-8")
note = '"""Stand-in written by scripts/install_lmcache.sh: only TokenHasher is installed, not LMCache."""\n'
for package in ("lmcache", "lmcache/v1", "lmcache/v1/multiprocess"):
    (staged / package / "__init__.py").write_text(note, encoding="utf-8")
(staged / "lmcache" / "logging.py").write_text(
    note + "import logging\n\n\n"
    "def init_logger(name: str) -> logging.Logger:\n"
    "    return logging.getLogger(name)\n",
    encoding="utf-8",
)
if licence:
    (staged / "LICENSE.lmcache").write_text(licence, encoding="utf-8")
PYEOF
    echo "lmcache==$LMCACHE_VERSION" >"$staged/INSTALLED"
    rm -rf "$TARGET"
    mv "$staged" "$TARGET"
    say "extracted $MEMBER into .lmcache-hasher/"
fi

# 3. Prove it: LMCache's TokenHasher and KVBridge's ChunkHasher give the same digests.
"$PY" - <<'PYEOF'
import sys
from kvbridge.engine.hashing import ChunkHasher, LMCacheChunkHasher, load_lmcache_token_hasher

tokens = list(range(1000, 1000 + 4 * 64 + 17))
ours = ChunkHasher(64, "install-check").chunk_hashes(tokens)
theirs = LMCacheChunkHasher(load_lmcache_token_hasher(), 64, "install-check").chunk_hashes(tokens)
if ours != theirs or len(ours) != 4:
    sys.exit("[install_lmcache] ERROR: LMCache's TokenHasher and KVBridge's ChunkHasher disagree")
print(f"[install_lmcache] parity check passed: {len(ours)} chunk hashes identical")
PYEOF
