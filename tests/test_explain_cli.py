"""`kvbridge explain` as a person runs it: a child process on the real model, over a store a real run filled.

What explain says a restore would take must be what an lmcache request then restores (tokens and tier), its cause
must be the one the record then carries, and it must write nothing. The causes checked here: diverged (another
question after the same document), none_stored (a prompt nothing continues) and evicted (a cache server whose small
L1 made room for a second document). The --json output has a fixed schema; a missing prompt or file is a message.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SHORT_DOC_CHARS, needs_model
from kvbridge.backends import make_backend
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.engine.misses import MISS_REASONS
from kvbridge.settings import Settings, settings_to_env

PROJECT = Path(__file__).resolve().parents[1]
# questions that diverge well before a restore's end (the last 8 to 15 tokens are always computed: cold_cut)
QUESTION_A = "\n\nQuestion: where is Well One, and how deep is it? Answer in one sentence:"
QUESTION_B = "\n\nQuestion: who keeps the north gate, and on which nights? Answer in one sentence:"
UNRELATED = ("Bananas ripen faster in a paper bag because ethylene gas collects around them, so keep the bag "
             "away from apples.")   # long enough that a restore could give some of it (cold_cut)
JSON_KEYS = {"schema", "namespace", "kv_mode", "layout", "prompt_tokens", "chunks_total", "chunks_hit",
             "restorable_tokens", "tier", "hit_tiers", "miss", "store_calls", "explain_ms", "key_history",
             "recent_evictions", "notes", "engine", "store"}


def explain(settings: Settings, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m kvbridge explain ARGS` with `settings` as its environment (no .env, a private HOME)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVB_")}
    env.update(settings_to_env(settings))
    env["PYTHONPATH"] = str(PROJECT)
    return subprocess.run([sys.executable, "-m", "kvbridge", "explain", *args], env=env, cwd=PROJECT,
                          capture_output=True, text=True, timeout=timeout)


def explained(settings: Settings, prompt: str) -> dict:
    done = explain(settings, prompt, "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def files_under(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def document() -> str:
    from kvbridge.bench.common.scenarios import builtin_document

    return builtin_document()[:SHORT_DOC_CHARS]


@pytest.fixture(scope="module")
def filled(tmp_path_factory, document) -> Settings:
    """Settings whose embedded store (L2 on disk) holds the document with question A, stored by a real run."""
    root = tmp_path_factory.mktemp("explain")
    settings = dataclasses.replace(Settings(), chunk_size=16, ctx_size=2048, n_predict=4, l2_dir=str(root / "l2"),
                                   output_dir=str(root / "output"), input_dir=str(root / "input"))
    with CachedEngine(settings, make_backend(settings.engine, settings)) as engine:
        first = engine.infer(document + QUESTION_A, mode="lmcache")
    assert first.error == "" and first.stored_objects > 0
    return settings


@needs_model
def test_explain_predicts_what_an_lmcache_run_restores_and_why_it_stops(filled, document):
    """Another question after the stored document: explain names the tokens it would restore, from L2 (a fresh
    process), and the divergence with text either side; a real lmcache run then restores exactly that."""
    before = files_under(Path(filled.l2_dir))
    said = explained(filled, document + QUESTION_B)
    assert files_under(Path(filled.l2_dir)) == before, "explain wrote into the store"
    assert said["restorable_tokens"] > 10 * filled.chunk_size and said["hit_tiers"] == {"L2": said["restorable_tokens"]}
    assert said["miss"]["reason"] == "diverged" and said["miss"]["at_token"] == said["restorable_tokens"]
    diverges_at = int(re.search(r"at token (\d+)", said["miss"]["detail"]).group(1))   # restored to there, on the grid
    assert "Well One" in said["miss"]["detail"]
    assert "layout probe" in said["layout"] and "not evaluated" in said["layout"]
    with CachedEngine(filled, make_backend(filled.engine, filled)) as engine:
        record = engine.infer(document + QUESTION_B, mode="lmcache")
        assert engine.cut_rule.cut(diverges_at, said["prompt_tokens"]) == said["restorable_tokens"]
    assert record.error == "" and record.restore_ok
    assert record.matched_tokens == said["restorable_tokens"] and record.tier == said["tier"] == "L2"
    assert (record.miss_reason, record.hit_tiers) == ("diverged", f"L2={said['restorable_tokens']}")


@needs_model
def test_explain_says_nothing_is_stored_for_a_prompt_nothing_continues(filled):
    done = explain(filled, UNRELATED, "--evictions", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "restorable:  0 of" in out and "none_stored" in out and MISS_REASONS["none_stored"] in out
    assert "nothing is stored under this prompt's first chunk" in out
    assert "nothing was stored" in out and "the prompt itself was not evaluated" in out


@needs_model
def test_explain_json_schema(filled, document, tmp_path):
    """--file and --json: every field present with its type; a reason exactly when a token but the last is not
    restorable (the first test's run of question B replaced question A's tail at their shared boundary)."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(document + QUESTION_A, encoding="utf-8")
    done = explain(filled, "--file", str(prompt), "--json", "--evictions", "5")
    assert done.returncode == 0, done.stderr[-2000:]
    said = json.loads(done.stdout)
    assert set(said) == JSON_KEYS and said["schema"] == "kvbridge-explain-1"
    assert 0 < said["restorable_tokens"] < said["prompt_tokens"] and said["chunks_hit"] <= said["chunks_total"]
    assert set(said["miss"]) == {"reason", "detail", "at_token"} and said["miss"]["at_token"] == said["restorable_tokens"]
    with CachedEngine(filled, make_backend(filled.engine, filled)) as engine:   # its rule: where restores end
        whole = said["restorable_tokens"] == engine.cut_rule.restorable(said["prompt_tokens"])
    assert (said["miss"]["reason"] == "") == whole and (said["miss"]["reason"] in MISS_REASONS or whole)
    assert sum(said["hit_tiers"].values()) == said["restorable_tokens"]
    assert isinstance(said["store_calls"], int) and said["store_calls"] >= 2 and said["explain_ms"] >= 0
    assert said["namespace"].startswith("kvbridge-ns-1|") and "chunk=16" in said["namespace"]
    assert said["kv_mode"] == "full" and said["store"] == "embedded (L1, L2)"
    if said["key_history"] is not None:   # a store with an eviction ring: a fresh process's holds nothing yet
        assert said["key_history"] == [] and said["recent_evictions"] == []


@needs_model
def test_explain_under_a_salt_names_the_unsalted_copy(filled, document):
    """The owner's tool reveals salts: a prompt stored unsalted, asked under a cache salt, is other_namespace
    with the salt's digest (never the salt) as the differing field."""
    done = explain(filled, document + QUESTION_A, "--salt", "tenant-a", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    said = json.loads(done.stdout)
    assert said["restorable_tokens"] == 0 and said["miss"]["reason"] == "other_namespace"
    assert "cache_salt none→" in said["miss"]["detail"] and "tenant-a" not in done.stdout


@pytest.mark.parametrize("args, message", [
    ([""], "is empty"),
    (["   \n"], "is empty"),
    ([], "Give a prompt to explain"),
    (["--file", "/nonexistent/prompt.txt"], "--file /nonexistent/prompt.txt: no such file"),
    (["text", "--file", "/etc/hostname"], "not both"),
    (["text", "--evictions", "-1"], "--evictions must be 0 or more"),
])
def test_explain_errors_are_for_a_person(args, message, make_settings):
    done = explain(make_settings(), *args, timeout=60)
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr


@needs_model
def test_explain_names_an_eviction_on_the_cache_server(tmp_path, document):
    """A cache server whose small L1 (no L2) held the document until a second one made room: explain, in a
    fresh process through KVB_STORE_URL, says the document's first chunk was evicted, from which tier, by
    which policy and for what, and lists it in the key's history (the ring lives in the server)."""
    from kvbridge.bench.common.scenarios import builtin_document
    from tests.cache_server_helpers import running_server

    settings = dataclasses.replace(Settings(), chunk_size=16, ctx_size=2048, n_predict=4, l2_enabled=False,
                                   l2_dir=str(tmp_path / "l2"), output_dir=str(tmp_path / "output"),
                                   input_dir=str(tmp_path / "input"), l1_bytes=12 << 20,
                                   cache_server_page_bytes=64 << 10, cache_server_timeout=5.0)
    other = builtin_document()[SHORT_DOC_CHARS:2 * SHORT_DOC_CHARS]
    with running_server(settings) as server:
        client = dataclasses.replace(settings, store_url=server.url)
        with CachedEngine(client, make_backend(client.engine, client)) as engine:
            for text in (document, other):
                assert engine.infer(text + QUESTION_A, mode="lmcache").error == ""
        said = explained(client, document + QUESTION_A)
    assert said["store"] == f"cache server {server.url}"
    assert said["miss"]["reason"] == "evicted", said
    assert said["restorable_tokens"] == said["miss"]["at_token"] < said["prompt_tokens"] - settings.chunk_size
    assert "evicted from L1" in said["miss"]["detail"] and ("by LRU" in said["miss"]["detail"]
                                                            or "under memory pressure" in said["miss"]["detail"])
    history = said["key_history"]
    assert history and all(e["tier"] == "L1" and e["gone"] for e in history)
    # the eviction the detail names is in the history: the object it made room for, by its key
    assert any(e["for_key"] and e["for_key"][:12] in said["miss"]["detail"] for e in history), (said, history)


@needs_model
def test_explain_given_serves_model_flags_finds_what_serve_stored(tmp_path, document):
    """`serve -m X -ctk q8_0` stores a document; `explain` with the same flags looks in serve's namespace and
    finds it (the second question diverges after it); without them it looks under the embedded f16 namespace and
    says the prompt is stored under another one. `namespace` with the flags prints serve's namespace."""
    from kvbridge.settings import EMBEDDED_MODEL_PATH
    from process_helpers import free_port

    openai = pytest.importorskip("openai", reason="the openai SDK is not installed (requirements.txt)")
    settings = dataclasses.replace(Settings(), chunk_size=16, ctx_size=2048, n_predict=4, threads=1,
                                   l2_dir=str(tmp_path / "l2"), output_dir=str(tmp_path / "output"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVB_")}
    env.update(settings_to_env(settings), PYTHONPATH=str(PROJECT))
    flags = ["-m", str(EMBEDDED_MODEL_PATH), "-ctk", "q8_0"]
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvbridge", "serve", *flags, "--port", str(port)],
                                cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "KVBridge serve ready on" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        client.chat.completions.create(model="x", max_tokens=4, temperature=0,
                                       messages=[{"role": "user", "content": document + QUESTION_A}])
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log_path.read_text()[-2000:]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvbridge", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=180)

    plain = run("explain", "--chat", "--json", document + QUESTION_B)
    assert plain.returncode == 0, plain.stderr[-2000:]
    plain = json.loads(plain.stdout)
    assert plain["restorable_tokens"] == 0 and plain["miss"]["reason"] == "other_namespace", plain["miss"]
    same = run("explain", *flags, "--chat", "--json", document + QUESTION_B)
    assert same.returncode == 0, same.stderr[-2000:]
    same = json.loads(same.stdout)
    assert same["namespace"] != plain["namespace"]
    assert same["restorable_tokens"] > 100 and same["miss"]["reason"] == "diverged", same["miss"]
    shown = run("namespace", *flags, "--exact")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert f"namespace: {same['namespace']}" in shown.stdout
    assert "exact mode: the same namespace" in shown.stdout
