#!/usr/bin/env bash
# Remove KVBridge's L2 disk cache and the run results in output/ (never input/, never models/).
# The L2 directory is KVB_L2_DIR (environment, then .env), default ~/.cache/kvbridge/l2. It is removed
# only when it holds nothing but KVBridge's own objects, so a mistyped KVB_L2_DIR cannot wipe a folder.
# Usage: scripts/cleanup.sh [--dry-run]   (--dry-run only lists what would be removed)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

dry_run=0
for arg in "$@"; do
    case "$arg" in
        -n|--dry-run) dry_run=1 ;;
        -h|--help) sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "cleanup.sh: unknown option '$arg' (use --dry-run or --help)" >&2; exit 2 ;;
    esac
done

l2_dir="${KVB_L2_DIR:-}"
if [[ -z "$l2_dir" && -f .env ]]; then
    l2_dir="$(sed -n 's/^[[:space:]]*KVB_L2_DIR[[:space:]]*=[[:space:]]*["'\'']\{0,1\}\([^"'\''#]*\).*/\1/p' .env | tail -n1 | sed 's/[[:space:]]*$//')"
fi
l2_dir="${l2_dir:-$HOME/.cache/kvbridge/l2}"
l2_dir="${l2_dir/#\~/$HOME}"

# Ours: every file is an L2 object (*.kvb, kvbridge/store/diskformat.py) or a temp file of one
# (*.tmp); nothing else. Anything foreign and we leave the whole directory alone.
l2_is_ours() {
    local dir="$1" foreign
    [[ -d "$dir" ]] || return 1
    case "$(cd "$dir" && pwd -P)" in
        /|"$HOME"|"$REPO_ROOT"|"$REPO_ROOT/input"|"$REPO_ROOT/models") return 1 ;;
    esac
    foreign="$(find "$dir" ! -type d ! -name '*.kvb' ! -name '*.tmp' -print -quit)"
    [[ -z "$foreign" ]]
}

targets=()
if [[ -d "$l2_dir" ]]; then
    if l2_is_ours "$l2_dir"; then
        targets+=("$l2_dir")
    else
        echo "cleanup.sh: leaving $l2_dir alone: it holds files that are not KVBridge L2 objects (KVB_L2_DIR)." >&2
    fi
fi
while IFS= read -r -d '' entry; do
    targets+=("$entry")
done < <(find "$REPO_ROOT/output" -mindepth 1 -maxdepth 1 ! -name .gitkeep -print0 2>/dev/null)

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
