"""The timing side channel between tenants (kvbridge.bench.probes.tenant_timing), run small: a real `serve`
with a victim, an attacker (another tenant) and an insider (the victim's cache group), the official
openai SDK as their client. The attacker's probes reuse nothing of the victim's (the contract, exact);
its ROC AUC stays near chance, while the insider's, where reuse is on purpose, shows the channel.

Why these thresholds cannot flake: with no channel, the AUC of 20 cached against 20 uncached probes
has a standard deviation of sqrt(41 / (12 * 400)) = 0.092 around 0.5, so an attacker figure outside
0.15-0.85 (3.8 deviations) comes by chance about once in 7,000 runs; a leak like the one the insider
sees (a hit ~10x faster than a prefill) puts it near 1.0. The insider's own AUC is near 1.0 whenever
a hit is faster than a cold prefill, which on this model it is by an order of magnitude.
"""
from __future__ import annotations

import pytest

from conftest import needs_model
from kvbridge.bench.probes.tenant_timing import format_report, ks_test, roc_auc, run_tenant_timing

pytest.importorskip("openai", reason="the openai SDK is not installed (requirements.txt)")


def test_the_statistics_on_hand_computed_cases():
    assert roc_auc([1, 2], [3, 4]) == 1.0 and roc_auc([3, 4], [1, 2]) == 0.0
    assert roc_auc([1, 3], [2, 4]) == 0.75 and roc_auc([2, 2], [2, 2]) == 0.5   # ties count half
    d, p = ks_test([1, 2, 3, 4], [5, 6, 7, 8])
    assert d == 1.0 and p < 0.05
    d, p = ks_test([1, 3, 5, 7], [2, 4, 6, 8])
    assert d == 0.25 and p > 0.9


@needs_model
@pytest.mark.timeout(600)
def test_another_tenant_cannot_tell_cached_documents_by_their_ttft(make_settings):
    result = run_tenant_timing(make_settings(serve_max_tokens=4), documents=40, words=40, seed=3)
    attacker, insider = result["attacker"], result["insider"]
    report = format_report(result)
    # the contract: the attacker reuses only its own chat template head (and, at most, a word or two that
    # one of its earlier probes opened with too), never the document the victim cached; the insider
    # reuses the whole document
    assert attacker["reused_cached_max"] < attacker["prompt_tokens_min"] // 2, report
    assert insider["reused_cached_max"] >= insider["prompt_tokens_min"] - 2, report
    assert 0.15 <= attacker["auc"] <= 0.85, report
    assert insider["auc"] >= 0.9, report


@needs_model
@pytest.mark.timeout(600)
def test_another_tenant_reads_the_same_miss_whether_or_not_a_document_is_held(make_settings):
    """The miss oracle (kvbridge.bench.probes.miss_oracle), run small: every answer bob gets reads the same but
    for numbers, whether alice holds the document or nobody does (its text AUC is then exactly chance)."""
    from kvbridge.bench.probes.miss_oracle import format_report as oracle_report, run_miss_oracle, text_auc

    assert text_auc(["a", "a"], ["b", "b"]) == 1.0 and text_auc(["a", "b"], ["a", "b"]) == 0.5
    result = run_miss_oracle(make_settings(serve_max_tokens=4), documents=12, words=40, seed=5)
    bob = result["bob"]
    report = oracle_report(result) + "\n" + "\n".join(bob["examples"])
    assert bob["readings"] == 1 and bob["text_auc"] == 0.5, report
    assert bob["reused_held_max"] == 0, report   # and nothing of alice's was reused (trust II's contract)
