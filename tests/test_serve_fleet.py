"""`serve` as a fleet worker (issue 34), with real processes on loopback: four `serve` instances (a
solo one, a keyed one, and a prefill/decode pair sharing one `cache-server`), the real vllm-router in
front of them, the official `openai` SDK as the client.

The render endpoints answer the ids the completion prefills (its prompt_tokens, and /tokenize's);
the bodies a router forwards (vLLM's extra fields) are answered, the meaningful ones honoured
(ignore_eos, min_tokens) and the impossible ones refused by name; X-KVBridge-Instance is on every
response (a 200, a 404, a 401, /health, /metrics) and reaches the SDK through a cache_aware router;
a kv_aware router finds the worker's KV-event publisher through /get_server_info and
/kv_event_sources alone; a PD pair behind the router answers what a solo instance answers, its decode
leg restoring what the prefill leg stored.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import requests

from cache_server_helpers import ServerProcess
from conftest import needs_llama_server_and_model, needs_model
from kvbridge.scheduler.exact import safe_reuse
from process_helpers import clean_env, free_port, start_kvbridge, stop, wait_for

openai = pytest.importorskip("openai", reason="the openai SDK is not installed (requirements.txt)")

ROUTER = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "vllm-router"
needs_router = pytest.mark.skipif(not ROUTER.is_file(), reason=f"vllm-router is not installed ({ROUTER}): "
                                                                "run ./scripts/setup.sh (requirements.txt pins it)")
pytestmark = [needs_model, pytest.mark.timeout(600)]
CHUNK = 32
FRUIT = [{"role": "user", "content": "Name one fruit."}]
DOCUMENT = "# Orchard rota\n\n" + " ".join(
    f"Rule {i}: the {['north', 'south', 'east', 'west'][i % 4]} orchard is pruned in week {i % 9} by crew {i % 5}."
    for i in range(12))
DOC_MESSAGES = [{"role": "system", "content": "Answer from the document."},
                {"role": "user", "content": f"Document:\n{DOCUMENT}\n\nQuestion: Which orchard is pruned in week 3?"}]
# the fields vllm-router adds to every body it forwards (its defaults), and in PD mode to the prefill leg
ROUTER_FIELDS = dict(logprobs=False, no_stop_trim=False, ignore_eos=False, continue_final_message=False,
                     skip_special_tokens=True, separate_reasoning=True, stream_reasoning=True,
                     return_hidden_states=False, include_reasoning=True)
PREFILL_LEG = dict(max_tokens=1, min_tokens=1, stream=False,
                   kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                       "remote_block_ids": None, "remote_host": None, "remote_port": None})


class Worker:
    """`python -m kvbridge serve --port 0`: its URL and instance id read from its ready line."""

    def __init__(self, tmp_path: Path, name: str, **env: str) -> None:
        self.log = tmp_path / f"{name}.log"
        settings = dict(KVB_L2_DIR=str(tmp_path / f"{name}-l2"), KVB_OUTPUT_DIR=str(tmp_path / "output"),
                        KVB_CHUNK_SIZE=str(CHUNK), KVB_CTX_SIZE="1024", KVB_SCHED_KV_CELLS="2048",
                        KVB_SCHED_MAX_RUNNING="2", KVB_SERVE_MAX_TOKENS="32", KVB_SERVE_DRAIN_TIMEOUT="30")
        self.proc = start_kvbridge(["serve", "--host", "127.0.0.1", "--port", "0"],
                                   clean_env(**{**settings, **env}), self.log)
        self.url = ""

    def ready(self) -> "Worker":
        found = []
        wait_for(lambda: found.extend(re.findall(r"serve ready on (http://\S+)", self.log.read_text())) or found,
                 "serve did not get ready", self.log, self.proc, timeout_s=180)
        self.url = found[0]
        return self

    @property
    def port_id(self) -> str:
        return "127.0.0.1-" + self.url.rsplit(":", 1)[1]

    def client(self, key: str = "unused") -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def post(self, path: str, body: dict, **headers) -> requests.Response:
        return requests.post(self.url + path, json=body, headers=headers, timeout=120)


class Router:
    """The real vllm-router in its own process group (it renames itself: stopped by its group, not its name)."""

    def __init__(self, tmp_path: Path, name: str, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / f"{name}.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([str(ROUTER), "--host", "127.0.0.1", "--port", str(self.port),
                                          "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                                          "--worker-startup-check-interval", "1", *args],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._answers, "the router did not answer /health", self.log, self.proc, timeout_s=60)

    def _answers(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=2).status_code == 200
        except (requests.ConnectionError, requests.Timeout):   # not listening yet, or busy starting
            return False

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """solo (its own embedded store), keyed (a key configured), prefill and decode (one cache server)."""
    tmp = tmp_path_factory.mktemp("fleet")
    store_url = f"tcp://127.0.0.1:{free_port()}"
    cache = ServerProcess(clean_env(KVB_L2_DIR=str(tmp / "cache-l2"), KVB_CHUNK_SIZE=str(CHUNK),
                                    KVB_L1_BYTES=str(64 << 20), KVB_CACHE_SERVER_PAGE_BYTES=str(64 << 10)),
                          store_url, log_path=tmp / "cache-server.log")
    workers = {}
    try:
        workers["solo"] = Worker(tmp, "solo")
        workers["keyed"] = Worker(tmp, "keyed", KVB_SERVE_API_KEY_ENV="FLEET_TEST_KEY", FLEET_TEST_KEY="k3y-fleet")
        workers["prefill"] = Worker(tmp, "prefill", KVB_STORE_URL=store_url, KVB_SERVE_ROLE="prefill")
        workers["decode"] = Worker(tmp, "decode", KVB_STORE_URL=store_url, KVB_SERVE_ROLE="decode",
                                   KVB_SERVE_INSTANCE_ID="decode-1", KVB_KV_EVENTS_URL="tcp://127.0.0.1:0")
        for worker in workers.values():
            worker.ready()
        yield workers
    finally:
        codes = {name: stop(w.proc) for name, w in workers.items()}
        cache.terminate()
        cache.close()
    assert codes == {name: 0 for name in workers}, codes


def test_render_ids_are_what_the_completion_prefills(fleet):
    solo = fleet["solo"]
    chat = {"model": "x", "messages": DOC_MESSAGES, "max_tokens": 4, "temperature": 0, **ROUTER_FIELDS}
    rendered = solo.post("/v1/chat/completions/render", chat)
    assert rendered.status_code == 200, rendered.text
    ids = rendered.json()["token_ids"]
    answer = solo.post("/v1/chat/completions", chat).json()
    assert len(ids) == answer["usage"]["prompt_tokens"] and all(isinstance(t, int) for t in ids)
    tokenized = solo.post("/tokenize", {"model": "x", "messages": DOC_MESSAGES}).json()
    assert tokenized == {"tokens": ids, "count": len(ids), "max_model_len": 1024}

    text = {"model": "x", "prompt": DOCUMENT, "max_tokens": 4, "temperature": 0, **ROUTER_FIELDS}
    ids = solo.post("/v1/completions/render", text).json()["token_ids"]
    assert len(ids) == solo.post("/v1/completions", text).json()["usage"]["prompt_tokens"]
    assert solo.post("/tokenize", {"prompt": DOCUMENT}).json()["tokens"] == ids
    # the render is the completion's own parse: what the completion refuses, the render refuses alike
    refused = solo.post("/v1/chat/completions/render", {"model": "x", "messages": []})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"


def test_router_bodies_are_answered_and_ignore_eos_and_min_tokens_honoured(fleet):
    client = fleet["solo"].client()
    plain = client.chat.completions.create(model="x", messages=FRUIT, max_tokens=16, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 12   # it ends by itself
    routed = client.chat.completions.create(model="x", messages=FRUIT, max_tokens=16, temperature=0,
                                            extra_body=ROUTER_FIELDS)
    assert routed.choices[0].message.content == plain.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="x", messages=FRUIT, max_tokens=16, temperature=0, stream=True, extra_body=ROUTER_FIELDS) if c.choices)
    assert streamed == plain.choices[0].message.content
    text = client.completions.create(model="x", prompt="The word is banana. The word is banana. The word is", max_tokens=3,
                                     temperature=0, extra_body={**ROUTER_FIELDS, "echo": False})
    assert "banana" in text.choices[0].text

    endless = client.chat.completions.create(model="x", messages=FRUIT, max_tokens=16, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert endless.usage.completion_tokens == 16 and endless.choices[0].finish_reason == "length"
    assert endless.choices[0].message.content.startswith(plain.choices[0].message.content)
    longer = client.chat.completions.create(model="x", messages=FRUIT, max_tokens=16, temperature=0,
                                            extra_body={"min_tokens": 12})
    assert longer.usage.completion_tokens >= 12
    upto = client.chat.completions.create(model="x", messages=FRUIT, max_completion_tokens=5, temperature=0)
    assert upto.usage.completion_tokens <= 5


@pytest.mark.parametrize("field, value", [("return_hidden_states", True), ("continue_final_message", True),
                                          ("min_tokens", 40), ("ignore_eos", "yes"), ("kv_transfer_params", [1])])
def test_fields_that_cannot_be_honoured_are_refused_by_name(fleet, field, value):
    with pytest.raises(openai.BadRequestError) as refused:
        fleet["solo"].client().chat.completions.create(model="x", messages=FRUIT, max_tokens=8,
                                                        extra_body={field: value})
    assert refused.value.body["param"] == field and field in refused.value.body["message"]


def test_every_response_names_its_instance(fleet):
    solo, keyed, decode = fleet["solo"], fleet["keyed"], fleet["decode"]
    named = "X-KVBridge-Instance"
    ok = solo.client().chat.completions.with_raw_response.create(model="x", messages=FRUIT, max_tokens=2)
    assert ok.headers[named] == solo.port_id                         # host-port, with the port --port 0 bound
    missing = requests.get(solo.url + "/no/such/path", timeout=10)
    assert missing.status_code == 404 and missing.headers[named] == solo.port_id
    for path in ("/health", "/metrics", "/v1/models", "/get_load"):
        assert requests.get(solo.url + path, timeout=10).headers[named] == solo.port_id, path
    assert requests.get(decode.url + "/health", timeout=10).headers[named] == "decode-1"   # KVB_SERVE_INSTANCE_ID

    wrong = keyed.post("/v1/chat/completions", {"model": "x", "messages": FRUIT}, Authorization="Bearer nope")
    assert wrong.status_code == 401 and wrong.headers[named] == keyed.port_id
    # vllm-router sends "Authorization: Bearer " with nothing after it when it has no key: refused where a key is
    # configured, accepted where none is
    empty = keyed.post("/v1/chat/completions", {"model": "x", "messages": FRUIT}, Authorization="Bearer ")
    assert empty.status_code == 401
    right = keyed.post("/v1/chat/completions", {"model": "x", "messages": FRUIT, "max_tokens": 2},
                       Authorization="Bearer k3y-fleet")
    assert right.status_code == 200 and right.headers[named] == keyed.port_id
    accepted = solo.post("/v1/chat/completions", {"model": "x", "messages": FRUIT, "max_tokens": 2},
                         Authorization="Bearer ")
    assert accepted.status_code == 200


def test_what_a_router_asks_a_worker(fleet):
    solo, prefill, decode = fleet["solo"], fleet["prefill"], fleet["decode"]
    assert requests.get(solo.url + "/get_load", timeout=10).json() == {"load": 0}
    info = requests.get(solo.url + "/get_server_info", timeout=10).json()
    assert info["model_id"] == "SmolLM2-135M-Instruct.Q4_1" and info["kv_block_size"] == CHUNK
    assert info["instance_id"] == solo.port_id and info["worker_type"] == "regular"
    assert requests.get(prefill.url + "/get_server_info", timeout=10).json()["worker_type"] == "prefill"
    assert requests.get(decode.url + "/get_server_info", timeout=10).json()["worker_type"] == "decode"
    # KV events: the publisher's bound endpoint (KVB_KV_EVENTS_URL port 0), keyed by data-parallel rank
    sources = requests.get(decode.url + "/kv_event_sources", timeout=10).json()
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", sources["0"]["endpoint"]) and sources["0"]["endpoint"][-2:] != ":0"
    assert requests.get(solo.url + "/kv_event_sources", timeout=10).json() == {}
    maps = Path(f"/proc/{solo.proc.pid}/maps")
    if maps.is_file():   # a serve without KVB_KV_EVENTS_URL (and no cache server) never loads ZeroMQ
        assert "zmq" not in maps.read_text()


def test_pd_roles(fleet):
    prefill, decode = fleet["prefill"], fleet["decode"]
    body = {"model": "x", "messages": DOC_MESSAGES, "temperature": 0, **ROUTER_FIELDS}
    leg = prefill.post("/v1/chat/completions", {**body, **PREFILL_LEG}).json()
    params = leg["kv_transfer_params"]
    assert "transfer_mode" not in params       # it would send vllm-router down its NIXL path
    timings = params["kvbridge"].pop("timings_ms")   # the leg's own path, for taking a hand-off apart
    assert params["kvbridge"] == {"instance": prefill.port_id, "prompt_tokens": leg["usage"]["prompt_tokens"],
                                  "stored_tokens": leg["usage"]["prompt_tokens"], "chunk_size": CHUNK,
                                  "model": "SmolLM2-135M-Instruct.Q4_1"}
    assert set(timings) == {"queue", "first_token", "finished"}   # answered once its write landed, after these
    assert 0 <= timings["queue"] <= timings["first_token"] <= timings["finished"]
    # KVB_SERVE_ROLE=prefill stores every request before its answer, a plain one too
    plain = prefill.post("/v1/completions", {"model": "x", "prompt": DOCUMENT, "max_tokens": 2}).json()
    assert plain["kv_transfer_params"]["kvbridge"]["stored_tokens"] == plain["usage"]["prompt_tokens"]
    wrong_role = decode.post("/v1/chat/completions", {**body, **PREFILL_LEG})
    assert wrong_role.status_code == 400 and "KVB_SERVE_ROLE" in wrong_role.json()["error"]["message"]
    streamed_leg = prefill.post("/v1/chat/completions", {**body, **PREFILL_LEG, "stream": True})
    assert streamed_leg.status_code == 400 and streamed_leg.json()["error"]["param"] == "stream"


@needs_router
def test_the_instance_header_reaches_the_client_through_a_cache_aware_router(fleet, tmp_path):
    solo, decode = fleet["solo"], fleet["decode"]
    router = Router(tmp_path, "router-cache-aware", ["--policy", "cache_aware", "--worker-urls", solo.url, decode.url])
    try:
        client = router.client()
        first = client.chat.completions.with_raw_response.create(model="x", messages=DOC_MESSAGES, max_tokens=4,
                                                                 temperature=0)
        again = client.chat.completions.with_raw_response.create(model="x", messages=DOC_MESSAGES, max_tokens=4,
                                                                 temperature=0)
        assert first.headers["X-KVBridge-Instance"] in (solo.port_id, "decode-1")
        # cache_aware: the same prompt's ids (from the workers' render) lead back to the same worker, warm there
        assert again.headers["X-KVBridge-Instance"] == first.headers["X-KVBridge-Instance"]
        warm = again.parse()
        prompt = warm.usage.prompt_tokens   # every stored chunk, as far as exact mode's cut allows (the default)
        assert warm.usage.prompt_tokens_details.cached_tokens >= safe_reuse(prompt // CHUNK * CHUNK, prompt)
        assert warm.choices[0].message.content == first.parse().choices[0].message.content
    finally:
        router.stop()


@needs_router
def test_a_kv_aware_router_finds_the_publisher_through_the_discovery_endpoints(fleet, tmp_path):
    decode = fleet["decode"]
    endpoint = requests.get(decode.url + "/kv_event_sources", timeout=10).json()["0"]["endpoint"]
    # no --kv-event-source: the router reads /get_server_info (instance, block size) and /kv_event_sources itself
    router = Router(tmp_path, "router-kv-aware", ["--policy", "kv_aware", "--worker-urls", decode.url])
    try:
        wait_for(lambda: f"subscriber for decode-1 rank0 on {endpoint}" in router.log.read_text(),
                 "the router did not subscribe to the worker's KV events", router.log, router.proc, timeout_s=30)
        answer = router.client().chat.completions.with_raw_response.create(model="x", messages=FRUIT, max_tokens=2)
        assert answer.headers["X-KVBridge-Instance"] == "decode-1"
    finally:
        router.stop()


@needs_router
def test_a_pd_pair_behind_the_router_answers_as_a_solo_instance(fleet, tmp_path):
    solo, prefill, decode = fleet["solo"], fleet["prefill"], fleet["decode"]
    # a document no instance saw before: the decode instance has nothing of it resident, only the store can hold it
    vineyard = DOCUMENT.replace("Orchard", "Vineyard").replace("orchard", "vineyard")
    question = [DOC_MESSAGES[0], {"role": "user", "content": f"Document:\n{vineyard}\n\nQuestion: Who prunes in week 2?"}]
    alone = solo.client().chat.completions.create(model="x", messages=question, max_tokens=24, temperature=0)
    router = Router(tmp_path, "router-pd", ["--vllm-pd-disaggregation", "--prefill", prefill.url,
                                            "--decode", decode.url])
    try:
        raw = router.client().chat.completions.with_raw_response.create(model="x", messages=question, max_tokens=24,
                                                                        temperature=0)
        # the decode leg may stream (the router sends the prefill leg whole either way)
        streamed = "".join(c.choices[0].delta.content or "" for c in router.client().chat.completions.create(
            model="x", messages=question, max_tokens=24, temperature=0, stream=True) if c.choices)
    finally:
        router.stop()
    assert streamed == alone.choices[0].message.content
    answer = raw.parse()
    assert answer.choices[0].message.content == alone.choices[0].message.content
    assert answer.usage.prompt_tokens == alone.usage.prompt_tokens
    assert raw.headers["X-KVBridge-Instance"] == "decode-1"
    # the decode leg restored every whole chunk the prefill leg stored (from the shared cache server). The router
    # answers with the decode leg's body but the prefill leg's usage details (its cached_tokens: the prefill's own
    # reuse), so what the decode leg restored travels in a header of its own
    # (to exact mode's cut, serve's default: the rest prefills as a solo run would)
    n = answer.usage.prompt_tokens
    assert int(raw.headers["X-KVBridge-Restored-Tokens"]) >= safe_reuse(n // CHUNK * CHUNK, n)


def live(test):
    """The marks of a test against the llama-server scripts/build_llama_server.sh builds."""
    for mark in needs_llama_server_and_model():
        test = mark(test)
    return test


@live
def test_the_llama_server_engine_renders_with_its_own_tokenizer(tmp_path):
    # one llama.cpp thread: on a shared 2-core machine two spinning threads slow llama-server down tenfold
    worker = Worker(tmp_path, "serve-ls", KVB_SERVE_ENGINE="llama-server", KVB_THREADS="1").ready()
    try:
        chat = {"model": "x", "messages": FRUIT, "max_tokens": 4, "temperature": 0, **ROUTER_FIELDS}
        ids = worker.post("/v1/chat/completions/render", chat).json()["token_ids"]
        answer = worker.post("/v1/chat/completions", chat)
        assert len(ids) == answer.json()["usage"]["prompt_tokens"]
        assert answer.headers["X-KVBridge-Instance"] == worker.port_id
        refused = worker.post("/v1/chat/completions", {**chat, "ignore_eos": True})
        assert refused.status_code == 400 and "KVB_SERVE_ENGINE" in refused.json()["error"]["message"]
        leg = worker.post("/v1/chat/completions", {**chat, **PREFILL_LEG})
        assert leg.status_code == 400 and leg.json()["error"]["param"] == "kv_transfer_params"
    finally:
        assert stop(worker.proc) == 0
