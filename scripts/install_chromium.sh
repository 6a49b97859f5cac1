#!/usr/bin/env bash
# Chromium for the browser tests and the screenshot, which drive it through the playwright package.
# Called by scripts/setup.sh --test, after the test packages (playwright among them) are installed.
#   Debian (and others like it)  apt's chromium, /usr/bin/chromium (with apt when root; else says the command)
#   Ubuntu (and others like it), or /usr/bin/chromium being the snap's wrapper
#                                playwright's own build: .venv/bin/python -m playwright install --with-deps chromium
#                                (Ubuntu's apt chromium is a snap: its confinement often refuses playwright, and
#                                snaps do not run in most containers)
#   anything else                says what to install; installs nothing
# Nothing to do when kvbridge.gui.chromium already finds one that is not the snap (the lookup the tests use).
# --dry-run: print the decision and the command, change nothing. OS_RELEASE_FILE: the os-release file read
# (default /etc/os-release; the tests give their own), APT_CHROMIUM the apt path checked for the snap wrapper.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="$REPO_ROOT/.venv/bin/python"
OS_RELEASE_FILE="${OS_RELEASE_FILE:-/etc/os-release}"
APT_CHROMIUM="${APT_CHROMIUM:-/usr/bin/chromium}"   # the tests give their own
DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
say() { echo "[setup] $*"; }

# The distribution as "ID ID_LIKE" from the os-release file, read without running it.
distro() {
    [[ -r "$OS_RELEASE_FILE" ]] || { echo "unknown"; return; }
    local id like
    id="$(sed -n 's/^ID=//p' "$OS_RELEASE_FILE" | tr -d '"' | head -n1)"
    like="$(sed -n 's/^ID_LIKE=//p' "$OS_RELEASE_FILE" | tr -d '"' | head -n1)"
    echo "${id:-unknown} ${like}"
}

# Whether /usr/bin/chromium leads to the snap (a link to it, or Ubuntu's stub script).
apt_chromium_is_snap() {
    [[ -e "$APT_CHROMIUM" ]] || return 1
    local resolved
    resolved="$(readlink -f "$APT_CHROMIUM")"
    [[ "$resolved" == /snap/* || "$(basename "$resolved")" == snap ]] && return 0
    [[ "$(head -c 2 "$APT_CHROMIUM")" == "#!" ]] && grep -q "/snap/" "$APT_CHROMIUM"   # a script: small
}

# apt, playwright or manual.
decide() {
    local words=" $(distro) "
    if [[ "$words" == *" ubuntu "* ]] || apt_chromium_is_snap; then
        echo playwright
    elif [[ "$words" == *" debian "* ]]; then
        echo apt
    else
        echo manual
    fi
}

choice="$(decide)"
case "$choice" in
    apt)        command="apt-get update && apt-get install -y chromium" ;;
    playwright) command="$PYTHON -m playwright install --with-deps chromium" ;;
    *)          command="none: install Chromium with this system's package manager, or: $PYTHON -m playwright install chromium" ;;
esac
if [[ $DRY_RUN -eq 1 ]]; then
    echo "distribution: $(distro)"
    echo "decision: $choice"
    echo "command: $command"
    exit 0
fi

if found="$("$PYTHON" -m kvbridge.gui.chromium 2>/dev/null)" && [[ "$found" != /snap/* ]]; then
    exit 0   # already there (what the browser tests will drive)
fi
case "$choice" in
    apt)
        if [[ "$(id -u)" -eq 0 ]]; then
            say "installing Debian's chromium for the browser tests (about 1 minute, ~300 MB)"
            DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
        else
            say "chromium is missing (the browser tests will be skipped). To install: sudo apt-get update && sudo apt-get install -y chromium"
        fi ;;
    playwright)
        # --with-deps installs the libraries it needs with apt, so it needs root (or sudo) for that part
        if [[ "$(id -u)" -eq 0 ]]; then
            say "installing playwright's own Chromium for the browser tests, not Ubuntu's snap (about 2 minutes, ~300 MB)"
            "$PYTHON" -m playwright install --with-deps chromium
        else
            say "chromium is missing (the browser tests will be skipped); Ubuntu's apt chromium is a snap playwright cannot drive. To install playwright's own: sudo $PYTHON -m playwright install-deps chromium && $PYTHON -m playwright install chromium"
        fi ;;
    *)
        say "chromium is missing (the browser tests will be skipped): this is neither Debian nor Ubuntu ($(distro)). Install Chromium with this system's package manager, or playwright's own: $PYTHON -m playwright install chromium" ;;
esac
