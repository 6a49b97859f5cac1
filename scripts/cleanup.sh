#!/usr/bin/env bash
# Remove KVBridge's L2 disk cache, the run results in output/ (never input/, never models/), the
# shared memory of cache servers that were killed and, after asking, KVBridge's keys in L3. The L2
# directory is KVB_L2_DIR (environment, then .env), default ~/.cache/kvbridge/l2. It is removed only
# when it holds nothing but KVBridge's own files, so a mistyped KVB_L2_DIR cannot wipe a folder, and
# only while no KVBridge process uses it. With KVB_L3_URL set, the keys under <KVB_L3_PREFIX>:obj:* on
# that Redis/Valkey server go after a yes; no other key there is touched.
# Usage: scripts/cleanup.sh [--dry-run] [--yes]
#   --dry-run  only list what would be removed (and count L3's keys)
#   --yes      remove L3's keys without asking (without a terminal to ask on, they are kept otherwise)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"

dry_run=0
yes=0
for arg in "$@"; do
    case "$arg" in
        -n|--dry-run) dry_run=1 ;;
        -y|--yes) yes=1 ;;
        -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "cleanup.sh: unknown option '$arg' (use --dry-run, --yes or --help)" >&2; exit 2 ;;
    esac
done

# A KVB_ setting as the person set it: the environment, then .env.
setting() {
    local name="$1" value="${!1:-}"
    if [[ -z "$value" && -f .env ]]; then
        value="$(sed -n "s/^[[:space:]]*$name[[:space:]]*=[[:space:]]*[\"']\{0,1\}\([^\"'#]*\).*/\1/p" .env | tail -n1 | sed 's/[[:space:]]*$//')"
    fi
    printf '%s' "$value"
}

l2_dir="$(setting KVB_L2_DIR)"
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
    echo "No files to clean."
elif [[ $dry_run -eq 1 ]]; then
    echo "Would remove:"
    printf '  %s\n' "${targets[@]}"
else
    rm -rf -- "${targets[@]}"
    echo "Removed:"
    printf '  %s\n' "${targets[@]}"
fi

# L3: the server is shared (other hosts, other applications), so only KVBridge's keys under
# <KVB_L3_PREFIX>:obj:* are removed (RedisTier.clear), and only after a yes. The settings, the password
# (from the variable KVB_L3_PASSWORD_ENV names; never printed) and the count come from KVBridge itself.
# l3 count: one line, exit 0 with keys to remove, 10 with none. l3 clear: removes them. Both: exit 3
# when KVB_L3_URL is not set, 4 (one line on stderr) when L3 cannot be used or reached.
l3() {
    "$REPO_ROOT/.venv/bin/python" - "$1" "$REPO_ROOT/.env" <<'PY'
import logging
import os
import sys

logging.disable(logging.WARNING)   # the breaker's "marked down" log: the one line below says it
from kvbridge.settings import Settings

action, env_file = sys.argv[1:3]
settings = Settings.from_env(env_file=env_file)
if not settings.l3_url:
    sys.exit(3)

from kvbridge.store.objects import StoreFault
from kvbridge.store.redis_tier import RedisTier, redact


def say(message):   # never a password: the URL redacted; a password put where its variable's NAME belongs, hidden
    message = message.replace(settings.l3_url, redact(settings.l3_url))
    if settings.l3_password_env and not settings.l3_password_env.replace("_", "").isalnum():
        message = message.replace(settings.l3_password_env, "<the value of KVB_L3_PASSWORD_ENV>")
    print(f"cleanup.sh: {message}", file=sys.stderr)


problems = [p for p in settings.validate() if "KVB_L3_" in p]
if problems:
    say(f"leaving L3 alone: {'; '.join(problems)}")
    sys.exit(4)
if settings.l3_password_env and not os.environ.get(settings.l3_password_env):
    print(f"cleanup.sh: note: KVB_L3_PASSWORD_ENV names {settings.l3_password_env}, which is not set: "
          "connecting without a password", file=sys.stderr)
tier = RedisTier.from_settings(settings)
where = f"L3 {tier.location} (KVB_L3_PREFIX={tier.prefix})"
try:
    census = tier.census()
    keys = f"{'at least ' if census['capped'] else ''}{census['objects']:,} KVBridge keys under {tier.key_pattern()}"
    if action == "count":
        print(f"{where}: {keys} ({census['bytes'] / 2**20:.1f} MiB)")
        sys.exit(0 if census["objects"] else 10)
    tier.clear()
    print(f"Removed {keys} from {where}.")
except StoreFault as fault:
    say(f"leaving L3 alone: {where} cannot be used now: {fault}")
    sys.exit(4)
finally:
    tier.close()
PY
}

if [[ ! -x "$REPO_ROOT/.venv/bin/python" ]]; then
    [[ -z "$(setting KVB_L3_URL)" ]] || \
        echo "cleanup.sh: not looking at L3 (KVB_L3_URL): .venv is missing (scripts/setup.sh makes it)." >&2
    exit 0
fi
l3_status=0
l3_found="$(l3 count)" || l3_status=$?
[[ -z "$l3_found" ]] || echo "$l3_found"
[[ $l3_status -eq 0 ]] || exit 0   # not set, nothing there, or not reachable (said on stderr): the rest is done
if [[ $dry_run -eq 1 ]]; then
    echo "Would remove them after asking (--yes: without asking)."
    exit 0
fi
if [[ $yes -eq 0 ]]; then
    if [[ ! -t 0 ]]; then
        echo "cleanup.sh: L3's keys are kept: there is no terminal to ask on. Run scripts/cleanup.sh --yes to remove them." >&2
        exit 0
    fi
    read -r -p "Remove them? [y/N] " answer || answer=""   # end of input (Ctrl-D): no
    if [[ ! "$answer" =~ ^[Yy]([Ee][Ss])?$ ]]; then
        echo "L3's keys are kept."
        exit 0
    fi
fi
l3 clear || true   # unreachable since the count: one line on stderr, the rest of the cleanup stands
