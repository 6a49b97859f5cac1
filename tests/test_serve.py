"""`python -m kvbridge serve` as a person runs it (a real process on a loopback port, the embedded
model, the in-process scheduler) with the official `openai` SDK as the client: chat and completions,
streaming and not, usage with cached_tokens, the greedy answer to a repeated document equal to the
first (cold) one, eight concurrent clients, a disconnect mid-stream freeing its blocks, a full queue
(429 + Retry-After), bad input answered in OpenAI's error shape while the server keeps serving, a
key, CORS, /metrics, a restart that keeps the cache, and SIGTERM letting a running request finish.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import needs_model
from kvbridge.settings.models import EMBEDDED_MODELS
from kvbridge.scheduler.exact import safe_reuse
from process_helpers import clean_env, free_port, start_kvbridge, stop, wait_for

openai = pytest.importorskip("openai", reason="the openai SDK is not installed (requirements.txt)")

pytestmark = [needs_model, pytest.mark.timeout(600)]


def orchard_rota(rules: int) -> str:
    return "# Orchard rota\n\n" + " ".join(
        f"Rule {i}: the {['north', 'south', 'east', 'west'][i % 4]} orchard is pruned in week {i % 9} by crew {i % 5}."
        for i in range(rules))


DOCUMENT = orchard_rota(40)     # about 760 tokens: past Gemma 3's 512-token window
# about 260 tokens, for tests that compare no shared (resident) answer with a cold one: a hit (all but the
# question's ~24 tokens) and a cold prefill (< 64) still cannot be mistaken, and each cold prefill is a
# third as long. A resident share's greedy answer to it left the cold one under f16 K/V (Research.md §11)
SHORT_DOCUMENT = orchard_rota(14)
QUESTION = "Which orchard is pruned in week 3?"
WORDS = ["apple", "river", "candle", "violin", "tiger", "garden", "rocket", "pepper"]


def doc_messages(question: str = QUESTION, document: str = DOCUMENT) -> list[dict]:
    return [{"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": f"Document:\n{document}\n\nQuestion: {question}"}]


def short_doc_messages(question: str = QUESTION) -> list[dict]:
    return doc_messages(question, SHORT_DOCUMENT)


class Served:
    def __init__(self, tmp_path, name: str, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / f"{name}.log"
        settings = dict(KVB_SERVE_PORT=str(self.port), KVB_L2_DIR=str(tmp_path / f"{name}-l2"),
                        KVB_OUTPUT_DIR=str(tmp_path / "output"), KVB_CHUNK_SIZE="32", KVB_CTX_SIZE="1024",
                        KVB_SCHED_KV_CELLS="3072", KVB_SCHED_MAX_RUNNING="4", KVB_SERVE_MAX_TOKENS="48",
                        KVB_SERVE_DRAIN_TIMEOUT="60")
        self.env = clean_env(**{**settings, **env})
        self.proc = None

    def start(self) -> "Served":
        self.proc = start_kvbridge(["serve"], self.env, self.log)
        wait_for(lambda: "KVBridge serve ready on" in self.log.read_text(), "serve did not get ready", self.log,
                 self.proc, timeout_s=180)
        return self

    def stop(self) -> int:
        return stop(self.proc)

    def client(self, key: str = "unused", **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120, **kw)

    def health(self) -> dict:
        return requests.get(self.url + "/health", timeout=10).json()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = Served(tmp_path_factory.mktemp("serve"), "serve").start()
    yield server
    assert server.stop() == 0


def test_models_and_health_name_the_gguf(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1"]
    health = served.health()
    assert health["status"] == "ok"
    # exact mode, serve's default (issue 47): said at start and in the status
    assert (health["exact"], health["exact_off_reason"]) == (True, "")
    assert "exact mode: on" in served.log.read_text()


def test_with_flash_attention_serve_runs_the_mode_off_and_says_why(tmp_path):
    """KVB_FLASH_ATTN=true (a quantised V cache needs it): serve starts with exact mode off, not refused, and says
    why on its start line, in /health, /get_server_info and /metrics."""
    served = Served(tmp_path, "flash", KVB_FLASH_ATTN="true").start()
    try:
        health = served.health()
        info = requests.get(served.url + "/get_server_info", timeout=10).json()
        metrics = requests.get(served.url + "/metrics", timeout=10).text
    finally:
        assert served.stop() == 0
    assert health["exact"] is False and "KVB_FLASH_ATTN=true" in health["exact_off_reason"]
    assert info["exact"] is False and info["exact_off_reason"] == health["exact_off_reason"]
    assert 'kvbridge_serve_engine{field="exact"} 0.0' in metrics
    assert "exact mode: off: KVB_FLASH_ATTN=true" in served.log.read_text()


def test_chat_and_completions_streaming_and_not_with_usage(served):
    client = served.client()
    chat = client.chat.completions.create(model="whatever-a-client-sends", temperature=0, max_tokens=12,
                                          messages=[{"role": "user", "content": "Name one fruit."}])
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens > 0 and chat.usage.prompt_tokens > 0
    pieces, usage = [], None
    for chunk in client.chat.completions.create(model="x", temperature=0, max_tokens=12, stream=True,
                                                stream_options={"include_usage": True},
                                                messages=[{"role": "user", "content": "Name one fruit."}]):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == chat.choices[0].message.content          # greedy: the same answer streamed
    assert usage.completion_tokens == chat.usage.completion_tokens
    # the same prompt again: reused as far as exact mode's cut allows (the default; kvbridge.scheduler.exact)
    assert usage.prompt_tokens_details.cached_tokens >= safe_reuse(usage.prompt_tokens - 1, usage.prompt_tokens)

    text = client.completions.create(model="x", prompt="The word is banana. The word is banana. The word is",
                                     temperature=0, max_tokens=4)
    assert text.choices[0].text.strip().startswith("banana") and text.usage.completion_tokens >= 1
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="x", prompt="The word is banana. The word is banana. The word is", temperature=0, max_tokens=4,
        stream=True) if c.choices)
    assert streamed == text.choices[0].text


def test_a_repeated_document_is_cached_and_answers_as_cold(served):
    client = served.client()
    first = client.chat.completions.with_raw_response.create(model="x", temperature=0, max_tokens=24,
                                                            messages=doc_messages())
    second = client.chat.completions.with_raw_response.create(model="x", temperature=0, max_tokens=24,
                                                             messages=doc_messages())
    cold, warm = first.parse(), second.parse()
    assert cold.usage.prompt_tokens_details.cached_tokens < 64      # at most the chat template's head
    # all but the question's last tokens, as far as exact mode's cut allows (serve's default: up to 63 short)
    assert warm.usage.prompt_tokens_details.cached_tokens >= safe_reuse(warm.usage.prompt_tokens - 1,
                                                                        warm.usage.prompt_tokens)
    assert second.headers["X-KVBridge-Tier"] in ("resident", "L1", "L2")
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert warm.usage.completion_tokens == cold.usage.completion_tokens


def test_eight_concurrent_clients_each_get_their_own_answer(served):
    def ask(word: str) -> tuple[str, str]:
        client = served.client()
        answer = client.completions.create(model="x", prompt=", ".join([word] * 7) + ",", temperature=0, max_tokens=3)
        return word, answer.choices[0].text

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, WORDS))
    assert time.monotonic() - started < 300
    for word, text in answers:
        assert text.strip().startswith(word), (word, text)


def test_a_client_leaving_mid_stream_frees_its_blocks(served):
    before = served.health()
    body = {"model": "x", "stream": True, "temperature": 0, "max_tokens": 48,
            "messages": [{"role": "user", "content": "Tell a long story about a lighthouse keeper."}]}
    with requests.post(served.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        got = [next(lines) for _ in range(4)]      # a few chunks, then hang up
        assert any(line.startswith(b"data: ") for line in got)
    deadline = time.monotonic() + 30
    while True:
        now = served.health()
        if now["running"] == 0 and now["free_blocks"] >= before["free_blocks"]:
            break
        assert time.monotonic() < deadline, now
        time.sleep(0.2)
    metrics = requests.get(served.url + "/metrics", timeout=10).text
    assert 'kvbridge_serve_requests_total{endpoint="chat",status="499"}' in metrics


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(served):
    client = served.client()
    with pytest.raises(openai.BadRequestError) as negative:
        client.chat.completions.create(model="x", max_tokens=-1, messages=[{"role": "user", "content": "Hi"}])
    assert negative.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model="x", max_tokens=4, messages=[{"role": "user", "content": "word " * 1500}])
    assert too_long.value.body["code"] == "context_length_exceeded" and "KVB_CTX_SIZE" in too_long.value.body["message"]
    with pytest.raises(openai.BadRequestError) as two:
        client.chat.completions.create(model="x", n=2, messages=[{"role": "user", "content": "Hi"}])
    assert two.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as tools:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}])
    assert tools.value.body["param"] == "tools"
    broken = requests.post(served.url + "/v1/chat/completions", data=b"{not json", timeout=10,
                           headers={"Content-Type": "application/json"})
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
    priority = requests.post(served.url + "/v1/chat/completions", timeout=10, headers={"X-KVBridge-Priority": "12"},
                             json={"model": "x", "messages": [{"role": "user", "content": "Hi"}]})
    assert priority.status_code == 400 and priority.json()["error"]["param"] == "X-KVBridge-Priority"
    ok = client.chat.completions.create(model="x", max_tokens=4, temperature=0,
                                        messages=[{"role": "user", "content": "Hi"}])
    assert ok.choices[0].message.content is not None


@pytest.fixture(scope="module")
def small_queue(tmp_path_factory):
    """A server with a key, CORS and a one-place queue. The restart test, the module's last on it, restarts
    it and ends it with SIGTERM (one server start fewer than a server of its own)."""
    server = Served(tmp_path_factory.mktemp("queue"), "queue", KVB_SCHED_MAX_RUNNING="1", KVB_SCHED_MAX_WAITING="1",
                    KVB_SERVE_API_KEY_ENV="SERVE_TEST_KEY", SERVE_TEST_KEY="s3cret-key",
                    KVB_SERVE_CORS_ORIGINS="http://localhost:3000").start()
    yield server
    assert server.stop() == 0


def test_key_cors_and_a_full_queue(small_queue):
    served = small_queue
    with pytest.raises(openai.AuthenticationError) as wrong:
        served.client("wrong-key").chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}])
    assert wrong.value.status_code == 401 and wrong.value.body["code"] == "invalid_api_key"
    assert requests.get(served.url + "/v1/models", timeout=10).status_code == 401
    assert served.health()["status"] == "ok"                      # health needs no key
    client = served.client("s3cret-key")
    assert client.models.list().data[0].id
    allowed = requests.options(served.url + "/v1/chat/completions", timeout=10, headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert allowed.headers.get("access-control-allow-origin") == "http://localhost:3000"
    other = requests.options(served.url + "/v1/chat/completions", timeout=10, headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers
    assert "s3cret-key" not in served.log.read_text()

    def post(i: int) -> requests.Response:
        return requests.post(served.url + "/v1/chat/completions", timeout=120,
                             headers={"Authorization": "Bearer s3cret-key"},
                             json={"model": "x", "max_tokens": 24, "temperature": 0,
                                   "messages": [{"role": "user", "content": f"Count to twenty, number {i}."}]})

    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(post, range(6)))
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) >= 2 and 429 in statuses, statuses
    refused = next(r for r in responses if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1
    assert "KVB_SCHED_MAX_WAITING" in refused.json()["error"]["message"]


def test_a_restart_keeps_the_cache_and_sigterm_lets_a_running_request_finish(small_queue):
    served = small_queue
    client = served.client("s3cret-key")
    cold = client.chat.completions.create(model="x", temperature=0, max_tokens=16, messages=doc_messages())
    assert served.stop() == 0
    served.start()                                        # the same L2 directory
    raw = served.client("s3cret-key").chat.completions.with_raw_response.create(model="x", temperature=0,
                                                                                max_tokens=16, messages=doc_messages())
    warm = raw.parse()
    assert raw.headers["X-KVBridge-Tier"] in ("L1", "L2")
    assert warm.usage.prompt_tokens_details.cached_tokens >= safe_reuse(warm.usage.prompt_tokens - 32,
                                                                        warm.usage.prompt_tokens)
    assert warm.choices[0].message.content == cold.choices[0].message.content

    # SIGTERM while a request streams: it finishes, then the process exits 0
    events: list[bytes] = []
    body = {"model": "x", "stream": True, "temperature": 0, "max_tokens": 40,
            "messages": [{"role": "user", "content": "Tell a long story about a lighthouse keeper."}]}
    first_chunk = threading.Event()

    def read() -> None:
        with requests.post(served.url + "/v1/chat/completions", json=body, stream=True, timeout=120,
                           headers={"Authorization": "Bearer s3cret-key"}) as response:
            for line in response.iter_lines():
                if line:
                    events.append(line)
                    first_chunk.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first_chunk.wait(120)
    served.proc.send_signal(signal.SIGTERM)
    reader.join(120)
    assert served.proc.wait(timeout=120) == 0
    assert events[-1] == b"data: [DONE]"
    finish = [json.loads(e[6:]) for e in events[:-1]][-1]["choices"][0]["finish_reason"]
    assert finish in ("stop", "length")


@pytest.mark.parametrize("changes, named", [
    ({"serve_port": 0}, "KVB_SERVE_PORT"),
    ({"serve_engine": "vllm"}, "KVB_SERVE_ENGINE"),
    ({"serve_engine": "ollama"}, "KVB_SERVE_ENGINE"),
    ({"serve_engine": "cloud"}, "KVB_SERVE_ENGINE"),
    ({"serve_api_key_env": "sk-live key"}, "KVB_SERVE_API_KEY_ENV"),
    ({"serve_max_tokens": 0}, "KVB_SERVE_MAX_TOKENS"),
    ({"serve_cors_origins": "localhost:3000"}, "KVB_SERVE_CORS_ORIGINS"),
    ({"serve_max_body_bytes": 100}, "KVB_SERVE_MAX_BODY_BYTES"),
    ({"serve_allowed_hosts": "localhost:8000"}, "KVB_SERVE_ALLOWED_HOSTS"),
    ({"serve_allowed_hosts": "http://example.com"}, "KVB_SERVE_ALLOWED_HOSTS"),
    ({"serve_host": "0.0.0.0"}, "KVB_SERVE_API_KEY_ENV"),
])
def test_bad_serve_settings_name_the_variable(make_settings, changes, named):
    problems = make_settings(**changes).validate()
    assert any(named in p for p in problems), problems


@pytest.mark.parametrize("engine", ["ollama", "cloud", "vllm"])
def test_serve_offers_only_the_engines_it_can_run(capsys, make_settings, engine):
    from kvbridge.__main__ import build_parser
    from kvbridge.errors import BadSettings
    from kvbridge.serve.engines import SERVE_ENGINE_CLASSES, make_serve_engine
    from kvbridge.settings.checks import SERVE_ENGINES

    assert sorted(SERVE_ENGINE_CLASSES) == sorted(SERVE_ENGINES)   # the CLI, the settings check and serve agree
    with pytest.raises(SystemExit) as shown:
        build_parser().parse_args(["serve", "--help"])
    assert shown.value.code == 0
    offered = capsys.readouterr().out
    assert "--engine {scheduler,llama-server}" in offered and "ollama" not in offered and "cloud" not in offered
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["serve", "--engine", engine])
    said = capsys.readouterr().err
    assert refused.value.code == 2
    assert "--engine" in said and engine in said and "scheduler" in said and "llama-server" in said
    with pytest.raises(BadSettings, match="--engine / KVB_SERVE_ENGINE.*scheduler or llama-server"):
        make_serve_engine(make_settings(), engine)      # refused before anything loads


def test_a_key_variable_that_is_empty_stops_the_start_with_its_name(tmp_path):
    import subprocess
    import sys

    from kvbridge.settings import WORK_DIR

    done = subprocess.run([sys.executable, "-m", "kvbridge", "serve", "--port", str(free_port())], cwd=WORK_DIR,
                          env=clean_env(KVB_L2_DIR=str(tmp_path / "l2"), KVB_SERVE_API_KEY_ENV="SERVE_TEST_KEY"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "SERVE_TEST_KEY" in done.stderr and "empty or not set" in done.stderr


@pytest.mark.slow
@pytest.mark.skipif(not EMBEDDED_MODELS["gemma3-270m"].path.is_file(),
                    reason="Gemma 3 270M missing: ./scripts/setup.sh --model gemma3-270m")
def test_serve_runs_gemma3_with_its_cache(tmp_path):
    """KVB_MODEL=gemma3-270m: /v1/models names its GGUF, a repeated document (longer than Gemma's 512-token
    window) is cached and answered as the first time, and after a restart it comes back from the store.
    KVB_SCHED_EXACT=1 on the default f16 K/V, four running: mode off, the shared answer differed from the cold
    one on an AVX2 machine (the unified cache's cells beside a sequence change llama.cpp's rounding;
    Docs/Research.md, "The same answer under concurrency"). Exact mode reuses up to a 32-token cut that leaves
    at least 32 tokens of the solo prefill piece to compute, so up to 63 prompt tokens are computed again."""
    document = DOCUMENT
    messages = [{"role": "user", "content": f"Document:\n{document}\n\nQuestion: {QUESTION}"}]
    served = Served(tmp_path, "gemma", KVB_MODEL="gemma3-270m", KVB_SCHED_EXACT="1").start()
    try:
        client = served.client()
        assert [m.id for m in client.models.list().data] == ["gemma-3-270m-q4_k_m"]
        cold = client.chat.completions.create(model="x", temperature=0, max_tokens=16, messages=messages)
        warm = client.chat.completions.create(model="x", temperature=0, max_tokens=16, messages=messages)
        assert cold.usage.prompt_tokens > 512 + 64
        assert warm.usage.prompt_tokens_details.cached_tokens >= warm.usage.prompt_tokens - 64
        assert warm.choices[0].message.content == cold.choices[0].message.content
    finally:
        assert served.stop() == 0
    served.start()
    try:
        again = served.client().chat.completions.with_raw_response.create(model="x", temperature=0, max_tokens=16,
                                                                          messages=messages)
        assert again.headers["X-KVBridge-Tier"] in ("L1", "L2")
        restored = again.parse()
        assert restored.usage.prompt_tokens_details.cached_tokens >= restored.usage.prompt_tokens - 64
        assert restored.choices[0].message.content == cold.choices[0].message.content
    finally:
        assert served.stop() == 0
