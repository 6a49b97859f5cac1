#!/usr/bin/env bash
# The wheels tests/test_packaging.py builds and installs KVBridge from, so the suite never reaches a
# package index once set-up has run: pyproject.toml's build-system requires (setuptools, wheel) and the
# base dependencies at the versions requirements.txt pins, with what they depend on, downloaded into
# build/wheelhouse/ (git-ignored). scripts/setup.sh --test runs it (step 6). Idempotent: a stamp holds the
# list it was filled from, and the same list again is a no-op (well under a second).
# Usage: scripts/wheelhouse.sh [--force]
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

PY="$REPO_ROOT/.venv/bin/python"
HOUSE="$REPO_ROOT/build/wheelhouse"
STAMP="$HOUSE/FILLED_FROM"

say() { echo "[wheelhouse] $*"; }
die() { echo "[wheelhouse] ERROR: $*" >&2; exit 1; }

force=0
for arg in "$@"; do
    case "$arg" in
        --force) force=1 ;;
        -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option '$arg' (use --force or --help)" ;;
    esac
done

[[ -x "$PY" ]] || die ".venv is missing; run ./scripts/setup.sh first"

# What to fetch, one requirement a line: the build requires as pyproject.toml states them, and each base
# dependency at requirements.txt's pin (the packaging test's venv gets exactly what the suite tests).
wanted="$("$PY" - <<'PYEOF'
import re, tomllib
from pathlib import Path

project = tomllib.loads(Path("pyproject.toml").read_text())
pins = {}
for line in Path("requirements.txt").read_text().splitlines():
    found = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line.strip())
    if found:
        pins[re.sub(r"[-_.]+", "-", found.group(1)).lower()] = found.group(0)
print("\n".join(project["build-system"]["requires"]))
for line in project["project"]["dependencies"]:
    name = re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.\-]+", line).group(0)).lower()
    print(pins[name])   # tests/test_packaging.py holds that every dependency has a pin
PYEOF
)"

if [[ $force -eq 0 && -f "$STAMP" && "$(cat "$STAMP")" == "$wanted" ]]; then
    say "ready: build/wheelhouse/ holds the packaging test's wheels"
    exit 0
fi

say "downloading the packaging test's wheels into build/wheelhouse/ (once; about 25 MB)"
mkdir -p "$HOUSE"
rm -f "$STAMP"
mapfile -t requirements <<< "$wanted"
"$PY" -m pip download --quiet --disable-pip-version-check --only-binary :all: -d "$HOUSE" "${requirements[@]}" \
    || die "pip could not download the wheels (is the package index reachable?)"
printf '%s\n' "$wanted" > "$STAMP.tmp" && mv "$STAMP.tmp" "$STAMP"
say "ready: $(ls "$HOUSE"/*.whl | wc -l) wheels in build/wheelhouse/"
