#!/usr/bin/env bash
# Run KVBridge's OpenAI-compatible endpoint (python -m kvbridge serve) in the background, with its own PID file.
# Usage: scripts/serve.sh start [SERVE ARGS...] | stop [--timeout SECONDS] | status | restart [SERVE ARGS...]
#   start    set up if needed, launch detached (logs in output/serve.log), wait until it answers (the model loads first).
#            SERVE ARGS go to the server: --host H, --port P, --engine scheduler|llama-server
#   stop     SIGTERM (running requests finish, up to KVB_SERVE_DRAIN_TIMEOUT s), wait, SIGKILL last
#            (default wait: KVB_SERVE_DRAIN_TIMEOUT + 20 s, so a drain is never cut short)
#   status   running (pid, URL) or not; exit status 0 when running, 3 when not
# Host and port default to KVB_SERVE_HOST / KVB_SERVE_PORT (127.0.0.1:8000); clients use http://HOST:PORT/v1.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
# Line 1 the server's pid, line 2 the URL it announced (once it answers). One endpoint per checkout.
PID_FILE="$REPO_ROOT/.kvbridge-serve.pid"
LOG_FILE="$REPO_ROOT/output/serve.log"
START_WAIT_S=120   # the model loads before it binds: ~20 s on a busy 2-core machine, more with a large model
STOP_MARGIN_S=20   # beyond the drain: the engine closes and the store writes L1 to L2

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }

is_serve() {  # the PID runs our endpoint (not a later process given the number, not a zombie)
    [[ "$1" =~ ^[0-9]+$ && -r "/proc/$1/cmdline" ]] &&
        tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -q -- "-m kvbridge serve "
}

recorded_pid() { sed -n 1p "$PID_FILE" 2>/dev/null || true; }
recorded_url() { sed -n 2p "$PID_FILE" 2>/dev/null || true; }

# A KVB_ setting as the person set it: the environment, then .env (as Settings.from_env reads them).
setting() {
    local name="$1" value="${!1:-}"
    if [[ -z "$value" && -f .env ]]; then
        value="$(sed -n "s/^[[:space:]]*$name[[:space:]]*=[[:space:]]*[\"']\{0,1\}\([^\"'#]*\).*/\1/p" .env | tail -n1 | sed 's/[[:space:]]*$//')"
    fi
    printf '%s' "$value"
}

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

cmd_start() {
    if [[ -f "$PID_FILE" ]]; then
        local old_pid old_url
        old_pid="$(recorded_pid)"
        if is_serve "$old_pid"; then
            old_url="$(recorded_url)"
            echo "The serve endpoint is already running (pid $old_pid${old_url:+ on $old_url})." \
                 "Stop it first: scripts/serve.sh stop" >&2
            exit 1
        fi
        rm -f "$PID_FILE"  # stale: the process is gone
    fi

    # The endpoint needs no browser; setup is otherwise the same as for the GUI (idempotent).
    "$REPO_ROOT/scripts/setup.sh"

    mkdir -p output
    # Made here, not by the child's redirection: the wait below may read it before the child opened it.
    touch "$LOG_FILE"
    local log_start pid url="" i
    log_start=$(( $(wc -l <"$LOG_FILE") + 1 ))   # the first line of this run's log
    # setsid: its own session, so closing this terminal does not stop it.
    setsid "$REPO_ROOT/.venv/bin/python" -m kvbridge serve "$@" >>"$LOG_FILE" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$PID_FILE"
    echo "The serve endpoint is starting in the background (pid $pid); waiting up to ${START_WAIT_S} s for the model to load…"
    for ((i = 0; i < START_WAIT_S * 4; i++)); do
        # The server prints this line only once it is bound (HOST:PORT as bound): a request sent after it is answered.
        url="$(tail -n +"$log_start" "$LOG_FILE" |
               sed -n 's|^KVBridge serve ready on \(http://[^[:space:]]*\)[[:space:]]*$|\1|p' | tail -n1 || true)"
        if [[ -n "$url" ]]; then
            printf '%s\n%s\n' "$pid" "$url" >"$PID_FILE"
            echo "The serve endpoint is running in the background (pid $pid) on $url"
            echo "OpenAI clients use base_url $url/v1 · logs: output/serve.log · stop: scripts/serve.sh stop"
            exit 0
        fi
        # kill -0, not is_serve: until setsid execs, the child's command line is still this script.
        if ! kill -0 "$pid" 2>/dev/null; then
            rm -f "$PID_FILE"
            echo "serve.sh: the serve endpoint exited before it answered. The end of output/serve.log:" >&2
            tail -n +"$log_start" "$LOG_FILE" | tail -n 20 >&2
            exit 1
        fi
        sleep 0.25
    done
    echo "serve.sh: the serve endpoint did not answer after ${START_WAIT_S} s (pid $pid still runs;" \
         "stop it with scripts/serve.sh stop). The end of output/serve.log:" >&2
    tail -n +"$log_start" "$LOG_FILE" | tail -n 20 >&2
    exit 1
}

default_stop_timeout() {  # the drain the server allows itself, plus a margin for closing the engine
    local drain
    drain="$(setting KVB_SERVE_DRAIN_TIMEOUT)"
    [[ "$drain" =~ ^[0-9]+(\.[0-9]*)?$ ]] || drain=30   # unset or not a number (serve refuses that itself)
    echo $(( ${drain%%.*} + 1 + STOP_MARGIN_S ))       # +1: a fraction of a second rounds up
}

cmd_stop() {
    local timeout_s pid deadline children child
    timeout_s="$(default_stop_timeout)"
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --timeout) timeout_s="${2:?--timeout needs a number of seconds}"; shift 2 ;;
            *) echo "serve.sh stop: unknown option '$1' (use --timeout SECONDS)" >&2; exit 2 ;;
        esac
    done
    [[ "$timeout_s" =~ ^[0-9]+$ ]] || { echo "serve.sh stop: --timeout needs whole seconds, got '$timeout_s'" >&2; exit 2; }

    if [[ ! -f "$PID_FILE" ]]; then
        echo "The serve endpoint is not running (no PID file $(basename "$PID_FILE"))."
        return 0
    fi
    pid="$(recorded_pid)"
    # Only signal the PID when it is still the endpoint (the number may have been reused since).
    if ! is_serve "$pid"; then
        echo "The serve endpoint is not running (stale PID file removed)."
        rm -f "$PID_FILE"
        return 0
    fi

    echo "stopping the serve endpoint (pid $pid; running requests get up to ${timeout_s} s to finish)…"
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + timeout_s))
    while (( SECONDS < deadline )) && is_serve "$pid"; do
        sleep 0.25
    done
    if is_serve "$pid"; then
        echo "still running after ${timeout_s} s; sending SIGKILL (requests still running are cut off)"
        # A killed endpoint cannot stop a llama-server child (--engine llama-server) itself: find its children first.
        children="$(children_of "$pid")"
        kill -KILL "$pid" 2>/dev/null || true
        for child in $children; do
            kill -TERM "$child" 2>/dev/null || true
        done
        deadline=$((SECONDS + 5))
        while (( SECONDS < deadline )) && is_serve "$pid"; do
            sleep 0.1
        done
        if is_serve "$pid"; then
            echo "serve.sh: pid $pid survived SIGKILL; PID file kept" >&2
            exit 1
        fi
    fi
    rm -f "$PID_FILE"
    echo "stopped."
}

cmd_status() {
    local pid url
    pid="$(recorded_pid)"
    if [[ -f "$PID_FILE" ]] && is_serve "$pid"; then
        url="$(recorded_url)"
        echo "The serve endpoint is running (pid $pid) on ${url:-an URL not announced yet (still loading the model?)}."
        return 0
    fi
    echo "The serve endpoint is not running."
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
    *) echo "serve.sh: unknown command '$command' (use start, stop, status, restart or --help)" >&2; exit 2 ;;
esac
