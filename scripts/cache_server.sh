#!/usr/bin/env bash
# Run KVBridge's cache server (python -m kvbridge cache-server) in the background, with its own PID file.
# Usage: scripts/cache_server.sh start [SERVER ARGS...] | stop [--timeout SECONDS] | status | restart [SERVER ARGS...]
#   start    set up if needed, launch detached (logs in output/cache-server.log), wait until it listens.
#            SERVER ARGS go to the server: --url tcp://HOST:PORT, --server-module JSON, --metrics-port N
#   stop     SIGTERM (it flushes L1 to L2 and frees its shared memory), wait (default 30 s), SIGKILL last
#   status   running (pid, URL) or not; exit status 0 when running, 3 when not
# The URL defaults to KVB_CACHE_SERVER_URL, else tcp://127.0.0.1:5555; engines use it via KVB_STORE_URL.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
# Line 1 the server's pid, line 2 the URL it announced (once it listens). One server per checkout.
PID_FILE="$REPO_ROOT/.kvbridge-cache-server.pid"
LOG_FILE="$REPO_ROOT/output/cache-server.log"
START_WAIT_S=120   # a large KVB_L1_BYTES is reserved up front and the L2 index is read before it listens

usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; }

is_cache_server() {  # the PID runs our cache server (not a later process given the number, not a zombie)
    [[ "$1" =~ ^[0-9]+$ && -r "/proc/$1/cmdline" ]] &&
        tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -q -- "-m kvbridge cache-server"
}

recorded_pid() { sed -n 1p "$PID_FILE" 2>/dev/null || true; }
recorded_url() { sed -n 2p "$PID_FILE" 2>/dev/null || true; }

remove_segments_of() {
    # A server that is killed cannot remove its shared memory (kvbridge/cache_server/shm.py names it
    # kvbridge-<uid>-<pid>-<hex>.pool). Called only once that pid is gone, so never a live server's.
    local segment
    for segment in /dev/shm/kvbridge-"$(id -u)"-"$1"-*.pool; do
        [[ -f "$segment" ]] || continue
        rm -f -- "$segment"
        echo "removed its leftover shared memory $segment"
    done
}

forget_files_of() {
    # The token and key files a killed server leaves in ~/.cache/kvbridge/run, found from its URL
    # (kvbridge/cache_server/leftovers.py; nothing is removed while a server that wrote them runs).
    [[ -n "$1" ]] || return 0
    "$REPO_ROOT/.venv/bin/python" -c 'import sys
from kvbridge.cache_server.leftovers import forget_server_files
for path in forget_server_files(sys.argv[1]):
    print(f"removed its leftover {path}")' "$1" || true
}

cmd_start() {
    if [[ -f "$PID_FILE" ]]; then
        local old_pid old_url
        old_pid="$(recorded_pid)"
        if is_cache_server "$old_pid"; then
            old_url="$(recorded_url)"
            echo "The cache server is already running (pid $old_pid${old_url:+ on $old_url})." \
                 "Stop it first: scripts/cache_server.sh stop" >&2
            exit 1
        fi
        rm -f "$PID_FILE"  # stale: the process is gone
    fi

    # The cache server needs no browser; setup is otherwise the same as for the GUI (idempotent).
    "$REPO_ROOT/scripts/setup.sh"

    mkdir -p output
    local log_start pid url="" i
    log_start=1   # the first line of this run's log
    [[ -f "$LOG_FILE" ]] && log_start=$(( $(wc -l <"$LOG_FILE") + 1 ))
    # setsid: its own session, so closing this terminal does not stop it.
    touch "$LOG_FILE"   # before the child opens it: the wait below tails it (set -e -o pipefail)
    setsid "$REPO_ROOT/.venv/bin/python" -m kvbridge cache-server "$@" >>"$LOG_FILE" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$PID_FILE"
    echo "The cache server is starting in the background (pid $pid); waiting up to ${START_WAIT_S} s for it to listen…"
    for ((i = 0; i < START_WAIT_S * 4; i++)); do
        # The server prints this line only once it is bound: a client connecting after it is answered.
        url="$(tail -n +"$log_start" "$LOG_FILE" | sed -n "s/^cache server ready on \(.*\) (pid $pid)\$/\1/p" | tail -n1)"
        if [[ -n "$url" ]]; then
            printf '%s\n%s\n' "$pid" "$url" >"$PID_FILE"
            echo "The cache server is running in the background (pid $pid) on $url"
            echo "engines use it with KVB_STORE_URL=$url · logs: output/cache-server.log · stop: scripts/cache_server.sh stop"
            exit 0
        fi
        # kill -0, not is_cache_server: until setsid execs, the child's command line is still this script.
        if ! kill -0 "$pid" 2>/dev/null; then
            rm -f "$PID_FILE"
            remove_segments_of "$pid" >/dev/null
            echo "cache_server.sh: the cache server exited before it listened. The end of output/cache-server.log:" >&2
            tail -n +"$log_start" "$LOG_FILE" | tail -n 20 >&2
            exit 1
        fi
        sleep 0.25
    done
    echo "cache_server.sh: the cache server did not listen after ${START_WAIT_S} s (pid $pid still runs;" \
         "stop it with scripts/cache_server.sh stop). The end of output/cache-server.log:" >&2
    tail -n +"$log_start" "$LOG_FILE" | tail -n 20 >&2
    exit 1
}

cmd_stop() {
    local timeout_s=30 pid deadline
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --timeout) timeout_s="${2:?--timeout needs a number of seconds}"; shift 2 ;;
            *) echo "cache_server.sh stop: unknown option '$1' (use --timeout SECONDS)" >&2; exit 2 ;;
        esac
    done
    [[ "$timeout_s" =~ ^[0-9]+$ ]] || { echo "cache_server.sh stop: --timeout needs whole seconds, got '$timeout_s'" >&2; exit 2; }

    if [[ ! -f "$PID_FILE" ]]; then
        echo "The cache server is not running (no PID file $(basename "$PID_FILE"))."
        return 0
    fi
    pid="$(recorded_pid)"
    # Only signal the PID when it is still the cache server (the number may have been reused since).
    if ! is_cache_server "$pid"; then
        echo "The cache server is not running (stale PID file removed)."
        [[ "$pid" =~ ^[0-9]+$ ]] && remove_segments_of "$pid"
        forget_files_of "$(recorded_url)"
        rm -f "$PID_FILE"
        return 0
    fi

    echo "stopping the cache server (pid $pid)…"
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + timeout_s))
    while (( SECONDS < deadline )) && is_cache_server "$pid"; do
        sleep 0.25
    done
    if is_cache_server "$pid"; then
        echo "still running after ${timeout_s} s; sending SIGKILL (L1 objects not yet written to L2 are lost)"
        kill -KILL "$pid" 2>/dev/null || true
        deadline=$((SECONDS + 5))
        while (( SECONDS < deadline )) && is_cache_server "$pid"; do
            sleep 0.1
        done
        if is_cache_server "$pid"; then
            echo "cache_server.sh: pid $pid survived SIGKILL; PID file kept" >&2
            exit 1
        fi
    fi
    remove_segments_of "$pid"   # nothing after a clean exit
    forget_files_of "$(recorded_url)"
    rm -f "$PID_FILE"
    echo "stopped."
}

cmd_status() {
    local pid url
    pid="$(recorded_pid)"
    if [[ -f "$PID_FILE" ]] && is_cache_server "$pid"; then
        url="$(recorded_url)"
        echo "The cache server is running (pid $pid) on ${url:-an URL not announced yet (still starting?)}."
        return 0
    fi
    echo "The cache server is not running."
    return 3
}

command="${1:-}"
[[ $# -gt 0 ]] && shift
case "$command" in
    start) cmd_start "$@" ;;
    stop) cmd_stop "$@" ;;
    status) cmd_status ;;
    restart) cmd_stop; cmd_start "$@" ;;
    -h|--help) usage ;;
    "") usage >&2; exit 2 ;;
    *) echo "cache_server.sh: unknown command '$command' (use start, stop, status, restart or --help)" >&2; exit 2 ;;
esac
