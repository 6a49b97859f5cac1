"""`kvbridge serve` started as llama-server is started (issue 49 parts 1 and 2): LLAMA_API_KEY with two keys,
`-a` aliases, `-fa off -b 2048 -ub 512`, polled on /health from its first moment. While the model loads the socket
answers llama-server's 503 "Loading model"; then any of the keys is a client's, none is printed, the first alias is
the model's id, and /metrics carries llama-server's `llamacpp:*` names fed by the requests just served. Without a
process: the start line when -c exceeds the shared KV budget, and LLAMA_API_KEY's keys as serve reads them.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from conftest import needs_model
from kvbridge.errors import BadSettings
from kvbridge.settings import EMBEDDED_MODEL_PATH, Settings
from process_helpers import free_port

PROJECT = Path(__file__).resolve().parents[1]
KEYS = ("sk-llama-first-0123456789", "sk-llama-second-9876543210")
ADMIN = "sk-llama-operator-5555555555"
LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, f"{name} missing from /metrics"
    return float(found.group(1))


@needs_model
def test_serve_as_llama_server_starts_it(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVB_", "LLAMA_ARG_", "LLAMA_API_KEY"))}
    env.update(KVB_L2_DIR=str(tmp_path / "l2"), KVB_OUTPUT_DIR=str(tmp_path / "output"), KVB_THREADS="1",
               KVB_SERVE_MAX_TOKENS="16", PYTHONPATH=str(PROJECT), LLAMA_API_KEY=f" {KEYS[0]}, {KEYS[1]} ",
               KVB_SERVE_ADMIN_KEY_ENV="OPERATOR_KEY", OPERATOR_KEY=ADMIN)
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvbridge", "serve", "-m", str(EMBEDDED_MODEL_PATH),
                                 "-a", "my-model,gpt-4o-mini", "-fa", "off", "-b", "2048", "-ub", "512", "-c", "2048",
                                 "--port", str(port)], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    while_loading = []
    try:
        deadline = time.monotonic() + 180
        while "KVBridge serve ready on" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            try:
                answer = requests.get(f"{url}/health", timeout=5)
                if "KVBridge serve ready on" not in log_path.read_text():
                    while_loading.append((answer.status_code, answer.json()))
            except requests.ConnectionError:   # not bound yet: the settings are still being read
                pass
            time.sleep(0.05)
        assert while_loading and all(seen == (503, LOADING) for seen in while_loading), while_loading
        assert requests.get(f"{url}/v1/health", timeout=5).status_code == 200

        body = {"model": "gpt-4o-mini", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        refused = requests.post(f"{url}/v1/completions", json=body, timeout=120)
        assert refused.status_code == 401, refused.text
        for key in KEYS:   # either of LLAMA_API_KEY's keys is a client's
            done = requests.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                                 timeout=300)
            assert done.status_code == 200, done.text
            assert done.json()["model"] == "my-model" and done.json()["usage"]["completion_tokens"] >= 1
        models = requests.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=30).json()
        assert [(m["id"], m["aliases"]) for m in models["data"]] == [("my-model", ["my-model", "gpt-4o-mini"])]

        text = requests.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).text
        predicted = metric(text, "llamacpp:tokens_predicted_total")
        assert predicted == metric(text, "kvbridge_serve_completion_tokens_total") >= 2
        assert 0 < metric(text, "llamacpp:prompt_tokens_total") <= metric(text, "kvbridge_serve_prompt_tokens_total")
        assert metric(text, "llamacpp:prompt_seconds_total") > 0 and metric(text, "llamacpp:tokens_predicted_seconds_total") >= 0
        assert metric(text, "llamacpp:requests_processing") == 0 and metric(text, "llamacpp:requests_deferred") == 0
        assert "# TYPE llamacpp:prompt_tokens_total counter" in text and "# TYPE llamacpp:requests_processing gauge" in text
        tenant_view = requests.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEYS[1]}"}, timeout=30).text
        assert "llamacpp:" not in tenant_view   # process-wide counts are the operator's, as KVBridge's own are
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    said = log_path.read_text()
    assert code == 0, said
    assert not any(secret in said for secret in (*KEYS, ADMIN)), "a key was printed"


def test_a_context_past_the_shared_kv_budget_is_said_at_start():
    from kvbridge.serve.server import kv_budget_line

    line = kv_budget_line(Settings(ctx_size=16384, sched_kv_cells=8192), "scheduler")
    assert "16384 tokens (-c, KVB_CTX_SIZE)" in line and "8192 KV cells (KVB_SCHED_KV_CELLS)" in line
    assert kv_budget_line(Settings(ctx_size=4096, sched_kv_cells=8192), "scheduler") == ""
    assert kv_budget_line(Settings(ctx_size=16384, sched_kv_cells=8192), "llama-server") == ""   # no shared budget


def test_llama_api_key_is_read_by_name_split_as_llama_server_splits_it(monkeypatch, tmp_path):
    from kvbridge.cli.commands import build_parser
    from kvbridge.cli.common import settings_with_flags
    from kvbridge.serve.server import tenants_from

    monkeypatch.setenv("LLAMA_API_KEY", f"{KEYS[0]},{KEYS[1]}")
    settings = settings_with_flags("serve", build_parser().parse_args(["serve", "--host", "0.0.0.0"]))
    assert settings.serve_api_key_env == "LLAMA_API_KEY"   # its name is kept, so a key it holds suffices off loopback
    assert not any(key in repr(settings) for key in KEYS)
    table = tenants_from(settings)
    assert table.required and all(table.resolve(key.encode()).name == "default" for key in KEYS)
    assert table.resolve(b"sk-not-a-key") is None
    with pytest.raises(BadSettings, match="LLAMA_API_KEY is set but holds no key"):
        tenants_from(settings, {"LLAMA_API_KEY": " , "})
    tenants = tmp_path / "tenants.json"
    tenants.write_text("[]")
    with pytest.raises(BadSettings, match="LLAMA_API_KEY holds 2 keys and KVB_SERVE_TENANTS_FILE"):
        tenants_from(settings.replace(serve_tenants_file=str(tenants)))
    monkeypatch.delenv("LLAMA_API_KEY")
    assert settings_with_flags("serve", build_parser().parse_args(["serve"])).serve_api_key_env == ""
