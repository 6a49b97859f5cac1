#!/usr/bin/env bash
# Chromium for the browser tests (playwright drives Debian's chromium; no `playwright install`).
# Called by scripts/setup.sh --test. Installs with apt when root; otherwise says what to run.
set -euo pipefail
say() { echo "[setup] $*"; }
if [[ -x /usr/bin/chromium ]]; then
    exit 0
fi
if [[ "$(id -u)" -eq 0 ]]; then
    say "installing Debian's chromium for the browser tests (about 1 minute, ~300 MB)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
else
    say "chromium is missing (the browser tests will be skipped). To install: sudo apt-get update && sudo apt-get install -y chromium"
fi
