"""Ollama in shadow mode: model-store lookup, real vocab-only tokenization, recorded streams, live Ollama.

Ollama's binary cannot be installed here, so its REST answers are replayed by a loopback HTTP server
(tests/replay_server.py) from fixtures in Ollama's wire shape; the backend talks real HTTP to it.
Everything else is real: the model store is real files in tmp_path whose model blob is the embedded
GGUF, loaded vocab-only by llama-cpp-python. A live test runs when KVB_OLLAMA_URL answers.
"""
from __future__ import annotations

import copy
import hashlib
import json
import time
from pathlib import Path

import pytest
import requests

from kvbridge.backends import make_backend, resolve_engine
from kvbridge.backends.base import EngineReport, Prompt
from kvbridge.backends.ollama.backend import COLD_NOTE, OllamaBackend, keep_alive_value
from kvbridge.backends.ollama.model_store import find_ollama_gguf, locate_ollama_model, manifest_relpath
from kvbridge.settings import EMBEDDED_MODEL_PATH, Settings
from kvbridge.errors import BadSettings, EngineUnavailable, KVBridgeError
from replay_server import Reply, ReplayServer, load_fixture

MODEL = "smollm2:135m"
PROMPT = load_fixture("ollama_prompt.json")
PROMPT_TOKENS = 101  # the count the ollama_generate_*.ndjson fixtures were written for
needs_gguf = pytest.mark.skipif(not EMBEDDED_MODEL_PATH.is_file(),
                                reason=f"embedded model {EMBEDDED_MODEL_PATH} missing (run scripts/setup.sh)")


# --- an Ollama model store on disk --------------------------------------------------------------

@pytest.fixture(scope="session")
def gguf_digest() -> str:
    if not EMBEDDED_MODEL_PATH.is_file():
        pytest.skip(f"embedded model {EMBEDDED_MODEL_PATH} missing (run scripts/setup.sh)")
    return hashlib.sha256(EMBEDDED_MODEL_PATH.read_bytes()).hexdigest()


def write_blob(store: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (store / "blobs").mkdir(parents=True, exist_ok=True)
    (store / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def make_store(store: Path, name: str, gguf_digest: str, *, size: int | None = None) -> Path:
    """Ollama's layout: a manifest naming a model blob (the embedded GGUF, symlinked) and small blobs."""
    blob = store / "blobs" / f"sha256-{gguf_digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    if not blob.exists():
        blob.symlink_to(EMBEDDED_MODEL_PATH)
    config = write_blob(store, b'{"model_format":"gguf","model_family":"llama"}')
    template = write_blob(store, b"{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}")
    params = write_blob(store, b'{"stop":["<|im_start|>","<|im_end|>"]}')
    manifest = {
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **config},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{gguf_digest}",
             "size": EMBEDDED_MODEL_PATH.stat().st_size if size is None else size},
            {"mediaType": "application/vnd.ollama.image.template", **template},
            {"mediaType": "application/vnd.ollama.image.params", **params},
        ],
    }
    path = store / "manifests" / manifest_relpath(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path


@pytest.mark.parametrize("name, expected", [
    ("smollm2:135m", "registry.ollama.ai/library/smollm2/135m"),
    ("smollm2", "registry.ollama.ai/library/smollm2/latest"),
    ("someone/tiny-model:q4", "registry.ollama.ai/someone/tiny-model/q4"),
    ("hf.co/org/repo-GGUF:Q4_K_M", "hf.co/org/repo-GGUF/Q4_K_M"),
    ("localhost:5000/ns/model", "localhost:5000/ns/model/latest"),
])
def test_manifest_path_of_each_name_form(name, expected):
    assert manifest_relpath(name).as_posix() == expected


@pytest.mark.parametrize("name", ["", "../etc:passwd", "a/../../b", "model:"])
def test_bad_model_names_are_not_looked_up(tmp_path, name):
    assert find_ollama_gguf(tmp_path, name) is None


@pytest.mark.parametrize("name", ["smollm2:135m", "smollm2", "someone/tiny-model:q4"])
def test_find_ollama_gguf_follows_manifest_to_blob(tmp_path, gguf_digest, name):
    manifest = make_store(tmp_path, name, gguf_digest)
    found = locate_ollama_model(tmp_path, name)
    assert found is not None and found.gguf_path == tmp_path / "blobs" / f"sha256-{gguf_digest}"
    assert found.gguf_path.resolve() == EMBEDDED_MODEL_PATH.resolve()
    assert found.manifest_digest == "sha256:" + hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert find_ollama_gguf(tmp_path, name) == found.gguf_path


def test_store_faults_are_a_none_not_an_exception(tmp_path, gguf_digest):
    assert find_ollama_gguf(tmp_path, "smollm2:135m") is None                    # no manifest
    manifest = make_store(tmp_path, "smollm2:135m", gguf_digest, size=12345)
    assert find_ollama_gguf(tmp_path, "smollm2:135m") is None                    # size mismatch
    manifest.write_text("{not json")
    assert find_ollama_gguf(tmp_path, "smollm2:135m") is None                    # unreadable manifest
    manifest.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                                "digest": "sha256:../../etc/passwd"}]}))
    assert find_ollama_gguf(tmp_path, "smollm2:135m") is None                    # malformed digest
    (tmp_path / "blobs" / f"sha256-{gguf_digest}").unlink()
    make_store(tmp_path, "other:1b", "0" * 64)
    (tmp_path / "blobs" / f"sha256-{'0' * 64}").unlink()
    assert find_ollama_gguf(tmp_path, "other:1b") is None                        # blob missing


def test_keep_alive_values():
    assert keep_alive_value("5m") == "5m" and keep_alive_value("-1") == -1 and keep_alive_value("300") == 300


def test_registered_as_shadow_engine():
    spec = resolve_engine("ollama")
    assert spec.cls is OllamaBackend and spec.cls.kv_mode == "shadow"
    assert set(spec.fields) <= set(Settings.__dataclass_fields__)


# --- replayed Ollama ----------------------------------------------------------------------------

def script_ollama(server: ReplayServer, *, version: str, streams: list[str], manifest_digest: str = "") -> None:
    api = load_fixture("ollama_api.json")
    tags = copy.deepcopy(api["tags"])
    tags["models"][0]["digest"] = manifest_digest.removeprefix("sha256:")
    queue = [load_fixture(name) for name in streams]

    def generate(request):
        body = request.json()
        if body.get("keep_alive") == 0 and "prompt" not in body:
            return Reply.json(api["unload"])
        return Reply.ndjson(queue.pop(0), chunk_delay_s=0.002)

    server.add("GET", "/api/version", Reply.json(api[f"version_{version}"]))
    server.add("POST", "/api/show", Reply.json(api["show"]))
    server.add("GET", "/api/tags", Reply.json(tags))
    server.add("POST", "/api/generate", generate)


def ollama_settings(url: str, store: Path, model: str = MODEL) -> Settings:
    return Settings(engine="ollama", ollama_url=url, ollama_model=model, ollama_models=str(store), ctx_size=2048)


def make_prompt(backend) -> Prompt:
    text = backend.render(PROMPT["messages"])
    return Prompt(text, tuple(backend.tokenize(text)), tuple(PROMPT["messages"]), backend.approx_tokens)


def run(backend, prompt: Prompt, *, cold: bool) -> tuple[str, EngineReport, float]:
    report = EngineReport()
    start, ttft, pieces = time.perf_counter(), 0.0, []
    for piece in backend.generate(prompt, n_predict=8, temperature=0.0, use_native_cache=not cold, report=report):
        ttft = ttft or time.perf_counter() - start
        pieces.append(piece)
    return "".join(pieces), report, ttft


@pytest.fixture
def store(tmp_path, gguf_digest) -> tuple[Path, str]:
    manifest = make_store(tmp_path / "models", MODEL, gguf_digest)
    return tmp_path / "models", "sha256:" + hashlib.sha256(manifest.read_bytes()).hexdigest()


@needs_gguf
def test_newer_ollama_estimates_cached_tokens_from_calibrated_duration(store):
    """Ollama binary not available here: Ollama's newer-version NDJSON is replayed on loopback."""
    models_dir, manifest_digest = store
    with ReplayServer() as server:
        script_ollama(server, version="newer", manifest_digest=manifest_digest,
                      streams=["ollama_generate_newer_warm.ndjson", "ollama_generate_newer_cold.ndjson",
                               "ollama_generate_newer_warm.ndjson"])
        backend = make_backend("ollama", ollama_settings(server.url, models_dir))
        backend.start()
        assert not backend.approx_tokens and "model vocabulary" in backend.describe()
        prompt = make_prompt(backend)
        assert len(prompt.tokens) == PROMPT_TOKENS and prompt.text.startswith("<|im_start|>system\n")

        _, uncalibrated, _ = run(backend, prompt, cold=False)
        assert uncalibrated.engine_cached_tokens is None
        assert "cached unknown until a cold request calibrates the prefill rate" in uncalibrated.notes

        text, cold, ttft = run(backend, prompt, cold=True)
        assert text == " A full service costs 60 euros, but" and ttft > 0
        assert COLD_NOTE in cold.notes and cold.engine_cached_tokens == 0
        assert backend.prefill_ns_per_token == pytest.approx(404_000_000 / 101)

        _, warm, _ = run(backend, prompt, cold=False)
        assert (warm.engine_cached_tokens, warm.engine_prefill_tokens, warm.prompt_tokens) == (100, 1, 101)
        assert warm.completion_tokens == 8
        assert any("estimated from prompt_eval_duration" in n for n in warm.notes)

        generate_calls = [r.json() for r in server.requests_to("/api/generate")]
        unload = generate_calls[1]
        assert unload == {"model": MODEL, "keep_alive": 0}
        sent = generate_calls[2]
        assert sent["raw"] is True and sent["stream"] is True and sent["prompt"] == prompt.text
        assert sent["keep_alive"] == "5m"
        assert sent["options"] == {"temperature": 0.0, "num_predict": 8, "seed": 0, "num_ctx": 2048}


@needs_gguf
def test_older_ollama_counts_evaluated_tokens(store):
    """Ollama binary not available here: an older version's NDJSON (evaluated tokens only) is replayed."""
    models_dir, manifest_digest = store
    with ReplayServer() as server:
        script_ollama(server, version="older", manifest_digest=manifest_digest,
                      streams=["ollama_generate_older_cold.ndjson", "ollama_generate_older_warm.ndjson"])
        backend = make_backend("ollama", ollama_settings(server.url, models_dir))
        backend.start()
        prompt = make_prompt(backend)
        _, cold, _ = run(backend, prompt, cold=True)
        assert cold.engine_cached_tokens == 0
        _, warm, _ = run(backend, prompt, cold=False)
        assert (warm.engine_cached_tokens, warm.engine_prefill_tokens) == (100, 1)
        assert any("Ollama counts evaluated tokens only" in n for n in warm.notes)


def test_without_the_gguf_tokens_are_approx_and_labelled(tmp_path):
    """Ollama binary not available here; its model store on this machine lacks the model."""
    with ReplayServer() as server:
        script_ollama(server, version="older", streams=["ollama_generate_older_warm.ndjson"])
        backend = make_backend("ollama", ollama_settings(server.url, tmp_path / "empty-store"))
        backend.start()
        assert backend.approx_tokens and "approx" in backend.describe()
        prompt = make_prompt(backend)
        assert prompt.approx_tokens and prompt.text.startswith("<|im_start|>system\n")
        _, report, _ = run(backend, prompt, cold=False)
        assert report.engine_cached_tokens is not None  # older count: far below our approximate count
        assert backend.kv_fingerprint()["tokens"] == "approx v1"


@needs_gguf
def test_a_store_that_differs_from_the_served_model_is_not_trusted(store):
    """Ollama binary not available here: /api/tags lists a different manifest digest than the local store."""
    models_dir, _ = store
    with ReplayServer() as server:
        script_ollama(server, version="newer", streams=[], manifest_digest="sha256:" + "ab" * 32)
        backend = make_backend("ollama", ollama_settings(server.url, models_dir))
        backend.start()
        assert backend.approx_tokens and "differs" in backend.describe()


@needs_gguf
def test_cached_engine_records_ollama_ground_truth(store, tmp_path):
    """Ollama binary not available here: its newer-version streams are replayed; the engine is real."""
    from kvbridge.engine.cached_engine import CachedEngine

    models_dir, manifest_digest = store
    with ReplayServer() as server:
        script_ollama(server, version="newer", manifest_digest=manifest_digest,
                      streams=["ollama_generate_newer_cold.ndjson", "ollama_generate_newer_warm.ndjson"])
        settings = ollama_settings(server.url, models_dir).replace(chunk_size=32, l2_dir=str(tmp_path / "l2"),
                                                                   n_predict=8)
        with CachedEngine(settings, make_backend("ollama", settings)) as engine:
            assert manifest_digest in engine.namespace  # the exact model files key the shadow index
            cold = engine.infer(PROMPT["messages"], mode="cold")
            warm = engine.infer(PROMPT["messages"], mode="native")
    assert not cold.error and not warm.error and not cold.approx
    assert (cold.prompt_tokens, cold.engine_cached_tokens) == (PROMPT_TOKENS, 0) and COLD_NOTE in cold.notes
    assert (warm.engine_cached_tokens, warm.prefill_tokens, warm.gen_tokens) == (100, 1, 8)
    assert "estimated from prompt_eval_duration" in warm.notes and warm.text == " A full service costs 60 euros, but"


# --- bad input ------------------------------------------------------------------------------------

def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_ollama_names_the_setting(tmp_path):
    backend = OllamaBackend(ollama_settings(f"http://127.0.0.1:{free_port()}", tmp_path))
    with pytest.raises(EngineUnavailable, match=r"not reachable at http://127\.0\.0\.1:\d+ \(KVB_OLLAMA_URL\)"):
        backend.start()


def test_empty_model_setting_is_a_clear_error(tmp_path):
    with pytest.raises(BadSettings, match="KVB_OLLAMA_MODEL is empty"):
        OllamaBackend(ollama_settings("http://127.0.0.1:9", tmp_path, model="")).start()


def test_missing_model_says_how_to_pull_it(tmp_path):
    """Ollama binary not available here: its 404 for an unknown model is replayed."""
    api = load_fixture("ollama_api.json")
    with ReplayServer() as server:
        server.add("GET", "/api/version", Reply.json(api["version_newer"]))
        server.add("POST", "/api/show", Reply.json(api["model_missing"], status=404))
        with pytest.raises(EngineUnavailable, match=r"no model 'nosuch' \(KVB_OLLAMA_MODEL\).*ollama pull nosuch"):
            OllamaBackend(ollama_settings(server.url, tmp_path, model="nosuch")).start()


def test_malformed_lines_are_skipped_and_counted(tmp_path):
    """Ollama binary not available here: a damaged NDJSON stream is replayed."""
    lines = load_fixture("ollama_generate_older_warm.ndjson")
    damaged = lines[:3] + ['{"model":"smollm2:135m","respo', "garbage"] + lines[3:]
    with ReplayServer() as server:
        server.add("POST", "/api/generate", Reply.ndjson(damaged))
        backend = OllamaBackend(ollama_settings(server.url, tmp_path))
        text, report, _ = run(backend, Prompt("x", tuple(range(PROMPT_TOKENS))), cold=False)
        assert text == " A full service costs 60 euros, but"
        assert "skipped 2 malformed line(s) in Ollama's stream" in report.notes
        assert report.engine_cached_tokens == 100 and backend.counters["malformed_stream_lines"] == 2


def test_malformed_lines_reach_the_engine_metrics(tmp_path):
    """Ollama binary not available here: a damaged NDJSON stream is replayed; CachedEngine is real."""
    from kvbridge.engine.cached_engine import CachedEngine

    api = load_fixture("ollama_api.json")
    lines = load_fixture("ollama_generate_older_warm.ndjson")
    damaged = lines[:3] + ['{"model":"smollm2:135m","respo', "garbage"] + lines[3:]
    with ReplayServer() as server:
        server.add("GET", "/api/version", Reply.json(api["version_older"]))
        server.add("POST", "/api/show", Reply.json(api["show"]))
        server.add("POST", "/api/generate", Reply.ndjson(damaged))
        settings = ollama_settings(server.url, tmp_path / "no-store").replace(l2_dir=str(tmp_path / "l2"))
        with CachedEngine(settings, make_backend("ollama", settings)) as engine:
            record = engine.infer("How much is a full service?", mode="native")
            assert not record.error and "skipped 2 malformed line(s) in Ollama's stream" in record.notes
            assert engine.metrics.count("malformed_stream_lines") == 2
            assert engine.backend.counters["malformed_stream_lines"] == 0   # moved, not copied


@pytest.mark.parametrize("tail, message", [
    ([json.dumps(load_fixture("ollama_api.json")["error_line"])], "Ollama reported an error: an error was encountered"),
    ([], "stream ended without its final line"),
])
def test_broken_streams_raise_clear_errors(tmp_path, tail, message):
    """Ollama binary not available here: an error line, and a stream cut before its final line, are replayed."""
    lines = load_fixture("ollama_generate_newer_warm.ndjson")[:3] + tail
    with ReplayServer() as server:
        server.add("POST", "/api/generate", Reply.ndjson(lines))
        backend = OllamaBackend(ollama_settings(server.url, tmp_path))
        with pytest.raises(KVBridgeError, match=message):
            run(backend, Prompt("x", (1, 2, 3)), cold=False)


# --- live Ollama (runs when KVB_OLLAMA_URL answers) -----------------------------------------------

def _live_ollama() -> tuple[Settings | None, str]:
    settings = Settings.from_env()
    try:
        requests.get(f"{settings.ollama_url.rstrip('/')}/api/version", timeout=2).raise_for_status()
        tags = requests.get(f"{settings.ollama_url.rstrip('/')}/api/tags", timeout=5).json()
    except (requests.RequestException, ValueError) as err:
        return None, f"no Ollama answers at KVB_OLLAMA_URL={settings.ollama_url} ({type(err).__name__})"
    model = settings.ollama_model or next((m["name"] for m in tags.get("models", [])), "")
    if not model:
        return None, f"Ollama at {settings.ollama_url} has no model pulled (set KVB_OLLAMA_MODEL)"
    return settings.replace(ollama_model=model), ""


LIVE_SETTINGS, LIVE_SKIP_REASON = _live_ollama()


@pytest.mark.live
@pytest.mark.skipif(LIVE_SETTINGS is None, reason=LIVE_SKIP_REASON or "live Ollama available")
def test_live_ollama_cold_then_warm():
    backend = make_backend("ollama", LIVE_SETTINGS)
    backend.start()
    try:
        messages = [{"role": "system", "content": "You answer briefly. " + "Background: " + "lorem ipsum " * 150},
                    {"role": "user", "content": "Say hello."}]
        text = backend.render(messages)
        prompt = Prompt(text, tuple(backend.tokenize(text)), tuple(messages), backend.approx_tokens)
        _, cold, cold_ttft = run(backend, prompt, cold=True)
        _, warm, warm_ttft = run(backend, prompt, cold=False)
        assert cold_ttft > 0 and warm_ttft > 0
        assert COLD_NOTE in cold.notes and backend.prefill_ns_per_token
        assert cold.engine_cached_tokens is not None and cold.engine_cached_tokens <= 0.1 * len(prompt.tokens)
        assert warm.engine_cached_tokens is not None and warm.engine_cached_tokens >= 0.5 * len(prompt.tokens)
    finally:
        backend.stop()
