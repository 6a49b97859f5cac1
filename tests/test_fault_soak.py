"""The fault-injection soak (kvbridge.bench.probes.fault_soak), bounded for CI: two engine processes and a
`serve` process on the embedded model asking questions through a real cache server with L3 on a real
Redis, while the driver
SIGSTOPs and SIGKILLs the engines and the cache server, restarts the cache server cleanly under the
clients (a new CURVE key pair and token: every client must authenticate to it again), pauses and
kills Redis and fills the shared-memory pool. What a user checks: no answer differs from its cold answer, every engine answers
again after the last fault, and nothing (lease, pending page, segment of a dead server) is left.
`python -m kvbridge.bench.probes.fault_soak --seconds 300` is the longer run (Docs/Research.md §14).
"""
from __future__ import annotations

import pytest

from conftest import needs_model
from kvbridge.bench.probes.fault_soak import soak
from tests.redis_helpers import needs_redis


@needs_model
@needs_redis
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_faults_never_give_a_wrong_answer_and_everything_comes_back(make_settings):
    # at least 5 faults whatever the machine's load (4 came in 45 s on a loaded one: each takes its own time)
    report = soak(seconds=45, n_clients=2, seed=3, interval_s=4.0, settings=make_settings(), min_faults=5,
                  min_serve_answers=5)
    print(report.table())
    assert sum(report.faults.values()) >= 5
    # the first fault is a clean restart (a new key pair and token): the engines answered after it, re-authenticated
    assert report.faults["server-restart"] >= 1 and "server-restart" in report.recovery_s, report.table()
    # enough answers to have met every fault (17-21 seen on a loaded machine, where a clean stop flushing L1
    # once took most of the window); the exact count follows the machine's load, not KVBridge's behaviour
    assert report.answers >= 10 and report.restored > 0
    assert report.wrong == 0, report.table()
    assert report.serve_answers >= 5 and report.serve_wrong == 0, report.table()   # through serve, exact mode, f16, two running
    assert report.clients_back, report.table()
    assert report.leftovers == [], report.table()
