"""The suite runs offline once set up: the set-up steps ./scripts/test.sh runs before pytest pass with the
network cut, and download nothing.

Each step runs in a network namespace of its own with only loopback up (`unshare -n`), as on a machine
whose network went away after set-up: scripts/setup.sh --test --model all, scripts/build_llama_server.sh,
scripts/install_lmcache.sh (test.sh's three steps, in its order). Done, each is a few checks (a few
seconds in all); one that wanted to fetch or build would fail here, or print what it fetched. The
packaging test's pip runs under `unshare -n` too (tests/test_packaging.py). Left out: pytest itself under
unshare (the lead's full run does that: `unshare -n sh -c 'ip link set lo up; ./scripts/test.sh'`).
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kvbridge.settings import WORK_DIR

STEPS = ("scripts/setup.sh --test --model all", "scripts/build_llama_server.sh", "scripts/install_lmcache.sh")
# what the steps print when they fetch, install or build something (pip's own words too)
FETCHING = re.compile(r"download|fetching |installing |building |Collecting |Retrying ", re.IGNORECASE)


def _may_cut_the_network() -> bool:
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=30).returncode == 0
    except FileNotFoundError:
        return False


pytestmark = pytest.mark.skipif(not _may_cut_the_network(),
                                reason="`unshare -n` is not permitted here (needs root or user namespaces)")


@pytest.fixture(scope="module")
def set_up():
    """Set-up must be done before it can be shown to need no network; an install it would redo is no test
    of that (and would remove the build record on its way to failing offline)."""
    check = subprocess.run([sys.executable, "scripts/build_variants.py", "check"], cwd=WORK_DIR,
                           capture_output=True, text=True, timeout=120)
    if check.returncode != 0:
        pytest.skip(f"set-up is not done here ({check.stdout.strip()}): run ./scripts/setup.sh --test first")


@pytest.mark.parametrize("step", STEPS)
def test_a_set_up_step_passes_with_the_network_cut_and_fetches_nothing(set_up, step):
    done = subprocess.run(["unshare", "-n", "sh", "-c", f"command -v ip >/dev/null && ip link set lo up; ./{step}"],
                          cwd=WORK_DIR, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{step} failed with the network cut:\n{output[-3000:]}"
    fetched = [line for line in output.splitlines() if FETCHING.search(line)]
    assert not fetched, f"{step} fetched, installed or built with everything set up:\n" + "\n".join(fetched)
