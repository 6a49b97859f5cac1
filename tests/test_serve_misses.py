"""Why a prompt missed, as a client of `serve` sees it (issue 35): a real serve process on loopback (the
embedded model, the scheduler), the official openai SDK. `X-KVBridge-Miss` beside `X-KVBridge-Tier` on whole
and streamed answers, `usage.kvbridge` (miss_reason, miss_detail, hit_tiers) in both; a tenant is never told
of KV stored under another salt (a salted tenant asking what the unsalted cache holds sees none_stored, not
other_namespace) nor shown another prompt's text; /metrics counts misses by reason and hit tokens by tier,
to the operator and to each tenant its own.
"""
from __future__ import annotations

import json

import pytest
import requests

from conftest import needs_model
from kvbridge.serve.tenants import key_digest
from process_helpers import wait_for
from test_serve import Served, short_doc_messages

openai = pytest.importorskip("openai", reason="the openai SDK is not installed (requirements.txt)")
pytestmark = [needs_model, pytest.mark.timeout(600)]

DEFAULT_KEY, ALICE_KEY, ADMIN_KEY = "key-of-the-default-tenant", "key-of-alice", "key-of-the-operator"
BOB_KEY = "key-of-bob"
LONG_QUESTION = "Which orchards are pruned by crew 2, and in which weeks of the season does that happen?"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-misses")
    tenants = folder / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [{"name": "alice", "key_sha256": key_digest(ALICE_KEY)},
                                               {"name": "bob", "key_sha256": key_digest(BOB_KEY)}]}))
    server = Served(folder, "misses", KVB_SERVE_TENANTS_FILE=str(tenants),
                    KVB_SERVE_API_KEY_ENV="MISSES_TEST_KEY", MISSES_TEST_KEY=DEFAULT_KEY,
                    KVB_SERVE_ADMIN_KEY_ENV="MISSES_TEST_ADMIN_KEY", MISSES_TEST_ADMIN_KEY=ADMIN_KEY,
                    # the mode off: these counts and texts are the mode off's (exact mode's own misses: tests in
                    # test_scheduler_exact.py and test_serve.py; its operator count of bob's cause: open, Research §29)
                    KVB_SCHED_EXACT="false").start()
    yield server
    assert server.stop() == 0


def ask(served, key: str, messages: list[dict]):
    """(headers, usage as a dict) of a whole answer."""
    raw = served.client(key).chat.completions.with_raw_response.create(model="x", temperature=0, max_tokens=4,
                                                                      messages=messages)
    return raw.headers, raw.parse().usage.model_dump()


def ask_streamed(served, key: str, messages: list[dict]):
    """(headers, usage as a dict) of a streamed answer, the usage from its last chunk."""
    raw = served.client(key).chat.completions.with_raw_response.create(
        model="x", temperature=0, max_tokens=4, messages=messages, stream=True, stream_options={"include_usage": True})
    usage = [chunk.usage for chunk in raw.parse() if chunk.usage is not None]
    assert len(usage) == 1
    return raw.headers, usage[0].model_dump()


def metrics_text(served, key: str) -> str:
    answer = requests.get(served.url + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert answer.status_code == 200
    return answer.text


def unsalted_bytes(served) -> float:
    """What the store holds in the unsalted cache (its writer runs at low priority: on a busy machine a while)."""
    return bytes_held(served, "default")


def bytes_held(served, tenant: str) -> float:
    held = [float(line.rsplit(" ", 1)[1]) for line in metrics_text(served, ADMIN_KEY).splitlines()
            if line.startswith(f'kvbridge_serve_tenant_bytes_held{{tenant="{tenant}"')]
    return sum(held)


def value(text: str, series: str) -> float:
    found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " ")]
    assert found, f"{series} is not in /metrics"
    return found[0]


def test_the_header_and_the_usage_name_each_miss_and_each_hit(served):
    headers, usage = ask(served, DEFAULT_KEY, short_doc_messages())
    assert headers["X-KVBridge-Miss"] == "none_stored" and headers["X-KVBridge-Tier"] == "none"
    assert usage["kvbridge"]["miss_reason"] == "none_stored" and usage["kvbridge"]["hit_tiers"] == {}
    assert usage["kvbridge"]["miss_detail"].startswith(f"from token 0 of {usage['prompt_tokens']}: nothing is stored")

    headers, usage = ask_streamed(served, DEFAULT_KEY, short_doc_messages())   # resident now: shared, a hit
    assert headers["X-KVBridge-Miss"] == "hit" and headers["X-KVBridge-Tier"] == "resident"
    reused = usage["prompt_tokens"] - 1                                  # the last token is always computed
    assert usage["prompt_tokens_details"]["cached_tokens"] == reused
    assert usage["kvbridge"] == {"miss_reason": "hit", "miss_detail": "", "hit_tiers": {"context": reused}}

    headers, usage = ask(served, DEFAULT_KEY, short_doc_messages(LONG_QUESTION))   # the document again, a new question
    detail = usage["kvbridge"]["miss_detail"]
    assert headers["X-KVBridge-Miss"] == "diverged" and usage["kvbridge"]["miss_reason"] == "diverged", detail
    assert usage["kvbridge"]["hit_tiers"] == {"context": usage["prompt_tokens_details"]["cached_tokens"]}
    assert "diverges from a stored prompt at token" in detail and "here …" in detail
    assert "stored …" not in detail     # a tenant of a server with keys is not shown the stored prompt's text


def test_a_salted_tenant_never_learns_of_the_unsalted_cache(served):
    ask(served, DEFAULT_KEY, short_doc_messages())                   # resident in the unsalted cache, and stored:
    wait_for(lambda: unsalted_bytes(served) > 0, "the unsalted prompt in the store", served.log, served.proc, 120)
    headers, usage = ask(served, ALICE_KEY, short_doc_messages())    # alice's salt: none of it is hers
    assert headers["X-KVBridge-Miss"] == "none_stored" and headers["X-KVBridge-Tier"] == "none"
    assert usage["kvbridge"]["miss_reason"] == "none_stored"
    assert "cache_salt" not in usage["kvbridge"]["miss_detail"] and "namespace" not in usage["kvbridge"]["miss_detail"]

    alice = metrics_text(served, ALICE_KEY)
    assert value(alice, 'kvbridge_serve_tenant_misses_total{reason="none_stored",tenant="alice"}') == 1
    assert "other_namespace" not in alice and 'tenant="default"' not in alice


def test_metrics_count_misses_by_reason_and_hit_tokens_by_tier(served):
    operator = metrics_text(served, ADMIN_KEY)
    prompt = value(operator, "kvbridge_serve_prompt_tokens_total")
    context = value(operator, 'kvbridge_serve_hit_tokens_total{tier="context"}')
    assert 0 < context < prompt                       # a per-tier hit rate: hit tokens over prompt tokens
    assert value(operator, 'kvbridge_serve_misses_total{reason="none_stored"}') >= 1
    assert value(operator, 'kvbridge_serve_miss_tokens_total{reason="diverged"}') > 0
    assert value(operator, 'kvbridge_serve_misses_total{reason="evicted"}') == 0   # every cause present from the start
    assert value(operator, 'kvbridge_serve_tenant_hit_tokens_total{tenant="default",tier="context"}') == context
    assert value(operator, 'kvbridge_serve_tenant_misses_total{reason="none_stored",tenant="alice"}') == 1
    # what alice was shown as none_stored is, to the operator, what it was: stored under another salt's namespace
    # (probed only after her answer had left: counted a moment later)
    wait_for(lambda: value(metrics_text(served, ADMIN_KEY), 'kvbridge_serve_misses_total{reason="other_namespace"}')
             == 1, "the operator's count of the cause found after the answer", served.log, served.proc, 30)
    assert value(metrics_text(served, ADMIN_KEY), 'kvbridge_serve_misses_total{reason="none_stored"}') == 1


def test_what_a_tenant_is_not_shown_of_a_detail():
    """The redaction rules on records as the engines write them (kvbridge.serve.misses.client_view)."""
    from kvbridge.engine.records import RequestRecord
    from kvbridge.serve.misses import client_view, header_value

    def record(reason: str, detail: str) -> RequestRecord:
        return RequestRecord("scheduler", prompt_tokens=100, matched_tokens=64, miss_reason=reason,
                             miss_detail=detail, hit_tiers="L1=64")

    evicted = record("evicted", "from token 64 of 100: evicted from L1 by LRU 2.0 s ago to make room for a 1.2 MB "
                                "chunk (9f3a1c2b4d5e)")
    assert client_view(evicted, full=False).detail == "from token 64 of 100: evicted from L1 by LRU 2.0 s ago"
    assert client_view(evicted, full=True).detail == evicted.miss_detail
    down = record("tier_down", "from token 64 of 100: a tier that may hold it is unreachable (cache server: "
                               "tcp://10.0.0.7:5555: timed out after 2 s)")
    assert "10.0.0.7" not in client_view(down, full=False).detail
    salted = record("other_namespace", "from token 64 of 100: stored in L1 under another namespace; what differs: "
                                       "cache_salt none→3fa2c1d0e9b8…")
    for full in (False, True):       # another salt is hidden from everyone who asks through serve
        view = client_view(salted, full)
        assert view.reason == "none_stored" and "cache_salt" not in view.detail and view.hit_tiers == {"L1": 64}
    assert header_value(salted) == "none_stored" and header_value(None) == "pending"
    assert client_view(record("", ""), full=False).usage_fields() == {"miss_reason": "hit", "miss_detail": "",
                                                                       "hit_tiers": {"L1": 64}}


# -- a miss tells a tenant nothing of another's (issue 46) ---------------------------------------------------
HANDBOOK = ("Handbook of the east orchard crews: crew 1 prunes the apple rows in March, crew 2 the pears in April, "
            "crew 3 mends the fences and the irrigation lines before the first frost of the year.")
LEDGER = ("Ledger page of the west granary: forty sacks of barley arrived on Monday, twelve went to the mill on "
          "Tuesday, and the rest stay dry in the north loft until the buyers come in the spring.")


def normalized(raw) -> dict:
    """What bob can compare between two answers: the headers and usage.kvbridge, with every number as '#'
    (the prompts differ in length) and the headers that differ on every answer (Date, the body's length) left out."""
    import re

    def digits(text: str) -> str:
        return re.sub(r"[0-9]+(\.[0-9]+)?", "#", text)

    usage = raw.parse().usage.model_dump()
    headers = {k.lower(): digits(v) for k, v in raw.headers.items() if k.lower() not in ("date", "content-length")}
    return {"headers": headers, "kvbridge": json.loads(digits(json.dumps(usage["kvbridge"], sort_keys=True)))}


def test_bob_is_told_the_same_of_a_document_alice_holds_as_of_one_nobody_holds(served):
    alice, before = served.client(ALICE_KEY), bytes_held(served, "alice")
    alice.completions.create(model="x", prompt=HANDBOOK, temperature=0, max_tokens=2)
    wait_for(lambda: bytes_held(served, "alice") > before, "alice's document in the store", served.log, served.proc,
             120)
    bob = served.client(BOB_KEY)
    held, nobodys = (normalized(bob.completions.with_raw_response.create(model="x", prompt=doc, temperature=0,
                                                                          max_tokens=2))
                     for doc in (HANDBOOK, LEDGER))
    assert held == nobodys
    assert held["kvbridge"]["miss_reason"] == "none_stored" and held["headers"]["x-kvbridge-miss"] == "none_stored"
    # the text a real miss of bob's own namespace gives, not a sentence that only another salt's hit produces
    assert held["kvbridge"]["miss_detail"] == "from token # of #: nothing is stored under this prompt's first chunk"
    # the operator still counts the true cause of bob's first miss: alice's namespace holds the handbook
    wait_for(lambda: value(metrics_text(served, ADMIN_KEY), 'kvbridge_serve_misses_total{reason="other_namespace"}')
             == 2, "the operator's count of bob's true cause", served.log, served.proc, 30)
