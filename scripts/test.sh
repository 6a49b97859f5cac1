#!/usr/bin/env bash
# Run the whole test suite: set-up (idempotent; every embedded model), build llama-server if needed,
# then pytest over tests/.
# Extra arguments go to pytest, e.g. scripts/test.sh -x -q -m "not slow" or scripts/test.sh tests/test_store.py
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
start_s=$SECONDS

# --test: also the test packages, chromium, redis-server and prometheus; --model all: the model matrix's tests
# run on every embedded model. How long it takes on 2 cores: README's "Before you start" (one place for the figure).
"$REPO_ROOT/scripts/setup.sh" --test --model all
"$REPO_ROOT/scripts/build_llama_server.sh"
# LMCache's own TokenHasher (CPU-only extract) for the hashing parity test; if it cannot be installed
# the parity test is skipped and says why, the rest of the suite still runs.
"$REPO_ROOT/scripts/install_lmcache.sh" || echo "test.sh: LMCache hasher not installed; its parity test will be skipped"

set +e
"$REPO_ROOT/.venv/bin/python" -m pytest -ra "$@"
rc=$?
set -e

elapsed=$((SECONDS - start_s))
if [[ $rc -eq 5 ]]; then
    echo "test.sh: pytest collected no tests; that counts as a failure" >&2
    rc=1
fi
echo "test.sh: finished in $((elapsed / 60)) min $((elapsed % 60)) s (pytest exit code $rc)"
exit $rc
