"""Engine independence, proven with real processes, the real model and a real cache server process.

1. An engine process stores a document's KV through the server and is SIGKILLed; a new engine
   process restores it from the server's L1, and its greedy answer equals the cold answer.
2. The in-process engine and llama-server, in two processes, share chunks through one server.
3. The server is SIGKILLed while an engine runs: the engine's requests degrade to misses within a
   bounded time and answer correctly; when the server is back the engine reconnects by itself and
   restores from the rebuilt L2.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import needs_model
from kvbridge.backends import make_backend
from kvbridge.cache_server.shm import stale_segments
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.settings import WORK_DIR
from tests.cache_server_helpers import PROJECT, ServerProcess, local_url, server_env
from tests.cs_engine_child import UNRELATED, doc_prompt

pytestmark = [needs_model, pytest.mark.live, pytest.mark.slow, pytest.mark.timeout(420)]
CHILD = PROJECT / "tests" / "cs_engine_child.py"


@pytest.fixture
def server_settings(make_settings):
    # a pool big enough for the document's chunks (32 tokens of SmolLM2 KV are ~0.7 MB)
    return make_settings(l1_bytes=64 << 20, cache_server_page_bytes=256 << 10, cache_server_timeout=3.0)


@pytest.fixture
def cache_server(server_settings, tmp_path):
    url = local_url()
    server = ServerProcess(server_env(server_settings), url, log_path=tmp_path / "cache-server.log")
    yield server
    if server.proc.poll() is None:
        assert server.terminate() == 0, server.tail()
    server.close()


def run_child(settings, url: str, engine: str, plan: str, **extra) -> subprocess.Popen:
    env = server_env(settings.replace(store_url=url, l2_dir=str(settings.l2_dir) + "-unused"), **extra)
    return subprocess.Popen([sys.executable, str(CHILD), engine, plan], env=env, cwd=PROJECT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def first_json_line(child: subprocess.Popen, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = child.stdout.readline()
        if line.startswith("{"):
            return json.loads(line)
        if not line and child.poll() is not None:
            break
    child.kill()
    raise AssertionError(f"engine process gave no record (exit {child.poll()}): {child.stderr.read()[-3000:]}")


def test_a_killed_engine_loses_nothing_a_new_engine_restores_from_l1(server_settings, cache_server):
    storer = run_child(server_settings, cache_server.url, "llamacpp", "store")
    try:
        stored = first_json_line(storer)
        assert stored["error"] == "" and stored["stored_objects"] > 0
        storer.kill()   # SIGKILL: no cleanup of any kind in the engine process
        storer.wait(timeout=10)
    finally:
        storer.kill()
    restorer = run_child(server_settings, cache_server.url, "llamacpp", "restore")
    result = first_json_line(restorer)
    restorer.wait(timeout=60)
    cold, warm = result["cold"], result["warm"]
    assert warm["tier"] == "L1", f"expected a restore from the server's L1: {warm}"
    assert warm["restore_ok"] is True and warm["matched_tokens"] > 0
    assert warm["text"] == cold["text"]


@pytest.fixture
def llama_server_binary():
    from test_llama_server import BINARY

    if not BINARY.is_file():
        subprocess.run([str(WORK_DIR / "scripts" / "build_llama_server.sh")], check=True)
    return BINARY


def test_llama_server_and_the_in_process_engine_share_chunks_through_one_server(
        server_settings, cache_server, llama_server_binary):
    storer = run_child(server_settings, cache_server.url, "llama-server", "store", KVB_THREADS=1)
    try:
        stored = first_json_line(storer)
        assert stored["error"] == "" and stored["stored_objects"] > 0
    finally:
        storer.terminate()   # llama-server's engine stops its server child on SIGTERM
        storer.wait(timeout=30)
    restorer = run_child(server_settings, cache_server.url, "llamacpp", "restore")
    result = first_json_line(restorer)
    restorer.wait(timeout=60)
    cold, warm = result["cold"], result["warm"]
    assert warm["restore_ok"] is True and warm["matched_tokens"] > 0 and warm["tier"] == "L1"
    assert warm["text"] == cold["text"]


def test_an_engine_survives_its_cache_server_dying_and_reconnects_when_it_is_back(
        server_settings, cache_server, tmp_path):
    settings = server_settings.replace(store_url=cache_server.url, l2_dir=str(tmp_path / "engine-l2-unused"))
    with CachedEngine(settings, make_backend("llamacpp", settings)) as engine:
        prompt = doc_prompt()
        first = engine.infer(prompt, mode="lmcache", n_predict=12)
        assert first.stored_objects > 0
        engine.infer(UNRELATED, mode="native", n_predict=4)
        cold = engine.infer(prompt, mode="cold", n_predict=12)
        engine.store.flush()   # L1 written to L2 now, so the restarted server can rebuild from it

        cache_server.kill()
        started = time.monotonic()
        degraded = engine.infer(prompt, mode="lmcache", n_predict=12)
        elapsed = time.monotonic() - started
        assert degraded.error == "" and degraded.matched_tokens == 0 and degraded.text == cold.text
        assert elapsed < 30, f"a dead cache server held the request for {elapsed:.1f} s"
        assert engine.store.stats()["unavailable"] >= 1
        again = engine.infer(prompt, mode="lmcache", n_predict=12)   # still down: fails fast
        assert again.text == cold.text

        for segment in stale_segments():
            segment.unlink()   # what scripts/cleanup.sh does for a SIGKILLed server
        back = ServerProcess(server_env(server_settings), cache_server.url, log_path=tmp_path / "back.log")
        try:
            deadline = time.monotonic() + 20
            warm = None
            while time.monotonic() < deadline:
                engine.infer(UNRELATED, mode="native", n_predict=4)
                warm = engine.infer(prompt, mode="lmcache", n_predict=12)
                if warm.matched_tokens:
                    break
                time.sleep(0.5)
            assert warm is not None and warm.matched_tokens > 0, "the engine never reconnected"
            assert warm.tier == "L2" and warm.restore_ok is True   # the new server's L1 was empty
            assert warm.text == cold.text
            assert engine.store.client.counters["reconnects"] >= 1
            assert back.terminate() == 0
        finally:
            back.close()
