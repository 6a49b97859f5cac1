#!/usr/bin/env bash
# Set up what the GUI on the embedded model needs (idempotent: scripts/setup.sh, about 10 minutes the
# first time on 2 cores, seconds after), then run KVBridge's GUI. Stop it with scripts/stop.sh or Ctrl-C.
# Usage: scripts/start.sh [--background]
#   --background  run detached, logs in output/kvbridge.log
# KVB_HOST / KVB_PORT (default 127.0.0.1:7860) choose where the GUI listens.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
PID_FILE="$REPO_ROOT/.kvbridge.pid"

is_kvbridge() {  # the process with this PID runs the GUI start.sh started (not some later process given the number)
    [[ "$1" =~ ^[0-9]+$ && -r "/proc/$1/cmdline" ]] && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -q -- "-m kvbridge gui "   # what start.sh runs; a reused PID running anything else is not ours
}

LOG_FILE="$REPO_ROOT/output/kvbridge.log"

background=0

for arg in "$@"; do
    case "$arg" in
        --background) background=1 ;;
        -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "start.sh: unknown option '$arg' (use --background or --help)" >&2; exit 2 ;;
    esac
done

if [[ -f "$PID_FILE" ]]; then
    old_pid="$(cat "$PID_FILE" 2>/dev/null || true)"
    # The PID must still be KVBridge: after a reboot or a crash the number may belong to anything.
    if [[ "$old_pid" =~ ^[0-9]+$ ]] && is_kvbridge "$old_pid"; then
        echo "KVBridge is already running (pid $old_pid). Stop it first: scripts/stop.sh" >&2
        exit 1
    fi
    rm -f "$PID_FILE"  # stale: the process is gone
fi

"$REPO_ROOT/scripts/setup.sh"   # only what the GUI on the embedded model needs; tests: scripts/test.sh

host="${KVB_HOST:-}"
port="${KVB_PORT:-}"
if [[ -f .env ]]; then
    # The environment wins over .env, as in Settings.from_env().
    [[ -n "$host" ]] || host="$(sed -n 's/^[[:space:]]*KVB_HOST[[:space:]]*=[[:space:]]*["'\'']\{0,1\}\([^"'\''#[:space:]]*\).*/\1/p' .env | tail -n1)"
    [[ -n "$port" ]] || port="$(sed -n 's/^[[:space:]]*KVB_PORT[[:space:]]*=[[:space:]]*["'\'']\{0,1\}\([0-9]*\).*/\1/p' .env | tail -n1)"
fi
host="${host:-127.0.0.1}"
port="${port:-7860}"

mkdir -p output
if [[ $background -eq 1 ]]; then
    # setsid: its own session, so closing this terminal does not stop it.
    log_start=$(( $(wc -l <"$LOG_FILE" 2>/dev/null || echo 0) + 1 ))
    setsid "$REPO_ROOT/.venv/bin/python" -m kvbridge gui >>"$LOG_FILE" 2>&1 </dev/null &
    pid=$!
    echo $pid >"$PID_FILE"
    # The URL is printed only once the page answers: opening it earlier would be refused.
    probe_host="$host"
    [[ "$probe_host" == "0.0.0.0" || "$probe_host" == "::" ]] && probe_host="127.0.0.1"
    wait_s=120
    echo "KVBridge is starting in the background (pid $pid); waiting up to ${wait_s} s for http://$host:$port …"
    for ((i = 0; i < wait_s * 4; i++)); do
        if ! kill -0 "$pid" 2>/dev/null; then
            rm -f "$PID_FILE"
            echo "start.sh: KVBridge exited before it served the page. The end of output/kvbridge.log:" >&2
            tail -n +"$log_start" "$LOG_FILE" | tail -n 20 >&2
            exit 1
        fi
        if "$REPO_ROOT/.venv/bin/python" - "$probe_host" "$port" <<'PY' 2>/dev/null; then
import sys, urllib.request
urllib.request.urlopen(f"http://{sys.argv[1]}:{sys.argv[2]}/", timeout=2).read(1)
PY
            echo "KVBridge is running in the background (pid $pid): http://$host:$port"
            echo "logs: output/kvbridge.log · stop: scripts/stop.sh"
            exit 0
        fi
        sleep 0.25
    done
    echo "start.sh: nothing answered at http://$host:$port after ${wait_s} s (pid $pid still runs; stop it with scripts/stop.sh)." >&2
    echo "The end of output/kvbridge.log:" >&2
    tail -n +"$log_start" "$LOG_FILE" | tail -n 20 >&2
    exit 1
fi

echo "KVBridge: http://$host:$port  (Ctrl-C or scripts/stop.sh to stop)"
# exec keeps the PID: the PID file names the GUI process itself, and signals reach it directly.
echo $$ >"$PID_FILE"
exec "$REPO_ROOT/.venv/bin/python" -m kvbridge gui
