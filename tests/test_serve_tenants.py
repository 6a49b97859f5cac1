"""Tenants in `serve`, as people use them: several API keys in a tenants file (digests, never keys), the
official openai SDK as the client. A tenant's first request for another tenant's document is a cold
prefill (cached_tokens 0, no tier): no cells shared, no stored KV found, so TTFT tells nothing of what
another tenant asked (vLLM's CVE-2025-46570); a tenant reuses its own, a declared cache group shares on
purpose, a request's own `cache_salt` keeps even one tenant's requests apart; usage per tenant in /metrics.
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
from kvbridge.settings import PROJECT_ROOT
from test_serve import DOCUMENT, Served, doc_messages

openai = pytest.importorskip("openai", reason="the openai SDK is not installed (requirements.txt)")
pytestmark = [needs_model, pytest.mark.timeout(600)]

KEYS = {"alice": "key-of-alice", "bob": "key-of-bob", "carol": "key-of-carol"}


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.json"
    path.write_text(json.dumps({"tenants": [
        {"name": "alice", "key_sha256": key_digest(KEYS["alice"])},
        {"name": "bob", "key_sha256": key_digest(KEYS["bob"])},
        {"name": "carol", "key_sha256": key_digest(KEYS["carol"]), "cache_group": "alice"},
    ]}))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory, tenants_file):
    server = Served(tmp_path_factory.mktemp("serve-tenants"), "tenants",
                    KVB_SERVE_TENANTS_FILE=str(tenants_file)).start()
    yield server
    assert server.stop() == 0


def ask(served, who: str, **extra):
    raw = served.client(KEYS[who]).chat.completions.with_raw_response.create(
        model="x", temperature=0, max_tokens=16, messages=doc_messages(), **extra)
    return raw.parse(), raw.headers["X-KVBridge-Tier"]


def test_each_tenant_reuses_only_its_own_cache_or_its_groups(served):
    alice_cold, tier = ask(served, "alice")
    assert alice_cold.usage.prompt_tokens_details.cached_tokens < 64
    alice_warm, tier = ask(served, "alice")
    document_tokens = alice_warm.usage.prompt_tokens - 24
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

    metrics = requests.get(served.url + "/metrics", timeout=10,
                           headers={"Authorization": f"Bearer {KEYS['alice']}"}).text
    assert 'kvbridge_serve_tenant_requests_total{tenant="bob"} 2.0' in metrics
    assert 'kvbridge_serve_tenant_requests_total{tenant="alice"} 3.0' in metrics
    assert 'kvbridge_serve_tenant_cached_tokens_total{tenant="carol"}' in metrics

    def bytes_held(tenant: str) -> float:   # the prompts' KV is stored behind the answers: wait for it
        text = requests.get(served.url + "/metrics", timeout=10,
                            headers={"Authorization": f"Bearer {KEYS['alice']}"}).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(f'kvbridge_serve_tenant_bytes_held{{tenant="{tenant}"'))

    deadline = time.monotonic() + 60
    while not (bytes_held("bob") > 0 and bytes_held("alice") > bytes_held("bob")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert 0 < bytes_held("bob") < bytes_held("alice")   # alice's salted request is stored apart, also hers
    assert bytes_held("carol") > 0        # her group's (alice's) cache, shown for her too


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
                          capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == key_digest("key-of-bob")


def test_the_tenant_benchmark_runs_and_shows_the_isolation(make_settings):
    """kvbridge.bench.tenant_bench with one small document: bob's request reuses nothing of alice's,
    alice's second and carol's (her group) reuse the document."""
    from kvbridge.bench.tenant_bench import format_report, run_tenant_bench

    result = run_tenant_bench(make_settings(serve_max_tokens=16), documents=1, doc_chars=1500)
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
    assert usage["alice"] == {"requests": 2, "prompt_tokens": 1800, "cached_tokens": 896,
                              "bytes_held": {"L1": 3 << 20, "L2": 3 << 20}}
    assert usage["bob"]["bytes_held"] == {"L1": 1 << 20}
    table = tenants_markdown(usage)
    assert "| alice | 2 | 1800 | 896 | L1 3.0 MiB, L2 3.0 MiB |" in table and "| bob | 1 | 900 | 0 | L1 1.0 MiB |" in table
