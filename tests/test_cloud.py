"""The OpenAI-compatible cloud engine: a real llama-server on loopback, replayed provider streams, bad input.

Hosted providers cannot be reached from here, so their streams are replayed by a loopback HTTP server
(tests/replay_server.py) from fixtures in each provider's wire shape; the backend talks real HTTP to it.
The live tests run the real llama-server (built by scripts/build_llama_server.sh) on the embedded model.
A fake key sits in an environment variable; no test may find it in any message, note, log or file.
"""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest

from kvbridge.backends import make_backend, resolve_engine
from kvbridge.backends.base import EngineReport, Prompt
from kvbridge.backends.cloud import COLD_NOTE, CloudBackend, iter_sse_data, retry_delay_s, server_root
from kvbridge.backends.llama_server.process import ServerProcess, built_binary, free_port, pinned_llama_cpp_version
from kvbridge.settings import EMBEDDED_MODEL_PATH, Settings
from kvbridge.errors import BadSettings, BudgetExhausted, EngineUnavailable, KVBridgeError, NeedsKey
from kvbridge.engine.records import RequestRecord
from replay_server import Reply, ReplayServer, load_fixture

KEY_VAR = "KVB_TEST_FAKE_PROVIDER_KEY"
FAKE_KEY = "sk-kvbtest-FAKE-0123456789abcdef-DO-NOT-LEAK"
MESSAGES = ({"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "How much is a full service?"})
PROVIDER_FIXTURES = ["cloud_openai_stream.json", "cloud_deepseek_stream.json", "cloud_groq_stream.json",
                     "cloud_openrouter_stream.json", "cloud_anthropic_style_stream.json",
                     "cloud_llama_server_timings_stream.json"]


@pytest.fixture(autouse=True)
def fake_key(monkeypatch, caplog):
    """Every test runs with the fake key set and DEBUG logging captured; none may log the key."""
    monkeypatch.setenv(KEY_VAR, FAKE_KEY)
    caplog.set_level(logging.DEBUG)
    yield
    assert FAKE_KEY not in caplog.text


def cloud_settings(base_url: str, **changes) -> Settings:
    values = dict(engine="cloud", cloud_base_url=base_url, cloud_model="gpt-4.1-mini", cloud_api_key_env=KEY_VAR,
                  cloud_extra_headers='{"X-Title": "kvbridge-tests"}', cloud_timeout=10.0, cloud_max_retries=2)
    return Settings(**{**values, **changes})


def started(settings: Settings) -> CloudBackend:
    backend = make_backend("cloud", settings)
    backend.retry_base_s = 0.01
    backend.start()
    return backend


def message_prompt(backend, messages=MESSAGES) -> Prompt:
    text = backend.render(messages)
    return Prompt(text, tuple(backend.tokenize(text)), tuple(messages), backend.approx_tokens)


def run(backend, prompt: Prompt, *, cold: bool = False, n_predict: int = 8) -> tuple[str, EngineReport, float]:
    report = EngineReport()
    start, ttft, pieces = time.perf_counter(), 0.0, []
    for piece in backend.generate(prompt, n_predict=n_predict, temperature=0.0, use_native_cache=not cold,
                                  report=report):
        ttft = ttft or time.perf_counter() - start
        pieces.append(piece)
    return "".join(pieces), report, ttft


def assert_no_key(*texts: object) -> None:
    for text in texts:
        assert FAKE_KEY not in str(text)


# --- small pure parts ---------------------------------------------------------------------------

def test_registered_with_aliases_as_shadow_engine():
    for name in ("cloud", "openai", "api"):
        assert resolve_engine(name).cls is CloudBackend
    assert CloudBackend.kv_mode == "shadow"
    assert set(resolve_engine("cloud").fields) <= set(Settings.__dataclass_fields__)


def test_retry_delay_honours_retry_after_and_backs_off():
    assert retry_delay_s("2", 0, 0.5, 30) == 2.0
    assert retry_delay_s("0", 3, 0.5, 30) == 0.0
    assert retry_delay_s("999", 0, 0.5, 30) == 30          # bounded
    assert retry_delay_s(None, 0, 0.5, 30) == 0.5
    assert retry_delay_s(None, 3, 0.5, 30) == 4.0          # 0.5 * 2^3
    assert retry_delay_s("Wed, 21 Oct 2015 07:28:00 GMT", 0, 0.5, 30) == 0.0  # a date in the past


def test_sse_parsing_joins_data_lines_and_drops_comments():
    lines = [b": OPENROUTER PROCESSING", b"", b"event: message", b"data: {\"a\":", b"data: 1}", b"", b"data:[DONE]"]
    assert list(iter_sse_data(iter(lines))) == ['{"a":\n1}', "[DONE]"]


def test_server_root_strips_v1():
    assert server_root("http://127.0.0.1:8080/v1") == "http://127.0.0.1:8080"
    assert server_root("https://api.example.com/v1/") == "https://api.example.com"
    assert server_root("https://openrouter.ai/api/v1") == "https://openrouter.ai/api"


# --- replayed hosted providers ----------------------------------------------------------------

@pytest.mark.parametrize("fixture", PROVIDER_FIXTURES)
def test_provider_stream_is_normalised(fixture):
    """Hosted providers cannot be reached from here: their SSE usage shapes are replayed on loopback."""
    recorded = load_fixture(fixture)
    expected = recorded["expected"]
    with ReplayServer() as server:
        server.add("POST", "/v1/chat/completions", Reply.sse(recorded["sse"], chunk_delay_s=0.002))
        backend = started(cloud_settings(server.url + "/v1", cloud_token_budget=100_000))
        assert backend.approx_tokens and "approx" in backend.describe()  # no /tokenize: 404
        prompt = message_prompt(backend)
        text, report, ttft = run(backend, prompt)
        assert text == expected["text"] and ttft > 0
        assert report.engine_cached_tokens == expected["cached"]
        assert f"cached tokens from {expected['field']}" in report.notes
        assert (report.prompt_tokens, report.completion_tokens) == (expected["prompt_tokens"],
                                                                    expected["completion_tokens"])
        assert report.engine_prefill_tokens == expected["prompt_tokens"] - expected["cached"]
        assert backend.kv_fingerprint()["tokens"] == "approx v1"
        assert backend.remaining_budget() == 100_000 - expected["prompt_tokens"] - expected["completion_tokens"]

        sent = server.requests_to("/v1/chat/completions")[0]
        body = sent.json()
        assert body["messages"] == list(MESSAGES) and body["model"] == "gpt-4.1-mini"
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == 8 and body["temperature"] == 0.0
        assert sent.headers["Authorization"] == f"Bearer {FAKE_KEY}"
        assert sent.headers["X-Title"] == "kvbridge-tests"


def test_cold_mode_puts_a_fresh_nonce_first():
    """Hosted providers cannot be reached from here: the OpenAI stream is replayed; we check what was sent."""
    recorded = load_fixture("cloud_openai_stream.json")
    with ReplayServer() as server:
        server.add("POST", "/v1/chat/completions", Reply.sse(recorded["sse"]))
        backend = started(cloud_settings(server.url + "/v1"))
        prompt = message_prompt(backend)
        reports = [run(backend, prompt, cold=True)[1] for _ in range(2)]
        _, native, _ = run(backend, Prompt("plain text prompt", (1, 2, 3)))
        sent = [r.json()["messages"] for r in server.requests_to("/v1/chat/completions")]
    firsts = [m[0]["content"] for m in sent[:2]]
    assert all(re.fullmatch(r"[0-9a-f]{32} \(kvbridge cold-run nonce\)\n" + re.escape(MESSAGES[0]["content"]), f)
               for f in firsts)
    assert firsts[0] != firsts[1]
    assert sent[0][1:] == list(MESSAGES[1:])
    assert all(COLD_NOTE in r.notes for r in reports) and COLD_NOTE not in native.notes
    assert sent[2] == [{"role": "user", "content": "plain text prompt"}]   # no messages: the text as one user turn


def test_tokenize_is_detected_once():
    """A /tokenize endpoint is probed once; without one every later call is approximate, with no request."""
    with ReplayServer() as server:
        backend = started(cloud_settings(server.url + "/v1"))
        for _ in range(3):
            backend.tokenize("some text")
        assert len(server.requests_to("/tokenize")) == 1 and backend.approx_tokens
    with ReplayServer() as server:
        server.add("POST", "/tokenize", lambda req: Reply.json({"tokens": list(range(len(req.json()["content"])))}))
        backend = started(cloud_settings(server.url + "/v1"))
        assert not backend.approx_tokens and backend.tokenize("abcd") == [0, 1, 2, 3]
        assert "/tokenize" in backend.describe()


# --- bad input ---------------------------------------------------------------------------------

def test_unreachable_provider_names_the_setting():
    backend = make_backend("cloud", cloud_settings(f"http://127.0.0.1:{free_port()}/v1"))
    with pytest.raises(EngineUnavailable, match="not reachable.*check KVB_CLOUD_BASE_URL") as caught:
        backend.start()
    assert_no_key(caught.value)


def test_missing_settings_are_clear():
    with pytest.raises(BadSettings, match="KVB_CLOUD_PROVIDER .* or KVB_CLOUD_BASE_URL"):
        make_backend("cloud", cloud_settings("")).start()
    with pytest.raises(BadSettings, match="KVB_CLOUD_EXTRA_HEADERS"):
        make_backend("cloud", cloud_settings("http://127.0.0.1:9/v1", cloud_extra_headers="[1]")).start()


def test_401_names_the_variable_not_the_key():
    """A hosted provider's 401 (its body echoes the key, as OpenAI's does in part) is replayed on loopback."""
    with ReplayServer() as server:
        server.add("POST", "/v1/chat/completions", Reply.json(
            {"error": {"message": f"Incorrect API key provided: {FAKE_KEY}.", "type": "invalid_request_error",
                       "code": "invalid_api_key"}}, status=401))
        backend = started(cloud_settings(server.url + "/v1"))
        with pytest.raises(NeedsKey) as caught:
            run(backend, message_prompt(backend))
    assert str(caught.value) == f"the provider refused the key in ${KEY_VAR} (401)"


def test_missing_key_variable_sends_nothing():
    with ReplayServer() as server:
        backend = started(cloud_settings(server.url + "/v1", cloud_api_key_env="KVB_TEST_UNSET_VARIABLE"))
        with pytest.raises(NeedsKey, match="KVB_CLOUD_API_KEY_ENV names KVB_TEST_UNSET_VARIABLE, but "
                                           "KVB_TEST_UNSET_VARIABLE is not set"):
            run(backend, message_prompt(backend))
        assert server.requests_to("/v1/chat/completions") == []


def test_a_key_pasted_as_the_variable_name_is_never_echoed():
    with ReplayServer() as server:
        backend = started(cloud_settings(server.url + "/v1", cloud_api_key_env=FAKE_KEY))
        with pytest.raises(NeedsKey, match="must be the NAME") as caught:
            run(backend, Prompt("hi", (1,)))
    assert_no_key(caught.value, backend.describe())


def test_429_then_success_respects_retry_after():
    """Hosted providers cannot be reached from here: a rate limit (Retry-After: 0) then a stream is replayed."""
    recorded = load_fixture("cloud_openai_stream.json")
    with ReplayServer() as server:
        server.add("POST", "/v1/chat/completions",
                   Reply.json({"error": {"message": "Rate limit reached"}}, status=429, headers={"Retry-After": "0"}),
                   Reply.json({"error": {"message": "upstream overloaded"}}, status=503),
                   Reply.sse(recorded["sse"]))
        backend = started(cloud_settings(server.url + "/v1"))
        text, report, _ = run(backend, message_prompt(backend))
        assert text == recorded["expected"]["text"] and len(server.requests_to("/v1/chat/completions")) == 3
    assert "retried 2 time(s) after 429/5xx answers" in report.notes and backend.counters["cloud_retries"] == 2


def test_retries_are_bounded():
    with ReplayServer() as server:
        server.add("POST", "/v1/chat/completions", Reply.json({"error": {"message": "overloaded"}}, status=503))
        backend = started(cloud_settings(server.url + "/v1", cloud_max_retries=2))
        with pytest.raises(EngineUnavailable, match="kept answering 503 after 2 retries.*overloaded"):
            run(backend, message_prompt(backend))
        assert len(server.requests_to("/v1/chat/completions")) == 3


def test_a_stalled_stream_is_a_clear_timeout():
    """A provider that stops sending mid-stream is replayed on loopback (a chunk arrives after the timeout)."""
    recorded = load_fixture("cloud_openai_stream.json")
    with ReplayServer() as server:
        server.add("POST", "/v1/chat/completions", Reply.sse(recorded["sse"], chunk_delay_s=0.5))
        backend = started(cloud_settings(server.url + "/v1", cloud_timeout=0.2))
        with pytest.raises(EngineUnavailable, match=r"sent nothing for KVB_CLOUD_TIMEOUT=0\.2 s mid-stream"):
            run(backend, message_prompt(backend))


def test_malformed_stream_lines_are_skipped_and_counted():
    """A flaky proxy's damaged SSE stream is replayed on loopback."""
    recorded = load_fixture("cloud_malformed_stream.json")
    with ReplayServer() as server:
        server.add("POST", "/v1/chat/completions", Reply.sse(recorded["sse"]))
        backend = started(cloud_settings(server.url + "/v1"))
        text, report, _ = run(backend, message_prompt(backend))
    assert text == recorded["expected"]["text"] and report.engine_cached_tokens == 256
    assert "skipped 2 malformed line(s) in the provider's stream" in report.notes
    assert backend.counters["malformed_stream_lines"] == 2


def test_retries_and_malformed_lines_reach_the_engine_metrics(tmp_path):
    """A rate limit, then a damaged SSE stream, replayed on loopback; CachedEngine is real."""
    from kvbridge.engine.cached_engine import CachedEngine

    recorded = load_fixture("cloud_malformed_stream.json")
    with ReplayServer() as server:
        server.add("POST", "/v1/chat/completions",
                   Reply.json({"error": {"message": "Rate limit reached"}}, status=429, headers={"Retry-After": "0"}),
                   Reply.sse(recorded["sse"]))
        settings = cloud_settings(server.url + "/v1", l2_dir=str(tmp_path / "l2"))
        with CachedEngine(settings, make_backend("cloud", settings)) as engine:
            record = engine.infer(list(MESSAGES), mode="native")
            assert not record.error and record.text == recorded["expected"]["text"]
            assert engine.metrics.count("malformed_stream_lines") == 2
            assert engine.metrics.count("cloud_retries") == 1


def test_errors_echoing_the_key_are_scrubbed():
    """A provider error that quotes the key back, before and during the stream, is replayed on loopback."""
    with ReplayServer() as server:
        server.add("POST", "/v1/chat/completions",
                   Reply.json({"error": {"message": f"bad request for key {FAKE_KEY}"}}, status=400),
                   Reply.sse([f'data: {{"error": {{"message": "stream aborted for {FAKE_KEY}"}}}}', ""]))
        backend = started(cloud_settings(server.url + "/v1"))
        with pytest.raises(KVBridgeError, match=r"refused the request \(400\): bad request for key \[key\]") as first:
            run(backend, message_prompt(backend))
        with pytest.raises(KVBridgeError, match=r"mid-stream: stream aborted for \[key\]") as second:
            run(backend, message_prompt(backend))
    assert_no_key(first.value, second.value)


def test_budget_is_a_spend_guard():
    """Hosted providers cannot be reached from here: the OpenAI stream (2,014 billed tokens) is replayed."""
    recorded = load_fixture("cloud_openai_stream.json")
    with ReplayServer() as server:
        server.add("POST", "/v1/chat/completions", Reply.sse(recorded["sse"]))
        backend = started(cloud_settings(server.url + "/v1", cloud_token_budget=2_000))
        assert backend.remaining_budget() == 2_000
        run(backend, message_prompt(backend))
        assert backend.remaining_budget() == 0 and backend.tokens_used == 2_014
        with pytest.raises(BudgetExhausted, match="2014 of KVB_CLOUD_TOKEN_BUDGET=2000"):
            run(backend, message_prompt(backend))
        assert len(server.requests_to("/v1/chat/completions")) == 1
    assert make_backend("cloud", cloud_settings("http://x/v1")).remaining_budget() is None


def test_the_key_appears_nowhere(tmp_path, caplog):
    """Every error path and every output of a request, written out as a record would be: no key anywhere."""
    recorded = load_fixture("cloud_openai_stream.json")
    outputs: list[object] = []
    with ReplayServer() as server:
        server.add("POST", "/v1/chat/completions",
                   Reply.json({"error": {"message": f"Incorrect API key provided: {FAKE_KEY}"}}, status=401),
                   Reply.sse(recorded["sse"]))
        backend = started(cloud_settings(server.url + "/v1", cloud_token_budget=2_014))
        for _ in range(3):
            record = RequestRecord(mode="native", engine="cloud", kv_mode="shadow")
            try:
                _, report, _ = run(backend, message_prompt(backend))
                record.engine_cached_tokens = report.engine_cached_tokens
                record.notes = "; ".join(report.notes)
            except KVBridgeError as err:
                record.error = str(err)
                outputs.append(repr(err))
            outputs.append(record.to_dict())
        outputs += [backend.describe(), repr(backend), vars(backend), backend.settings]
    (tmp_path / "run.json").write_text(json.dumps(outputs, default=str))
    errors = [o["error"] for o in outputs if isinstance(o, dict) and o.get("error")]
    assert errors[0].endswith("(401)") and "KVB_CLOUD_TOKEN_BUDGET" in errors[1]
    assert_no_key(*outputs, caplog.text)
    for path in tmp_path.rglob("*"):
        assert not path.is_file() or FAKE_KEY.encode() not in path.read_bytes()


# --- live: the real llama-server on loopback --------------------------------------------------

def _llama_server_binary() -> Path:
    configured = Settings.from_env().llama_server_bin
    return Path(configured).expanduser() if configured else built_binary(pinned_llama_cpp_version())


LLAMA_SERVER = _llama_server_binary()
LIVE_TIMEOUT_S = 180.0  # a 600-token prefill on 2 busy cores can take tens of seconds before the first byte
DOCUMENT = " ".join(
    f"Section {i}: the bicycle shop logs repair number {i * 7}, a {['tube', 'brake', 'chain', 'wheel'][i % 4]} job "
    f"finished on day {i % 28 + 1}." for i in range(24))


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    """The real llama-server on the embedded model, one slot, demanding the fake key (--api-key)."""
    if not LLAMA_SERVER.is_file():
        pytest.skip(f"llama-server not built at {LLAMA_SERVER}: run scripts/build_llama_server.sh "
                    "(./scripts/test.sh builds it) or set KVB_LLAMA_SERVER_BIN")
    if not EMBEDDED_MODEL_PATH.is_file():
        pytest.skip(f"embedded model {EMBEDDED_MODEL_PATH} missing (run scripts/setup.sh)")
    server = ServerProcess(LLAMA_SERVER, ["-m", str(EMBEDDED_MODEL_PATH), "-c", "2048", "-np", "1", "-t", "2",
                                          "--cache-ram", "0", "--api-key", FAKE_KEY], "127.0.0.1", free_port())
    server.start()   # the same process handling the llama-server engine uses (own group, log, no orphans)
    try:
        server.wait_healthy(90)
        yield server.url
    finally:
        server.stop()


@pytest.mark.live
def test_live_llama_server_streams_and_reports_cached_tokens(llama_server):
    backend = started(cloud_settings(llama_server + "/v1", cloud_model="smollm2", cloud_extra_headers="",
                                     cloud_timeout=LIVE_TIMEOUT_S))
    assert not backend.approx_tokens, backend.tokenizer_note          # the server's /tokenize
    messages = ({"role": "system", "content": "Answer from the log. " + DOCUMENT},
                {"role": "user", "content": "Which job was repair number 21?"})
    prompt = message_prompt(backend, messages)
    assert len(prompt.tokens) > 300

    text, first, first_ttft = run(backend, prompt)                   # fills the slot
    _, warm, warm_ttft = run(backend, prompt)                        # same prompt: the slot's prefix cache
    _, cold, cold_ttft = run(backend, prompt, cold=True)             # nonce first: nothing to reuse

    assert text and first_ttft > 0 and warm_ttft > 0 and cold_ttft > 0
    for report in (first, warm, cold):
        assert "cached tokens from usage.prompt_tokens_details.cached_tokens" in report.notes
        assert report.prompt_tokens > 300 and 0 < report.completion_tokens <= 8
    assert warm.engine_cached_tokens >= warm.prompt_tokens - 8       # all but the last token(s) reused
    assert cold.engine_cached_tokens <= 4                           # at most the template's opening tokens
    assert COLD_NOTE in cold.notes
    assert warm_ttft < cold_ttft
    assert backend.tokens_used == sum(r.prompt_tokens + r.completion_tokens for r in (first, warm, cold))


@pytest.mark.live
def test_live_llama_server_refuses_a_wrong_key(llama_server, monkeypatch):
    backend = started(cloud_settings(llama_server + "/v1", cloud_model="smollm2"))
    monkeypatch.setenv(KEY_VAR, "sk-kvbtest-the-wrong-key-0000")
    with pytest.raises(NeedsKey, match=rf"the provider refused the key in \${KEY_VAR} \(401\)"):
        run(backend, Prompt("hello", (1,)))


@pytest.mark.live
def test_live_cached_engine_shadow_records(llama_server, tmp_path):
    """KVB_ENGINE=cloud against the real llama-server through CachedEngine: what the bench and GUI show."""
    from kvbridge.engine.cached_engine import CachedEngine

    settings = cloud_settings(llama_server + "/v1", cloud_model="smollm2", cloud_extra_headers="", chunk_size=32,
                              l2_dir=str(tmp_path / "l2"), n_predict=4, cloud_timeout=LIVE_TIMEOUT_S)
    messages = [{"role": "system", "content": "Answer from the log. " + DOCUMENT},
                {"role": "user", "content": "Which job was repair number 21?"}]
    with CachedEngine(settings, make_backend("cloud", settings)) as engine:
        assert engine.status()["kv_mode"] == "shadow" and FAKE_KEY not in json.dumps(engine.status(), default=str)
        cold = engine.infer(messages, mode="cold")
        first = engine.infer(messages, mode="lmcache")       # indexes the prompt; the slot holds the nonce'd one
        predicted = engine.infer(messages, mode="lmcache")   # predicted from the index, reused by the slot
    for record in (cold, first, predicted):
        assert not record.error and record.ttft_ms > 0 and not record.approx
        assert "cached tokens from usage.prompt_tokens_details.cached_tokens" in record.notes
    assert cold.engine_cached_tokens <= 4 and COLD_NOTE in cold.notes
    assert first.predicted_reuse_tokens == 0 and first.engine_cached_tokens <= 4
    assert predicted.engine_cached_tokens >= predicted.prompt_tokens - 32
    # the index predicts at least every whole 32-token chunk; the engine's own cache reused about that much
    assert predicted.prompt_tokens // 32 * 32 <= predicted.predicted_reuse_tokens <= predicted.prompt_tokens
    assert predicted.engine_cached_tokens >= predicted.predicted_reuse_tokens - 32
