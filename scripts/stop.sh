#!/usr/bin/env bash
# Stop what scripts/start.sh started (PID file .kvbridge.pid): SIGTERM, wait, SIGKILL as a last resort.
# Usage: scripts/stop.sh [--timeout SECONDS]   (default 30)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
PID_FILE="$REPO_ROOT/.kvbridge.pid"

is_kvbridge() {  # the process with this PID runs the GUI start.sh started (not some later process given the number)
    [[ "$1" =~ ^[0-9]+$ && -r "/proc/$1/cmdline" ]] && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -q -- "-m kvbridge gui "   # what start.sh runs; a reused PID running anything else is not ours
}


# The cache server and the serve endpoint are not stopped here: each has a life of its own
# (scripts/cache_server.sh, scripts/serve.sh) and other processes may be using them. Say so once,
# whatever happened to the GUI.
note_running() {  # PID_FILE, the command in its cmdline, what to call it, its script
    local pid
    pid="$(sed -n 1p "$REPO_ROOT/$1" 2>/dev/null || true)"
    if [[ "$pid" =~ ^[0-9]+$ && -r "/proc/$pid/cmdline" ]] &&
        tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "-m kvbridge $2 "; then
        echo "note: $3 (pid $pid) keeps running; $4 stop stops it."
    fi
}
note_background_servers() {
    note_running .kvbridge-cache-server.pid cache-server "the cache server" scripts/cache_server.sh
    note_running .kvbridge-serve.pid serve "the serve endpoint" scripts/serve.sh
}
trap note_background_servers EXIT

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
# Only signal the PID when it is still KVBridge (the number may have been reused since).
if ! [[ "$pid" =~ ^[0-9]+$ ]] || ! is_kvbridge "$pid"; then
    echo "KVBridge is not running (stale PID file removed)."
    rm -f "$PID_FILE"
    exit 0
fi

port="${KVB_PORT:-}"
if [[ -z "$port" && -f .env ]]; then
    port="$(sed -n 's/^[[:space:]]*KVB_PORT[[:space:]]*=[[:space:]]*["'\'']\{0,1\}\([0-9]*\).*/\1/p' .env | tail -n1)"
fi
port="${port:-7860}"

children_of() {  # PIDs whose parent is $1, from /proc (no procps needed)
    local parent="$1" stat line fields
    for stat in /proc/[0-9]*/stat; do
        read -r line 2>/dev/null <"$stat" || continue
        read -r -a fields <<<"${line##*) }"   # the fields after "(comm) ": state, ppid, ...
        if [[ "${fields[1]:-}" == "$parent" ]]; then
            stat="${stat#/proc/}"
            echo "${stat%/stat}"
        fi
    done
}

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
    # A killed KVBridge cannot stop its llama-server child itself: find its children first.
    children="$(children_of "$pid")"
    kill -KILL "$pid" 2>/dev/null || true
    for child in $children; do
        kill -TERM "$child" 2>/dev/null || true
    done
    sleep 1
fi
rm -f "$PID_FILE"
if port_busy; then
    echo "warning: port $port is still in use by another process" >&2
    exit 1
fi
echo "stopped."
