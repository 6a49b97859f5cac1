"""llama-server's own endpoints on a real `kvbridge serve` (issue 49 part 2), called as llama-server's clients call
them, with plain HTTP: /completion (whole and streamed, a prompt of text or of token ids, the second request's
`tokens_cached` showing the reuse), /tokenize with llama-server's body and /detokenize back, /props, /slots,
/v1/health. Greedy answers from a prompt of ids equal those from its text.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from conftest import needs_model
from kvbridge.settings import EMBEDDED_MODEL_PATH
from process_helpers import free_port

PROJECT = Path(__file__).resolve().parents[1]
DOCUMENT = " ".join(f"Pump {i} in the north hall runs {i + 2} hours a day and holds {i * 40} litres." for i in range(12))


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama-api")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVB_", "LLAMA_ARG_"))}
    env.update(KVB_L2_DIR=str(tmp / "l2"), KVB_OUTPUT_DIR=str(tmp / "output"), KVB_CHUNK_SIZE="16",
               KVB_THREADS="1", KVB_SERVE_MAX_TOKENS="64", PYTHONPATH=str(PROJECT))
    log_path = tmp / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvbridge", "serve", "-m", str(EMBEDDED_MODEL_PATH),
                                 "-c", "2048", "--port", str(port)], cwd=tmp, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "KVBridge serve ready on" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


@needs_model
def test_completion_whole_then_reused_and_from_token_ids(serve):
    body = {"prompt": DOCUMENT + "\nQuestion: how long does pump 3 run?\nAnswer:", "n_predict": 8,
            "temperature": 0, "cache_prompt": True, "id_slot": -1}
    first = requests.post(f"{serve}/completion", json=body, timeout=300)
    assert first.status_code == 200, first.text
    first = first.json()
    assert first["stop"] is True and first["content"] and 1 <= first["tokens_predicted"] <= 8
    assert first["stop_type"] in ("eos", "limit") and first["timings"]["prompt_n"] == first["tokens_evaluated"]
    again = requests.post(f"{serve}/completion", json={**body, "prompt": body["prompt"].replace("pump 3 run", "pump 5 run")},
                          timeout=300).json()
    assert again["tokens_cached"] > 100 and again["timings"]["cache_n"] == again["tokens_cached"]
    assert again["timings"]["prompt_n"] == again["tokens_evaluated"] - again["tokens_cached"]
    ids = requests.post(f"{serve}/tokenize", json={"content": body["prompt"], "add_special": True}, timeout=60).json()
    assert all(isinstance(t, int) for t in ids["tokens"])
    text = requests.post(f"{serve}/detokenize", json={"tokens": ids["tokens"]}, timeout=60).json()["content"]
    assert body["prompt"] in text
    from_ids = requests.post(f"{serve}/completion", json={**body, "prompt": ids["tokens"]}, timeout=300).json()
    assert from_ids["content"] == first["content"]


@needs_model
def test_completion_streams_pieces_then_the_counts(serve):
    with requests.post(f"{serve}/completion", json={"prompt": "The capital of France is", "n_predict": 6,
                                                   "temperature": 0, "stream": True}, stream=True, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len(b"data: "):]) for line in r.iter_lines() if line.startswith(b"data: ")]
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] >= 1
    assert all(e["stop"] is False for e in events[:-1]) and "".join(e["content"] for e in events[:-1])


@needs_model
def test_props_slots_health_and_refusals(serve):
    props = requests.get(f"{serve}/props", timeout=60).json()
    assert props["default_generation_settings"]["n_ctx"] == 2048 and props["total_slots"] >= 1
    assert props["model_path"] == str(EMBEDDED_MODEL_PATH) and props["chat_template"]
    slots = requests.get(f"{serve}/slots", timeout=60).json()
    assert len(slots) == props["total_slots"] and all(s["n_ctx"] == 2048 for s in slots)
    assert requests.get(f"{serve}/v1/health", timeout=60).json()["status"] == "ok"
    refused = requests.post(f"{serve}/completion", json={"prompt": "x", "grammar": "root ::= \"a\""}, timeout=60)
    assert refused.status_code == 400 and "grammar" in refused.text
    bad = requests.post(f"{serve}/completion", json={"prompt": "x", "n_predict": 0}, timeout=60)
    assert bad.status_code == 400 and "n_predict" in bad.text
    past = requests.post(f"{serve}/detokenize", json={"tokens": [10 ** 9]}, timeout=60)
    assert past.status_code == 400 and "vocabulary" in past.text
