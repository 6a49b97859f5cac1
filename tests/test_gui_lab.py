"""The KV cache lab's handlers on the real model, without a browser: bad controls are refused with the
setting named and nothing started; a Priority burst run shows a preemption, a swap-in and every
request finished; the figures are drawn from the scheduler's own snapshot; Stop cancels and frees.
Small workloads keep it to a minute or so; test_gui_lab_browser.py drives the tab in Chromium.
"""
from __future__ import annotations

import time

import pytest

from conftest import needs_model
from kvbridge.bench.common.scheduler_workloads import get_workload
from kvbridge.gui.lab import LabSession, lab_view, start_lab, stop_lab, workload_defaults

pytestmark = [needs_model, pytest.mark.timeout(300)]

SMALL = {"priority-burst": {"document_tokens": 200, "low_predict": 40, "urgent_predict": 8, "urgent_at_s": 1.0},
         "shared-system-prompt": {"n_users": 4, "n_predict": 6}}


@pytest.fixture
def lab(make_settings):
    session = LabSession(make_settings(ctx_size=1024), workload_options=SMALL)
    yield session
    session.close()


def controls(lab: LabSession, key: str, **changes):
    _, marks, rows = workload_defaults(lab, key)
    values = dict(kv_cells=marks.kv_cells, max_running=marks.max_running, soft=marks.soft, hard=marks.hard,
                  critical=marks.critical, rows=rows)
    values.update(changes)
    return values


def run_to_end(lab: LabSession, timeout_s: float = 240) -> list:
    views, deadline = [], time.monotonic() + timeout_s
    while True:
        view = lab_view(lab)
        views.append(view)
        if not view.running:
            return views
        assert time.monotonic() < deadline, view.message
        time.sleep(0.25)


@pytest.mark.parametrize("change, named", [
    ({"kv_cells": "lots"}, "KVB_SCHED_KV_CELLS"),
    ({"kv_cells": 64}, "KVB_SCHED_KV_CELLS"),
    ({"max_running": 0}, "KVB_SCHED_MAX_RUNNING"),
    ({"critical": 0.5}, "KVB_SCHED_CRITICAL"),
])
def test_bad_controls_are_refused_naming_the_setting(lab, change, named):
    outcome = start_lab(lab, "priority-burst", **controls(lab, "priority-burst", **change))
    assert not outcome.ok and named in outcome.message and "Nothing was changed" in outcome.message
    assert lab.run is None and lab.scheduler is None


def test_a_priority_out_of_range_names_the_request(lab):
    _, _, rows = workload_defaults(lab, "priority-burst")
    rows[-1][1] = 12
    outcome = start_lab(lab, "priority-burst", **controls(lab, "priority-burst", rows=rows))
    assert not outcome.ok and rows[-1][0] in outcome.message and "0 to 9" in outcome.message
    assert lab.run is None


def test_a_priority_burst_preempts_a_low_chat_and_everyone_finishes(lab):
    _, _, rows = workload_defaults(lab, "priority-burst")
    rows[0][1] = 0     # the table's priorities are what runs: the first chat is now the least urgent
    outcome = start_lab(lab, "priority-burst", **controls(lab, "priority-burst", rows=rows))
    assert outcome.ok, outcome.message
    assert not start_lab(lab, "priority-burst", **controls(lab, "priority-burst")).ok   # one run at a time
    views = run_to_end(lab)
    final = views[-1]
    kinds = [row[1] for row in final.events]
    assert "preempt" in kinds and "swap-out" in kinds and "swap-in" in kinds
    preempted = {row[2] for row in final.events if row[1] == "preempt"}
    assert "doc chat 1" in preempted                      # the one whose priority the table lowered
    assert all(row[2] == "done" for row in final.results), final.results
    by_label = {row[0]: row for row in final.results}
    assert by_label["doc chat 1"][1] == 0 and by_label["doc chat 1"][6] >= 1   # priority, preemptions
    assert all(by_label[f"urgent {i}"][6] == 0 for i in (1, 2))
    assert "finished" in final.message and "preemptions" in final.message
    assert "restore failed 0" in final.status and "failed 0" in final.status   # the fault counters are shown too
    # while it ran, the page saw requests holding blocks, and a gauge with the watermarks
    live = [v for v in views if v.running and "running (0)" not in v.status and "Pressure" in v.status]
    assert live, "no view showed a running request"
    assert any(trace.name.startswith("doc chat") for v in live for trace in v.block_map.data)
    assert final.pressure.data[0].gauge.steps[0].range[1] == pytest.approx(100 * lab.settings.sched_critical)
    assert {trace.name for trace in final.timeline.data} >= {"admit", "preempt", "swap-in", "finish"}
    # afterwards every block is free or a cached prefix
    snapshot = lab.scheduler.snapshot()
    assert snapshot["blocks"]["used"] == sum(snapshot["blocks"]["by_owner"].values())
    assert not snapshot["running"] and not snapshot["swapped"] and not snapshot["waiting"]


def test_stop_cancels_what_has_not_finished_and_frees_its_blocks(lab):
    assert start_lab(lab, "priority-burst", **controls(lab, "priority-burst")).ok
    deadline = time.monotonic() + 120
    while "running (0)" in lab_view(lab).status or lab.scheduler is None:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert stop_lab(lab).ok
    final = run_to_end(lab, 60)[-1]
    assert "stopped" in final.message
    assert any(row[2] == "cancelled" for row in final.results), final.results
    snapshot = lab.scheduler.snapshot()
    assert not snapshot["running"] and not snapshot["swapped"] and not snapshot["waiting"]
    holders = {h for extent in snapshot["blocks"]["extents"] for h in extent["holders"]}
    assert all(h.startswith("prefix-") for h in holders), holders


def test_many_users_share_one_prefill_of_the_system_prompt(lab):
    workload = get_workload("shared-system-prompt", **SMALL["shared-system-prompt"])
    assert start_lab(lab, "shared-system-prompt", **controls(lab, "shared-system-prompt")).ok
    final = run_to_end(lab)[-1]
    assert all(row[2] == "done" for row in final.results), final.results
    records = [lab.run.futures[r.label].result() for r in workload.requests]
    system_tokens = min(r.prompt_tokens for r in records) - 40
    prefilled_it = [r.label for r in records if r.prefill_tokens >= system_tokens]
    assert len(prefilled_it) == 1, [(r.label, r.prefill_tokens, r.prompt_tokens) for r in records]
    assert sum(row[1] == "share" for row in final.events) >= len(records) - 1
