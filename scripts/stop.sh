#!/usr/bin/env bash
# Stop what scripts/start.sh started (PID file .kvbridge.pid): SIGTERM, wait, SIGKILL as a last resort.
# Usage: scripts/stop.sh [--timeout SECONDS]   (default 30)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
PID_FILE="$REPO_ROOT/.kvbridge.pid"

timeout_s=30
while [[ $# -gt 0 ]]; do
    case "$1" in
        --timeout) timeout_s="${2:?--timeout needs a number of seconds}"; shift 2 ;;
        -h|--help) sed -n '2,3p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "stop.sh: unknown option '$1' (use --timeout SECONDS or --help)" >&2; exit 2 ;;
    esac
done

if [[ ! -f "$PID_FILE" ]]; then
    echo "KVBridge is not running (no PID file .kvbridge.pid)."
    exit 0
fi
pid="$(cat "$PID_FILE" 2>/dev/null || true)"
if ! [[ "$pid" =~ ^[0-9]+$ ]] || ! kill -0 "$pid" 2>/dev/null; then
    echo "KVBridge is not running (stale PID file removed)."
    rm -f "$PID_FILE"
    exit 0
fi

port="${KVB_PORT:-}"
if [[ -z "$port" && -f .env ]]; then
    port="$(sed -n 's/^[[:space:]]*KVB_PORT[[:space:]]*=[[:space:]]*["'\'']\{0,1\}\([0-9]*\).*/\1/p' .env | tail -n1)"
fi
port="${port:-7860}"

port_busy() {
    # True while something listens on the port (bash's /dev/tcp; no extra tools needed).
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null
}

echo "stopping KVBridge (pid $pid)…"
kill -TERM "$pid" 2>/dev/null || true
deadline=$((SECONDS + timeout_s))
while (( SECONDS < deadline )); do
    if ! kill -0 "$pid" 2>/dev/null && ! port_busy; then
        rm -f "$PID_FILE"
        echo "stopped."
        exit 0
    fi
    sleep 0.5
done

if kill -0 "$pid" 2>/dev/null; then
    echo "still running after ${timeout_s} s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    sleep 1
fi
rm -f "$PID_FILE"
if port_busy; then
    echo "warning: port $port is still in use by another process" >&2
    exit 1
fi
echo "stopped."
