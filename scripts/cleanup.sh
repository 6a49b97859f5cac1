#!/usr/bin/env bash
# Remove KVBridge's L2 disk cache, the run results in output/ (never input/, never models/) and the
# shared memory of cache servers that were killed. The L2 directory is KVB_L2_DIR (environment, then
# .env), default ~/.cache/kvbridge/l2. It is removed only when it holds nothing but KVBridge's own
# files, so a mistyped KVB_L2_DIR cannot wipe a folder, and only while no KVBridge process uses it.
# Usage: scripts/cleanup.sh [--dry-run]   (--dry-run only lists what would be removed)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

dry_run=0
for arg in "$@"; do
    case "$arg" in
        -n|--dry-run) dry_run=1 ;;
        -h|--help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "cleanup.sh: unknown option '$arg' (use --dry-run or --help)" >&2; exit 2 ;;
    esac
done

l2_dir="${KVB_L2_DIR:-}"
if [[ -z "$l2_dir" && -f .env ]]; then
    l2_dir="$(sed -n 's/^[[:space:]]*KVB_L2_DIR[[:space:]]*=[[:space:]]*["'\'']\{0,1\}\([^"'\''#]*\).*/\1/p' .env | tail -n1 | sed 's/[[:space:]]*$//')"
fi
l2_dir="${l2_dir:-$HOME/.cache/kvbridge/l2}"
l2_dir="${l2_dir/#\~/$HOME}"

# Ours: every file is an L2 object (*.kvb, kvbridge/store/diskformat.py), a temp file of one (*.tmp)
# or the owner lock (kvbridge/store/disk.py); nothing else. Anything foreign and we leave the whole
# directory alone.
OWNER_LOCK=".kvbridge-owner.lock"
l2_is_ours() {
    local dir="$1" foreign
    [[ -d "$dir" ]] || return 1
    case "$(cd "$dir" && pwd -P)" in
        /|"$HOME"|"$REPO_ROOT"|"$REPO_ROOT/input"|"$REPO_ROOT/models") return 1 ;;
    esac
    foreign="$(find "$dir" ! -type d ! -name '*.kvb' ! -name '*.tmp' ! -name "$OWNER_LOCK" -print -quit)"
    [[ -z "$foreign" ]]
}

# In use: a cache server (exclusive) or an embedded store (shared) holds the owner lock's flock for
# as long as it runs; removing the directory under it would turn its index into misses.
l2_in_use() {
    local lock="$1/$OWNER_LOCK"
    [[ -f "$lock" ]] && command -v flock >/dev/null 2>&1 || return 1
    ! flock --nonblock --exclusive "$lock" true 2>/dev/null
}

targets=()
if [[ -d "$l2_dir" ]]; then
    if ! l2_is_ours "$l2_dir"; then
        echo "cleanup.sh: leaving $l2_dir alone: it holds files that are not KVBridge L2 objects (KVB_L2_DIR)." >&2
    elif l2_in_use "$l2_dir"; then
        echo "cleanup.sh: leaving $l2_dir alone: a running KVBridge process uses it (a cache server, or the GUI" \
             "or CLI with an embedded store). Stop it first (scripts/cache_server.sh stop, scripts/stop.sh)." >&2
    else
        targets+=("$l2_dir")
    fi
fi
while IFS= read -r -d '' entry; do
    targets+=("$entry")
done < <(find "$REPO_ROOT/output" -mindepth 1 -maxdepth 1 ! -name .gitkeep -print0 2>/dev/null)

# Shared memory left in /dev/shm by cache servers that were killed (a clean stop removes its own):
# stale_segments() lists this user's segments whose creating process is gone, never a live server's.
if "$REPO_ROOT/.venv/bin/python" -c "" >/dev/null 2>&1; then
    while IFS= read -r -d '' entry; do
        targets+=("$entry")
    done < <("$REPO_ROOT/.venv/bin/python" -c 'import sys
from kvbridge.cache_server.shm import stale_segments
sys.stdout.write("".join(f"{path}\0" for path in stale_segments()))')
else
    echo "cleanup.sh: not looking for stale cache-server shared memory: .venv is missing (scripts/setup.sh makes it)." >&2
fi

if [[ ${#targets[@]} -eq 0 ]]; then
    echo "Nothing to clean."
    exit 0
fi

if [[ $dry_run -eq 1 ]]; then
    echo "Would remove:"
    printf '  %s\n' "${targets[@]}"
    exit 0
fi
rm -rf -- "${targets[@]}"
echo "Removed:"
printf '  %s\n' "${targets[@]}"
