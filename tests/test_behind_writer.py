"""The write-behind queue stays quiet while a request is on its way to its answer: a job submitted or
queued during a hold starts only after it (a 40 MB L2 promotion beside a prefill took a core from
llama.cpp); drain() runs the jobs regardless, and a hold cannot keep them back past MAX_HOLD_S.
"""
from __future__ import annotations

import threading
import time

from kvbridge.store import behind
from kvbridge.store.behind import BehindWriter


def writer():
    done: list[tuple[int, float]] = []
    return BehindWriter(lambda job: done.append((job, time.monotonic())), capacity=8), done


def test_no_job_starts_while_held_and_all_run_after():
    w, done = writer()
    with w.hold():
        assert w.submit(1) and w.submit(2)
        time.sleep(0.3)
        assert done == [] and w.pending == 2
        released = time.monotonic()
    assert w.drain(5)
    assert [job for job, _ in done] == [1, 2] and all(at >= released for _, at in done)


def test_drain_runs_held_jobs_instead_of_waiting_for_the_hold():
    w, done = writer()
    with w.hold():
        w.submit(1)
        assert w.drain(5) and [job for job, _ in done] == [1]


def test_a_hold_longer_than_the_limit_lets_the_jobs_run(monkeypatch):
    monkeypatch.setattr(behind, "MAX_HOLD_S", 0.2)
    w, done = writer()
    finished = threading.Event()
    with w.hold():
        w.submit(1)
        deadline = time.monotonic() + 5
        while not done and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [job for job, _ in done] == [1]
        finished.set()
    w.close()
