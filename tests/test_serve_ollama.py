"""Ollama's API on `serve` (issue 49, part 3), driven by the official `ollama` Python client against a real
`python -m kvbridge serve` on loopback, on a model store laid out as `ollama pull` lays it out (made here from
the embedded GGUF, hard-linked as its blob).

- the client lists, shows and ps'es the model under its Ollama name; chats and generates, streamed and not,
  the stream's pieces joining to the whole answer; /api/generate's `context` continues a conversation;
- what cannot be honoured is refused naming the field (`format`, `tools`, `options.num_ctx` past the context),
  a model serve does not run is Ollama's 404, embeddings a 501;
- the oracle: a conversation answered by one serve process, then (after SIGTERM) by a second on the same L2
  with a key required, is restored from L2 (`prompt_eval_cached_count`, `kvbridge.cached_tokens`) and its
  greedy answer is the same token for token; the keyless client is told how to send the key.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import requests

from conftest import needs_model
from kvbridge.serve.ollama_protocol import ServedModel, display_name
from kvbridge.settings import Settings
from kvbridge.settings.models import EMBEDDED_MODELS
from test_serve import Served

ollama = pytest.importorskip("ollama", reason="the ollama client is not installed (requirements-test.txt)")
pytestmark = [needs_model, pytest.mark.timeout(400)]
NAME = "smollm2"
GREEDY = {"temperature": 0, "num_predict": 12}
KEY = "ollama-test-key"


def ollama_store(root: Path) -> Path:
    """Ollama's layout: manifests/registry.ollama.ai/library/<name>/<tag> naming blobs/sha256-<hex> by digest."""
    gguf = EMBEDDED_MODELS["smollm2-135m"].path
    blobs = root / "blobs"
    blobs.mkdir(parents=True)
    model_digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    try:
        os.link(gguf, blobs / f"sha256-{model_digest}")
    except OSError:   # another file system: a copy
        (blobs / f"sha256-{model_digest}").write_bytes(gguf.read_bytes())
    config = json.dumps({"model_format": "gguf", "model_family": "llama", "file_type": "Q4_1"}).encode()
    config_digest = hashlib.sha256(config).hexdigest()
    (blobs / f"sha256-{config_digest}").write_bytes(config)
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                           "digest": f"sha256:{config_digest}", "size": len(config)},
                "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{model_digest}",
                            "size": gguf.stat().st_size}]}
    path = root / "manifests" / "registry.ollama.ai" / "library" / NAME / "latest"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(manifest))
    return root


def test_names_are_ollama_names_and_a_blob_given_by_path_is_named_from_its_manifest(tmp_path):
    assert [display_name(n) for n in ("llama3.2", "user/name:tag", "registry.ollama.ai/library/x:1", "h:5000/ns/m:t")] \
        == ["llama3.2:latest", "user/name:tag", "x:1", "h:5000/ns/m:t"]
    store = ollama_store(tmp_path / "models")
    blob = next(b for b in (store / "blobs").iterdir() if b.stat().st_size > 10 ** 6)
    served = ServedModel.of(Settings(model_path=str(blob)), blob)   # serve -m ~/.ollama/models/blobs/sha256-...
    assert (served.name, served.from_store) == ("smollm2:latest", True)
    assert served.answers_to("smollm2") and served.answers_to("SmolLM2:latest") and not served.answers_to("smollm2:q8")
    plain = EMBEDDED_MODELS["smollm2-135m"].path
    assert ServedModel.of(Settings(model_path=str(plain)), plain).name == plain.stem + ":latest"


def ollama_served(tmp_path: Path, name: str, store: Path, l2: Path, **env: str) -> Served:
    return Served(tmp_path, name, KVB_OLLAMA_MODEL=NAME, KVB_OLLAMA_MODELS=str(store), KVB_L2_DIR=str(l2), **env)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ollama")
    server = ollama_served(tmp, "first", ollama_store(tmp / "models"), tmp / "l2").start()
    server.tmp, server.store = tmp, tmp / "models"
    yield server
    server.stop()


def client(served: Served, **kw) -> "ollama.Client":
    return ollama.Client(host=served.url, timeout=120, **kw)


def test_the_client_lists_shows_and_ps_the_model_by_its_ollama_name(served):
    listed = client(served).list()
    assert [m.model for m in listed.models] == [f"{NAME}:latest"]
    entry = listed.models[0]
    assert entry.details.family == "llama" and entry.details.quantization_level == "Q4_1"
    assert entry.digest == hashlib.sha256((served.store / "manifests/registry.ollama.ai/library/smollm2/latest")
                                          .read_bytes()).hexdigest()
    shown = client(served).show(NAME)
    assert shown.details.format == "gguf" and "completion" in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama"
    running = client(served).ps()
    assert [m.model for m in running.models] == [f"{NAME}:latest"] and running.models[0].context_length == 1024
    assert requests.get(served.url + "/api/version", timeout=10).json()["version"]
    assert requests.get(served.url + "/", timeout=10).text == "Ollama is running"


def test_chat_streamed_and_not_gives_the_same_greedy_answer(served):
    messages = [{"role": "user", "content": "Name one fruit."}]
    whole = client(served).chat(model=NAME, messages=messages, options=GREEDY, stream=False)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert whole.message.content and whole.eval_count >= 1 and whole.prompt_eval_count > 5
    assert whole.total_duration > 0 and whole.eval_duration > 0
    parts = list(client(served).chat(model=f"{NAME}:latest", messages=messages, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count and parts[-1].prompt_eval_count == whole.prompt_eval_count


def test_generate_streamed_and_not_and_its_context_continues(served):
    whole = client(served).generate(model=NAME, prompt="Name one colour.", options=GREEDY)
    assert whole.done and whole.response and whole.context
    parts = list(client(served).generate(model=NAME, prompt="Name one colour.", options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == whole.response and parts[-1].context == whole.context
    # the context is the prompt and the answer: the next request's prompt starts with them, as Ollama's does
    follow = client(served).generate(model=NAME, prompt="And another?", context=whole.context, options=GREEDY)
    assert follow.done and follow.prompt_eval_count > len(whole.context)
    assert follow.context[:len(whole.context) - 2] == whole.context[:len(whole.context) - 2]
    raw = client(served).generate(model=NAME, prompt="The sky is", raw=True, options=GREEDY)
    assert raw.prompt_eval_count <= 4   # no template around a raw prompt


def test_what_cannot_be_done_is_refused_naming_the_field(served):
    c = client(served)
    refusals = [(lambda: c.chat(model="llama3.2", messages=[{"role": "user", "content": "Hi"}]), 404,
                 "model 'llama3.2' not found"),
                (lambda: c.generate(model=NAME, prompt="Hi", options={"num_ctx": 4096}), 400, "options.num_ctx"),
                (lambda: c.generate(model=NAME, prompt="Hi", format="json"), 400, "'format'"),
                (lambda: c.chat(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                tools=[{"type": "function", "function": {"name": "f"}}]), 400, "'tools'"),
                (lambda: c.generate(model=NAME, prompt="Hi", context=[10 ** 6]), 400, "'context'"),
                (lambda: c.generate(model=NAME, prompt="Hi", options={"num_predict": 10 ** 6}), 400,
                 "options.num_predict"),
                (lambda: c.embed(model=NAME, input="Hi"), 501, "embeddings"),
                (lambda: c.show("other/model:tag"), 404, "model 'other/model:tag' not found")]
    for call, status, said in refusals:
        with pytest.raises(ollama.ResponseError) as caught:
            call()
        assert caught.value.status_code == status and said in str(caught.value.error), str(caught.value)


def test_a_second_process_restores_the_conversation_from_l2(served):
    """The oracle: the greedy answer after a restart, restored from L2, equals the first process's cold one."""
    messages = [{"role": "system", "content": "You answer in one short sentence. " * 24},
                {"role": "user", "content": "Which season comes after winter?"}]
    body = {"model": NAME, "messages": messages, "options": GREEDY, "stream": False}
    cold = requests.post(served.url + "/api/chat", json=body, timeout=120).json()
    assert cold["kvbridge"]["cached_tokens"] == 0 and "prompt_eval_cached_count" not in cold
    assert served.stop() == 0
    second = ollama_served(served.tmp, "second", served.store, served.tmp / "l2", KVB_SERVE_API_KEY_ENV="OLLAMA_TEST_KEY",
                           OLLAMA_TEST_KEY=KEY).start()
    try:
        assert requests.get(second.url + "/", timeout=10).status_code == 200   # the heartbeat needs no key
        with pytest.raises(ollama.ResponseError) as caught:   # Ollama's clients send no key unless told
            client(second).chat(model=NAME, messages=messages, options=GREEDY)
        assert caught.value.status_code == 401 and "headers={'Authorization': 'Bearer <key>'}" in str(caught.value)
        restored = requests.post(second.url + "/api/chat", json=body, headers={"Authorization": f"Bearer {KEY}"},
                                 timeout=120).json()
        answer = client(second, headers={"Authorization": f"Bearer {KEY}"}).chat(
            model=NAME, messages=messages, options=GREEDY)
    finally:
        assert second.stop() == 0
    assert restored["message"]["content"] == cold["message"]["content"] == answer.message.content
    assert restored["kvbridge"]["tier"] == "L2", (cold["kvbridge"], cold["prompt_eval_count"], restored["kvbridge"])
    assert restored["kvbridge"]["cached_tokens"] >= 32
    assert restored["prompt_eval_cached_count"] == restored["kvbridge"]["cached_tokens"]
    assert restored["prompt_eval_count"] == cold["prompt_eval_count"]   # the whole prompt, as Ollama counts it


def test_tenants_keep_their_kv_apart_on_ollamas_routes(tmp_path):
    """Two tenants' keys on /api/chat: each reuses its own KV (and, in its group, the OpenAI side's), never the
    other's; the operator's key runs no chat. In-process over the real scheduler."""
    from kvbridge.serve.engines import SchedulerEngine
    from kvbridge.serve.server import BackgroundServe
    from kvbridge.serve.tenants import key_digest

    keys = {"alice": "ollama-alice-key", "bob": "ollama-bob-key"}
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": [{"name": n, "key_sha256": key_digest(k)} for n, k in keys.items()]}))
    settings = Settings(chunk_size=32, ctx_size=1024, sched_kv_cells=3072, serve_max_tokens=16, serve_port=0,
                        l2_dir=str(tmp_path / "l2"), output_dir=str(tmp_path / "output"),
                        serve_tenants_file=str(tenants))
    engine = SchedulerEngine(settings)
    endpoint = BackgroundServe(settings, engine, port=0)
    messages = [{"role": "system", "content": "Answer from the rota. " + "The north orchard is pruned in week 3. " * 20},
                {"role": "user", "content": "Which orchard is pruned in week 3?"}]
    body = {"model": display_name(engine.model_path.stem), "messages": messages, "options": GREEDY, "stream": False}

    def cached(who: str) -> int:
        answer = requests.post(endpoint.url + "/api/chat", json=body, timeout=120,
                               headers={"Authorization": f"Bearer {keys[who]}"})
        assert answer.status_code == 200, answer.text
        return answer.json()["kvbridge"]["cached_tokens"]

    try:
        assert cached("alice") == 0
        assert cached("alice") > 0           # its own KV, resident or stored
        assert cached("bob") == 0            # alice's prompt is a cold prefill for bob
        keyless = requests.post(endpoint.url + "/api/chat", json=body, timeout=30)
        assert keyless.status_code == 401 and "OLLAMA_API_KEY" in keyless.json()["error"]["message"]
    finally:
        endpoint.stop()
        engine.close()
