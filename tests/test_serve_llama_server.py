"""`serve --engine llama-server`: CachedEngine in lmcache mode over a real llama-server behind the same
OpenAI endpoint (requests queued), with the openai SDK as the client; and the shadow engines refused.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from kvbridge.settings import WORK_DIR
from process_helpers import clean_env, free_port
from test_llama_server import pytestmark  # noqa: F401  (the same live marker and skip conditions)
from test_llama_server import server_binary_and_no_orphans  # noqa: F401  (autouse: build if needed, no orphans)
from test_serve import Served, short_doc_messages


def test_serve_through_llama_server_restores_the_document_and_answers_as_cold(tmp_path):
    # one llama.cpp thread: on a shared 2-core machine two spinning threads slow llama-server down tenfold
    served = Served(tmp_path, "serve-ls", KVB_SERVE_ENGINE="llama-server", KVB_THREADS="1").start()
    try:
        client = served.client()
        assert served.health()["engine"] == "llama-server"
        cold = client.chat.completions.create(model="x", temperature=0, max_tokens=16, messages=short_doc_messages())
        raw = client.chat.completions.with_raw_response.create(model="x", temperature=0, max_tokens=16,
                                                               messages=short_doc_messages())
        warm = raw.parse()
        assert warm.usage.prompt_tokens_details.cached_tokens >= warm.usage.prompt_tokens - 32
        assert raw.headers["X-KVBridge-Tier"] in ("L1", "L2")
        assert warm.choices[0].message.content == cold.choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="x", temperature=0, max_tokens=16, messages=short_doc_messages(), stream=True) if c.choices)
        assert streamed == cold.choices[0].message.content
        with pytest.raises(Exception) as top_p:
            client.chat.completions.create(model="x", top_p=0.5, messages=[{"role": "user", "content": "Hi"}])
        assert getattr(top_p.value, "status_code", None) == 400 and "top_p" in str(top_p.value)
    finally:
        assert served.stop() == 0


@pytest.mark.parametrize("engine", ["ollama", "cloud"])
def test_a_shadow_engine_is_refused_with_a_reason(tmp_path, engine):
    done = subprocess.run([sys.executable, "-m", "kvbridge", "serve", "--engine", engine, "--port", str(free_port())],
                          cwd=WORK_DIR, env=clean_env(KVB_L2_DIR=str(tmp_path / "l2")), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "shadow engine" in done.stderr and "--engine scheduler" in done.stderr
