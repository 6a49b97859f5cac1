"""`serve` at its edges (issue 21, item 5): what a request must pass before it reaches the engine, and
the event loop never waiting on the engine. A real `python -m kvbridge serve` on loopback with the
`openai` SDK and `requests` as clients: a body past KVB_SERVE_MAX_BODY_BYTES (413, from Content-Length
and counted while a chunked body arrives), max_tokens past KVB_SERVE_MAX_TOKENS (400), a body that is
not application/json (415), a Host header not in KVB_SERVE_ALLOWED_HOSTS (400), a non-streaming
client that leaves (its request cancelled, its blocks freed), and a bind beyond loopback without a
key (the command exits naming both settings). Then the real app in this process, over a real
scheduler whose lock a test thread holds: /health and /metrics still answer.

Two checks speak raw HTTP over a socket: "refused before the body is read" means answering while
the client is still sending, which `requests` cannot do (it sends the whole body before it reads).
"""
from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from conftest import needs_model
from kvbridge.serve.protocol import parse_generation
from kvbridge.settings import WORK_DIR, Settings
from process_helpers import clean_env, free_port
from test_serve import Served

openai = pytest.importorskip("openai", reason="the openai SDK is not installed (requirements.txt)")

pytestmark = [pytest.mark.timeout(600)]
BODY_LIMIT = 64 << 10
CAP = 400
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def edged(tmp_path_factory):
    server = Served(tmp_path_factory.mktemp("edges"), "edges", KVB_SERVE_MAX_BODY_BYTES="64KiB",
                    KVB_SERVE_MAX_TOKENS=str(CAP)).start()
    yield server
    assert server.stop() == 0


def raw_request(port: int, head: bytes, body_parts=(), timeout_s: float = 20) -> bytes:
    """Send a request head and some body parts, never finishing the body; what the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head)
        for part in body_parts:
            sock.sendall(part)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            got = sock.recv(65536)
            if not got:
                break
            answer += got
        return answer


def requests_total(url: str, endpoint: str, status: int) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    found = re.search(rf'kvbridge_serve_requests_total{{endpoint="{endpoint}",status="{status}"}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


# -- the body --------------------------------------------------------------------------------------
@needs_model
def test_a_body_past_the_limit_is_refused_before_it_is_read(edged):
    too_big = {"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "word " * (BODY_LIMIT // 4)}]}
    refused = requests.post(edged.url + "/v1/chat/completions", json=too_big, timeout=30)
    error = refused.json()["error"]
    assert refused.status_code == 413 and error["code"] == "request_too_large" and error["type"]
    assert "KVB_SERVE_MAX_BODY_BYTES=64KiB" in error["message"]
    with pytest.raises(openai.APIStatusError) as sdk:
        edged.client().chat.completions.create(**too_big)
    assert sdk.value.status_code == 413 and "KVB_SERVE_MAX_BODY_BYTES" in sdk.value.body["message"]

    # Content-Length of 10 GB and one byte sent: answered at once (without a limit it waits for the rest)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10000000000\r\n\r\n")
    assert raw_request(edged.port, head, [b"{"]).startswith(b"HTTP/1.1 413")
    # chunked: counted as it arrives, answered past the limit though the body never ends
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b" " * 8192
    answer = raw_request(edged.port, head, [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (BODY_LIMIT // 8192 + 2))
    assert answer.startswith(b"HTTP/1.1 413") and b"KVB_SERVE_MAX_BODY_BYTES" in answer

    ok = edged.client().chat.completions.create(model="x", max_tokens=2, temperature=0, messages=HI)   # still serving
    assert ok.choices[0].message.content is not None


@needs_model
def test_max_tokens_above_the_cap_is_refused_naming_field_and_cap(edged):
    client = edged.client()
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as above:
            client.chat.completions.create(model="x", messages=HI, **{field: CAP + 1})
        assert above.value.body["param"] == field
        assert f"at most {CAP}" in above.value.body["message"] and "KVB_SERVE_MAX_TOKENS" in above.value.body["message"]
    with pytest.raises(openai.BadRequestError) as text:
        client.completions.create(model="x", prompt="Hi", max_tokens=CAP + 1)
    assert text.value.body["param"] == "max_tokens"
    at_cap = client.completions.create(model="x", prompt="The word is banana. The word is", max_tokens=CAP,
                                       temperature=0, stop=["."])
    assert at_cap.choices[0].text                          # the cap itself is allowed


def test_the_cap_is_the_default_when_a_request_names_none():
    assert parse_generation({"prompt": "Hi"}, "completion", max_tokens_cap=7).max_tokens == 7


@needs_model
def test_json_only_as_application_json(edged):
    body = '{"model": "x", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]}'
    url = edged.url + "/v1/chat/completions"
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                         "application/json; charset=latin-1", None):   # what a cross-site form can send, and worse
        headers = {"Content-Type": content_type} if content_type else {}
        refused = requests.post(url, data=body.encode(), headers=headers, timeout=30)
        assert refused.status_code == 415, (content_type, refused.text)
        assert "application/json" in refused.json()["error"]["message"]
        assert refused.json()["error"]["code"] == "unsupported_media_type"
    for content_type in ("application/json", "Application/JSON; charset=UTF-8"):
        ok = requests.post(url, data=body.encode(), headers={"Content-Type": content_type}, timeout=60)
        assert ok.status_code == 200, (content_type, ok.text)


# -- fields with a meaning of their own ----------------------------------------------------------------
@needs_model
def test_seed_minus_one_is_a_random_seed_as_in_llama_cpp(edged):
    """llama.cpp reads seed -1 as "pick one at random"; it used to be a plain 500 here (numpy refused it)."""
    client = edged.client()
    answer = client.completions.create(model="x", prompt="The word is banana. The word is", max_tokens=2, seed=-1)
    assert answer.choices[0].finish_reason in ("stop", "length")
    seeded = [client.completions.create(model="x", prompt="Once upon a time", max_tokens=6, temperature=1.5,
                                        seed=12345).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]                          # a real seed still decides the sample
    with pytest.raises(openai.BadRequestError) as negative:
        client.completions.create(model="x", prompt="Hi", max_tokens=2, seed=-2)
    assert negative.value.body["param"] == "seed" and "-1 for a random one" in negative.value.body["message"]


@needs_model
def test_the_blend_separator_is_cut_only_from_blend_requests(edged):
    """A message that holds KVB_BLEND_SEPARATOR reaches the model as sent unless the request asks for
    blend (the separator used to be cut out of every prompt: its tokens were missing)."""
    client = edged.client()

    def prompt_tokens(prompt: str, **extra) -> int:
        return client.completions.create(model="x", prompt=prompt, max_tokens=1, temperature=0,
                                         **extra).usage.prompt_tokens

    plain = prompt_tokens("Copy this marker: [KVB_SEP] and stop.")
    without = prompt_tokens("Copy this marker:  and stop.")
    cut = prompt_tokens("Copy this marker: [KVB_SEP] and stop.", extra_headers={"X-KVBridge-Blend": "on"})
    assert plain >= without + 3                             # the separator's own tokens are there
    assert abs(cut - without) <= 2                          # a blend request is cut at it, as before


# -- the Host header ---------------------------------------------------------------------------------
@needs_model
def test_a_host_not_allowed_is_refused_naming_the_setting(edged):
    port = edged.port
    for host in ("evil.example", f"rebound.example:{port}", f"localhost.evil.example:{port}"):
        refused = requests.get(edged.url + "/health", headers={"Host": host}, timeout=10)
        assert refused.status_code == 400, (host, refused.text)
        assert "KVB_SERVE_ALLOWED_HOSTS" in refused.json()["error"]["message"]
        posted = requests.post(edged.url + "/v1/chat/completions", headers={"Host": host}, timeout=10,
                               json={"model": "x", "max_tokens": 2, "messages": HI})
        assert posted.status_code == 400 and posted.json()["error"]["code"] == "host_not_allowed"
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert requests.get(edged.url + "/health", headers={"Host": host}, timeout=10).status_code == 200, host


# -- the client that leaves ----------------------------------------------------------------------------
@needs_model
def test_a_non_streaming_client_that_leaves_is_cancelled_and_its_blocks_freed(edged):
    before = edged.health()
    cancelled_before = requests_total(edged.url, "completions", 499)
    finished_before = requests_total(edged.url, "completions", 200)
    counting = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"      # greedy: it goes on counting to the cap
    with pytest.raises(requests.ReadTimeout):
        requests.post(edged.url + "/v1/completions", timeout=(5, 1.5),
                      json={"model": "x", "prompt": counting, "max_tokens": CAP, "temperature": 0})
    deadline = time.monotonic() + 30
    while requests_total(edged.url, "completions", 499) <= cancelled_before:
        assert time.monotonic() < deadline, "the request was not cancelled when its client left"
        time.sleep(0.2)
    while True:
        now = edged.health()
        if now["running"] == 0 and now["free_blocks"] >= before["free_blocks"]:
            break
        assert time.monotonic() < deadline, now
        time.sleep(0.2)
    assert requests_total(edged.url, "completions", 200) == finished_before    # it never finished


# -- the bind -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["--host", "KVB_SERVE_HOST"])
def test_a_bind_beyond_loopback_without_a_key_stops_the_start(tmp_path, how):
    args = ["--host", "0.0.0.0"] if how == "--host" else []
    env = {"KVB_SERVE_HOST": "0.0.0.0"} if how == "KVB_SERVE_HOST" else {}
    done = subprocess.run([sys.executable, "-m", "kvbridge", "serve", "--port", str(free_port()), *args],
                          cwd=WORK_DIR, env=clean_env(KVB_L2_DIR=str(tmp_path / "l2"), **env),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "KVB_SERVE_HOST" in done.stderr and "KVB_SERVE_API_KEY_ENV" in done.stderr, done.stderr
    assert "loading" not in done.stdout                   # refused before the model is loaded


def test_a_bind_beyond_loopback_with_a_key_passes_the_checks():
    problems = Settings(serve_host="0.0.0.0", serve_api_key_env="SERVE_KEY").validate()
    assert not any("KVB_SERVE_HOST" in p for p in problems), problems
    assert not any("KVB_SERVE_HOST" in p for p in Settings(serve_host="::1").validate())


def test_the_new_settings_read_from_the_environment(tmp_path):
    empty = tmp_path / "empty.env"
    empty.write_text("")
    settings = Settings.from_env(env={"KVB_SERVE_MAX_BODY_BYTES": "64KiB", "KVB_SERVE_ALLOWED_HOSTS": "a.test, ::1"},
                                 env_file=empty)
    assert settings.serve_max_body_bytes == 65536 and settings.serve_allowed_hosts == "a.test, ::1"
    assert not settings._problems and Settings().serve_max_body_bytes == 8 << 20


# -- the event loop and the scheduler's lock ------------------------------------------------------------
@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    """The serve app on a loopback port of this process over a real scheduler (its lock within reach)."""
    from kvbridge.serve.engines import SchedulerEngine

    tmp = tmp_path_factory.mktemp("in-process")
    settings = Settings(chunk_size=32, ctx_size=1024, sched_kv_cells=3072, serve_max_tokens=48, serve_port=0,
                        l2_dir=str(tmp / "l2"), output_dir=str(tmp / "output"))
    engine = SchedulerEngine(settings)
    yield settings, engine
    engine.close()


def serving(settings: Settings, engine, **changes):
    from kvbridge.serve.server import BackgroundServe

    return BackgroundServe(settings.replace(**changes) if changes else settings, engine, port=0)


@needs_model
def test_health_and_metrics_answer_while_the_scheduler_holds_its_lock(in_process):
    settings, engine = in_process
    endpoint = serving(settings, engine)
    try:
        assert requests.get(endpoint.url + "/health", timeout=10).json()["running"] == 0
        answers: list[requests.Response] = []
        lock = engine.scheduler._lock        # what a swap-out holds across store I/O and multi-MB copies
        with lock:
            posting = threading.Thread(target=lambda: answers.append(requests.post(
                endpoint.url + "/v1/completions", timeout=120,
                json={"model": "x", "prompt": "The word is banana. The word is", "max_tokens": 3, "temperature": 0})))
            posting.start()                    # its submit waits for the lock, on a worker thread
            time.sleep(0.5)
            for _ in range(3):
                started = time.monotonic()
                health = requests.get(endpoint.url + "/health", timeout=5)
                assert health.status_code == 200 and time.monotonic() - started < 2.5
                assert health.json()["state_age_s"] > 0      # the last state read, and how old it is
                metrics = requests.get(endpoint.url + "/metrics", timeout=5)
                assert metrics.status_code == 200 and "kvbridge_serve_engine" in metrics.text
            assert requests.get(endpoint.url + "/v1/models", timeout=5).status_code == 200
            assert not answers
        posting.join(120)
        assert answers and answers[0].status_code == 200, answers
        assert requests.get(endpoint.url + "/health", timeout=10).json()["state_age_s"] == 0
    finally:
        endpoint.stop()


@needs_model
def test_the_allowed_hosts_setting_replaces_the_loopback_names_and_star_allows_any(in_process):
    settings, engine = in_process
    named = serving(settings, engine, serve_allowed_hosts="kvbridge.test")

    def status(host: str) -> int:
        return requests.get(named.url + "/health", headers={"Host": host}, timeout=10).status_code

    try:
        assert status(f"kvbridge.test:{named.port}") == 200
        assert status(f"127.0.0.1:{named.port}") == 200         # the address it listens on
        assert status(f"localhost:{named.port}") == 400
    finally:
        named.stop()
    anything = serving(settings, engine, serve_allowed_hosts="*")
    try:
        assert requests.get(anything.url + "/health", headers={"Host": "evil.example"}, timeout=10).status_code == 200
    finally:
        anything.stop()
