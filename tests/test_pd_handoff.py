"""The PD hand-off's pipeline rules (kvbridge.serve.pd): what an early prefill answer promises, and how long a
decode leg waits for the write it promised. The whole hand-off, with real workers, a cache server and vllm-router,
is tests/test_serve_fleet.py's (its answers equal a solo instance's); here the rules alone, on a clock of the
test's own so that the bound is checked exactly."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbridge.serve import pd


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1


RECORD = SimpleNamespace(prompt_tokens=600, stored_tokens=0, queue_ms=0.1, ttft_ms=150.0, total_ms=151.0)


def test_an_early_answer_promises_the_whole_prompt_and_says_it_is_not_written():
    entry = pd.prefill_params("worker-1", RECORD, 256, "m", written=False)["kvbridge"]
    assert entry["stored_tokens"] == 600 and entry["written"] is False
    assert pd.handoff_pending(entry)
    written = pd.prefill_params("worker-1", SimpleNamespace(**{**vars(RECORD), "stored_tokens": 598}), 256, "m")
    assert written["kvbridge"]["stored_tokens"] == 598 and not pd.handoff_pending(written["kvbridge"])


@pytest.mark.parametrize("entry", [None, {}, {"written": False}, {"written": False, "stored_tokens": True},
                                   {"written": "false", "stored_tokens": 600}, {"written": None, "stored_tokens": 600}])
def test_only_a_well_formed_promise_is_waited_for(entry):
    assert not pd.handoff_pending(entry)


def test_the_wait_ends_as_soon_as_all_but_the_last_token_is_stored():
    clock, seen = Clock(), iter([0, 256, 512, 599, 600])
    held = pd.wait_for_handoff({"stored_tokens": 600, "written": False}, lambda: next(seen), clock=clock,
                               sleep=clock.sleep)
    assert held == 599 and clock.sleeps == 3   # a restore never takes the last token: 599 is enough


def test_the_wait_is_bounded_and_says_what_it_found():
    clock = Clock()
    held = pd.wait_for_handoff({"stored_tokens": 600, "written": False, "instance": "worker-1"}, lambda: 512,
                               timeout_s=0.5, clock=clock, sleep=clock.sleep)
    assert held == 512
    assert 0.5 <= clock.now < 0.5 + 2 * pd.HANDOFF_POLL_S


def test_an_engine_that_cannot_tell_is_not_waited_for():
    clock = Clock()
    assert pd.wait_for_handoff({"stored_tokens": 600, "written": False}, lambda: -1, clock=clock,
                               sleep=clock.sleep) == -1
    assert clock.sleeps == 0
