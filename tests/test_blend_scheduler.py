"""Blend mode through the scheduler and through `serve` (X-KVBridge-Blend), on the real model, with the
official openai SDK as the client: the same placement, recompute and storage as in-process, and the
blended cells never shared with, swapped for or stored as an exact request's KV.
"""
from __future__ import annotations

import pytest
import requests

from conftest import needs_model
from kvbridge.bench.rag import load_corpus, rag_messages
from kvbridge.scheduler import Scheduler
from test_serve import Served

pytestmark = [needs_model, pytest.mark.timeout(600)]
QUESTION = "What is the steepest gradient on the line?"


def rag(passages, separator="[KVB_SEP]"):
    return list(rag_messages(load_corpus(), passages, QUESTION, separator))


@pytest.fixture(scope="module")
def scheduler(make_module_settings):
    """One scheduler for both tests (one model load): the request without passages stores nothing a
    blend request finds, so either test may run first."""
    settings = make_module_settings(ctx_size=2048, sched_kv_cells=4096, sched_max_running=2, sched_cached_prefixes=2,
                             n_predict=8, blend_recompute_tokens=8, blend_recompute_ratio=0.0)
    with Scheduler(settings) as s:
        yield s


def test_a_blend_request_reuses_passages_stored_by_an_earlier_one_in_another_order(scheduler):
    first = scheduler.submit(rag(["p02", "p05"]), blend=True).result(timeout=300)
    assert first.mode == "blend" and "0 of 3 segments reused" in first.notes and first.text
    assert scheduler.drain(60)
    second = scheduler.submit(rag(["p05", "p02"]), blend=True).result(timeout=300)   # each where the other stood
    assert "3 of 3 segments reused" in second.notes and second.tier == "L1"
    assert second.matched_tokens > 0.8 * second.prompt_tokens
    assert second.prefill_tokens == second.prompt_tokens - second.matched_tokens

    # an exact request for the same prompt: no blended cells shared, no blended objects found
    exact = scheduler.submit(rag(["p05", "p02"])).result(timeout=300)
    assert exact.mode == "lmcache"
    assert exact.matched_tokens < 64   # the instruction (and template) of a resident exact prompt at most
    assert scheduler.snapshot()["counters"]["blend_reused_tokens"] >= second.matched_tokens


def test_a_blend_request_without_passages_runs_as_usual(scheduler):
    record = scheduler.submit([{"role": "user", "content": "Name a mountain."}], blend=True).result(timeout=120)
    assert record.mode == "lmcache" and "ran as lmcache" in record.notes


def test_the_deviation_rule_runs_through_the_scheduler(make_module_settings):
    """KVB_BLEND_RECOMPUTE_AT=deviation on the scheduler's context: the selection pass (a context of its own)
    picks the tokens, recomputed through the scheduler's free sequences; the record says how many and why."""
    settings = make_module_settings(ctx_size=2048, sched_kv_cells=4096, sched_max_running=2, sched_cached_prefixes=2,
                                    n_predict=8, blend_recompute_at="deviation", blend_recompute_ratio=0.2)
    with Scheduler(settings) as s:
        s.submit(rag(["p03", "p07", "p09"]), blend=True).result(timeout=300)
        assert s.drain(60)
        record = s.submit(rag(["p09", "p03", "p07"]), blend=True).result(timeout=300)
    assert not record.error, record.error
    assert "4 of 4 segments reused" in record.notes and "the most deviant by the selection pass" in record.notes
    assert record.blend_drift is not None and record.blend_drift > 0 and not record.blend_fallback
    assert record.text and record.prefill_tokens == record.prompt_tokens - record.matched_tokens


def test_serve_blends_on_the_header_and_names_a_bad_value():
    pytest.importorskip("openai", reason="the openai SDK is not installed (requirements.txt)")
    import tempfile
    from pathlib import Path

    # blend trades exactness for reuse, so it runs only with exact mode off (serve's default is on: issue 47)
    served = Served(Path(tempfile.mkdtemp(prefix="kvb-blend-serve-")), "blend", KVB_CTX_SIZE="2048",
                    KVB_SCHED_KV_CELLS="4096", KVB_SCHED_EXACT="false").start()
    try:
        client = served.client()
        answers = []
        for passages in (["p03", "p07"], ["p07", "p03"]):
            raw = client.chat.completions.with_raw_response.create(
                model="x", temperature=0, max_tokens=12, messages=rag(passages),
                extra_headers={"X-KVBridge-Blend": "on"})
            answers.append((raw.parse(), raw.headers["X-KVBridge-Tier"]))
        (cold, _), (warm, tier) = answers
        assert cold.usage.prompt_tokens_details.cached_tokens < 64
        assert warm.usage.prompt_tokens_details.cached_tokens > 0.7 * warm.usage.prompt_tokens and tier == "L1"
        bad = requests.post(served.url + "/v1/chat/completions", headers={"X-KVBridge-Blend": "yes"},
                            json={"model": "x", "messages": rag(["p03"]), "max_tokens": 4}, timeout=60)
        assert bad.status_code == 400 and "X-KVBridge-Blend" in bad.json()["error"]["message"]
        assert bad.json()["error"]["param"] == "X-KVBridge-Blend"
    finally:
        assert served.stop() == 0
