"""Tenants in `serve`, as people use them: several API keys in a tenants file (digests, never keys), the
official openai SDK as the client. A tenant's first request for another tenant's document is a cold
prefill (cached_tokens 0, no tier): no cells shared, no stored KV found, so TTFT tells nothing of what
another tenant asked (vLLM's CVE-2025-46570); a tenant reuses its own, a declared cache group shares on
purpose, a request's own `cache_salt` keeps even one tenant's requests apart; usage per tenant in /metrics.
Who sees what: a tenant's /metrics holds only its own series and does not move with another tenant's
requests; every tenant, the global counters and the engine's state only with the operator's key
(KVB_SERVE_ADMIN_KEY_ENV); /health says only "ok" to anyone else.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import requests

from conftest import needs_model
from kvbridge.serve.tenants import key_digest
from kvbridge.settings import WORK_DIR
from test_serve import Served, short_doc_messages

openai = pytest.importorskip("openai", reason="the openai SDK is not installed (requirements.txt)")
pytestmark = [needs_model, pytest.mark.timeout(600)]

KEYS = {"alice": "key-of-alice", "bob": "key-of-bob", "carol": "key-of-carol", "dave": "key-of-dave"}
ADMIN_KEY = "key-of-the-operator"
LONG_GROUP = "g" * 64     # the longest group name: with a 200-character cache_salt, past the scheduler's 256


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.json"
    path.write_text(json.dumps({"tenants": [
        {"name": "alice", "key_sha256": key_digest(KEYS["alice"])},
        {"name": "bob", "key_sha256": key_digest(KEYS["bob"])},
        {"name": "carol", "key_sha256": key_digest(KEYS["carol"]), "cache_group": "alice"},
        {"name": "dave", "key_sha256": key_digest(KEYS["dave"]), "cache_group": LONG_GROUP},
    ]}))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory, tenants_file):
    # exact mode: one tenant's cold answer equals another's whatever cells the first left resident (with the mode
    # off llama.cpp rounds a sequence by the cells beside it, and two cold answers differed in a full run);
    # a warm request then reuses up to a 32-token cut that leaves 32 or more to compute (so "- 64" below)
    server = Served(tmp_path_factory.mktemp("serve-tenants"), "tenants",
                    KVB_SERVE_TENANTS_FILE=str(tenants_file), KVB_SERVE_ADMIN_KEY_ENV="SERVE_TEST_ADMIN_KEY",
                    SERVE_TEST_ADMIN_KEY=ADMIN_KEY, KVB_SCHED_EXACT="1").start()
    yield server
    assert server.stop() == 0


def ask(served, who: str, **extra):
    raw = served.client(KEYS[who]).chat.completions.with_raw_response.create(
        model="x", temperature=0, max_tokens=16, messages=short_doc_messages(), **extra)
    return raw.parse(), raw.headers["X-KVBridge-Tier"]


def test_each_tenant_reuses_only_its_own_cache_or_its_groups(served):
    alice_cold, tier = ask(served, "alice")
    assert alice_cold.usage.prompt_tokens_details.cached_tokens < 64
    alice_warm, tier = ask(served, "alice")
    document_tokens = alice_warm.usage.prompt_tokens - 64
    assert alice_warm.usage.prompt_tokens_details.cached_tokens >= document_tokens and tier != "none"

    bob, tier = ask(served, "bob")                     # alice's document, resident and stored: cold for bob
    assert bob.usage.prompt_tokens_details.cached_tokens == 0 and tier == "none"
    assert bob.choices[0].message.content == alice_cold.choices[0].message.content
    bob_again, tier = ask(served, "bob")               # and bob's own cache works
    assert bob_again.usage.prompt_tokens_details.cached_tokens >= document_tokens

    carol, tier = ask(served, "carol")                 # declared to share alice's cache
    assert carol.usage.prompt_tokens_details.cached_tokens >= document_tokens

    salted, tier = ask(served, "alice", extra_body={"cache_salt": "a private conversation"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0 and tier == "none"

    metrics = metrics_text(served, ADMIN_KEY)             # the operator sees every tenant
    assert 'kvbridge_serve_tenant_requests_total{tenant="bob"} 2.0' in metrics
    assert 'kvbridge_serve_tenant_requests_total{tenant="alice"} 3.0' in metrics
    assert 'kvbridge_serve_tenant_cached_tokens_total{tenant="carol"}' in metrics
    own = metrics_text(served, KEYS["alice"])             # alice sees herself only
    assert 'kvbridge_serve_tenant_requests_total{tenant="alice"} 3.0' in own and 'tenant="bob"' not in own

    def bytes_held(tenant: str) -> float:   # the prompts' KV is stored behind the answers: wait for it
        text = metrics_text(served, ADMIN_KEY)
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(f'kvbridge_serve_tenant_bytes_held{{tenant="{tenant}"'))

    deadline = time.monotonic() + 60
    while not (bytes_held("bob") > 0 and bytes_held("alice") > bytes_held("bob")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert 0 < bytes_held("bob") < bytes_held("alice")   # alice's salted request is stored apart, also hers
    assert bytes_held("carol") > 0        # her group's (alice's) cache, shown for her too


def metrics_text(served, key: str | None) -> str:
    response = requests.get(served.url + "/metrics", timeout=10,
                            headers={"Authorization": f"Bearer {key}"} if key else {})
    assert response.status_code == 200, response.text
    return response.text


def series(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_a_tenants_metrics_do_not_move_with_another_tenants_requests(served):
    """alice's /metrics, read before and after bob's requests (cold, a hit, a refusal, a salted one) and
    carol's (alice's own cache group, hitting it), is the same text; it counts her own completions only
    (not her reads of /metrics or /v1/models) and holds no global, process, engine or store series."""
    def alice_asks() -> None:
        served.client(KEYS["alice"]).completions.create(model="x", prompt="The word is pear. The word is",
                                                        temperature=0, max_tokens=2)

    alice_asks()
    before = metrics_text(served, KEYS["alice"])
    for who in ("bob", "bob", "carol"):
        ask(served, who)
    ask(served, "bob", extra_body={"cache_salt": "bob's own"})
    with pytest.raises(openai.BadRequestError):
        served.client(KEYS["bob"]).chat.completions.create(model="x", max_tokens=4, n=2, messages=short_doc_messages())
    served.client(KEYS["alice"]).models.list()
    metrics_text(served, KEYS["alice"])
    after = metrics_text(served, KEYS["alice"])
    assert after == before
    assert series(after) and all('tenant="alice"' in line for line in series(after)), after
    for absent in ("kvbridge_serve_engine", "process_", "python_", "bytes_held", "kvbridge_serve_cached_tokens_total",
                   "kvbridge_serve_requests_total", "ttft"):
        assert absent not in after, absent
    requests_line = next(line for line in series(after) if line.startswith("kvbridge_serve_tenant_requests_total"))
    alice_asks()                                          # her own completion is counted
    grown = next(line for line in series(metrics_text(served, KEYS["alice"]))
                 if line.startswith("kvbridge_serve_tenant_requests_total"))
    assert float(grown.rsplit(" ", 1)[1]) == float(requests_line.rsplit(" ", 1)[1]) + 1

    everything = metrics_text(served, ADMIN_KEY)          # the operator: every tenant, the globals, the engine
    for present in ('tenant="bob"', 'tenant="carol"', "kvbridge_serve_cached_tokens_total",
                    'kvbridge_serve_requests_total{endpoint="chat",status="400"}', "kvbridge_serve_engine"):
        assert present in everything, present


def test_health_says_only_up_to_all_but_the_operator(served):
    for key in (None, KEYS["alice"], "not-a-key"):
        response = requests.get(served.url + "/health", timeout=10,
                                headers={"Authorization": f"Bearer {key}"} if key else {})
        assert response.status_code == 200 and response.json() == {"status": "ok"}, key
    full = requests.get(served.url + "/health", timeout=10, headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert full["status"] == "ok" and {"running", "waiting", "swapped", "free_blocks"} <= set(full)
    with pytest.raises(openai.PermissionDeniedError) as refused:   # the operator's key runs no completions
        served.client(ADMIN_KEY).chat.completions.create(model="x", max_tokens=4, messages=short_doc_messages())
    assert "KVB_SERVE_ADMIN_KEY_ENV" in refused.value.body["message"]
    assert ADMIN_KEY not in served.log.read_text()


def test_the_longest_group_and_cache_salt_are_served_and_kept_apart(served):
    """dave's group name (64 characters) and a 200-character cache_salt compose past the scheduler's
    256: the request is answered (it was a 400 saying 'at most 256 characters'), its own salt reuses
    its cache, and another long salt does not."""
    salt = "s" * 199
    first, _ = ask(served, "dave", extra_body={"cache_salt": salt + "1"})
    again, _ = ask(served, "dave", extra_body={"cache_salt": salt + "1"})
    other, tier = ask(served, "dave", extra_body={"cache_salt": salt + "2"})
    document_tokens = again.usage.prompt_tokens - 64
    assert again.usage.prompt_tokens_details.cached_tokens >= document_tokens
    assert other.usage.prompt_tokens_details.cached_tokens == 0 and tier == "none"
    assert other.choices[0].message.content == first.choices[0].message.content


def test_keys_that_are_no_tenants_are_refused(served):
    for key in ("", "not-a-key", KEYS["alice"] + "x"):
        response = requests.post(served.url + "/v1/chat/completions", timeout=10,
                                 headers={"Authorization": f"Bearer {key}"} if key else {},
                                 json={"model": "x", "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 401 and "KVB_SERVE_TENANTS_FILE" in response.json()["error"]["message"]
    bad = requests.post(served.url + "/v1/chat/completions", timeout=10,
                        headers={"Authorization": f"Bearer {KEYS['bob']}"},
                        json={"model": "x", "messages": [{"role": "user", "content": "hi"}], "cache_salt": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_a_tenants_file_holding_a_key_in_clear_stops_the_start_naming_it(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [{"name": "alice", "key_sha256": "key-of-alice"}]}))
    served = Served(tmp_path, "clear-key", KVB_SERVE_TENANTS_FILE=str(path))
    from process_helpers import start_kvbridge

    proc = start_kvbridge(["serve"], served.env, served.log)
    assert proc.wait(timeout=120) != 0
    text = served.log.read_text()
    assert "KVB_SERVE_TENANTS_FILE" in text and "tenants[0]" in text and "never the key itself" in text
    assert "key-of-alice" not in text.replace(str(path), "")


def test_the_digest_command():
    done = subprocess.run([sys.executable, "-m", "kvbridge.serve.tenants", "digest"], input="key-of-bob\n",
                          capture_output=True, text=True, cwd=WORK_DIR, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == key_digest("key-of-bob")


def test_the_tenant_benchmark_runs_and_shows_the_isolation(make_settings):
    """kvbridge.bench.probes.tenant_bench with one small document: bob's request reuses nothing of alice's,
    alice's second and carol's (her group) reuse the document."""
    from kvbridge.bench.probes.tenant_bench import format_report, run_tenant_bench

    result = run_tenant_bench(make_settings(serve_max_tokens=16), documents=1, doc_chars=600)
    assert result["bob (other tenant)"]["cached_tokens"] == [0]
    prompt = result["alice cold"]["prompt_tokens"][0]
    assert result["alice warm"]["cached_tokens"][0] >= prompt - 32
    assert result["carol (alice's group)"]["cached_tokens"][0] >= prompt - 32
    assert "bob (other tenant)" in format_report(result)


def test_the_labs_tenant_table_shows_each_tenants_usage():
    """What `gui --serve` shows under the lab's queues: ServeMetrics.tenant_usage, per tenant."""
    from kvbridge.engine.records import RequestRecord
    from kvbridge.gui.lab import tenants_markdown
    from kvbridge.serve.metrics import ServeMetrics

    metrics = ServeMetrics()
    metrics.finished("chat", RequestRecord("scheduler", prompt_tokens=900, matched_tokens=0), "alice", "group:alice")
    metrics.finished("chat", RequestRecord("scheduler", prompt_tokens=900, matched_tokens=896), "alice", "group:alice")
    metrics.finished("chat", RequestRecord("scheduler", prompt_tokens=900, matched_tokens=0), "bob", "group:bob")
    usage = metrics.tenant_usage({"group:alice": {"L1": 3 << 20, "L2": 3 << 20}, "group:bob": {"L1": 1 << 20}})
    assert usage["alice"] == {"requests": 2, "prompt_tokens": 1800, "cached_tokens": 896, "completion_tokens": 0,
                              "bytes_held": {"L1": 3 << 20, "L2": 3 << 20}}
    assert usage["bob"]["bytes_held"] == {"L1": 1 << 20}
    table = tenants_markdown(usage)
    assert "| alice | 2 | 1800 | 896 | L1 3.0 MiB, L2 3.0 MiB |" in table and "| bob | 1 | 900 | 0 | L1 1.0 MiB |" in table


def test_a_tenant_cannot_name_its_way_into_the_unsalted_cache(tmp_path):
    """cache_group "default" used to give the empty salt: the cache of the single key, the GUI and the CLI."""
    from kvbridge.errors import BadSettings
    from kvbridge.serve.tenants import DEFAULT, Tenant, TenantTable

    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": [
        {"name": "mallory", "key_sha256": key_digest("key-of-mallory"), "cache_group": "default"}]}))
    with pytest.raises(BadSettings, match=r"tenants\[0\] \(mallory\): cache_group 'default' .*unsalted"):
        TenantTable.load(path)
    assert Tenant("mallory", "default").cache_salt() == "group:default"   # only `default` itself is unsalted
    assert DEFAULT.cache_salt() == "" and DEFAULT.cache_salt("x") == "|request:x"


def test_a_composed_salt_never_exceeds_the_schedulers_limit():
    from kvbridge.serve.tenants import MAX_CACHE_SALT_CHARS, Tenant

    tenant = Tenant("dave", LONG_GROUP)
    salts = {tenant.cache_salt(s) for s in ("a" * 200, "b" * 200, "a" * 199)}
    assert len(salts) == 3 and all(len(s) <= MAX_CACHE_SALT_CHARS for s in salts)
    assert tenant.cache_salt("short") == f"group:{LONG_GROUP}|request:short"   # short salts as they always were


def test_the_operator_key_must_be_its_own(tenants_file):
    from kvbridge.errors import BadSettings
    from kvbridge.serve.server import tenants_from
    from kvbridge.settings import Settings

    settings = Settings(serve_tenants_file=str(tenants_file), serve_admin_key_env="ADMIN")
    table = tenants_from(settings, {"ADMIN": ADMIN_KEY})
    assert table.resolve(ADMIN_KEY.encode()).operator and not table.resolve(KEYS["bob"].encode()).operator
    with pytest.raises(BadSettings, match="KVB_SERVE_ADMIN_KEY_ENV"):
        tenants_from(settings, {"ADMIN": KEYS["bob"]})
    with pytest.raises(BadSettings, match="KVB_SERVE_ADMIN_KEY_ENV names ADMIN, but that variable is empty"):
        tenants_from(settings, {})
    assert any("KVB_SERVE_ADMIN_KEY_ENV" in p for p in Settings(serve_admin_key_env="sk-live key").validate())


def test_the_metrics_state_stays_bounded_whatever_salts_and_tenants_come():
    """Salts are client-chosen (200 characters, no key needed by default): none becomes a key of the
    metrics' state; tenants beyond TENANTS_KEPT forget the least recently served."""
    from kvbridge.engine.records import RequestRecord
    from kvbridge.serve.metrics import TENANTS_KEPT, ServeMetrics

    assert TENANTS_KEPT >= 256
    metrics = ServeMetrics()
    record = RequestRecord("scheduler", prompt_tokens=10, matched_tokens=0)
    for i in range(5000):
        metrics.finished("chat", record, "default", f"|request:{i}")
    assert metrics.tenants_held == 1 and metrics.counts("default").requests == 5000

    small = ServeMetrics(tenants_kept=256)
    for i in range(300):
        small.finished("chat", record, f"t{i}", f"group:t{i}")
        small.finished("chat", record, "t0", "group:t0")         # t0 stays recently served
    assert small.tenants_held == 256
    assert small.counts("t0").requests == 301 and small.counts("t1").requests == 0   # t1 was reclaimed
    assert small.counts("t299").requests == 1
