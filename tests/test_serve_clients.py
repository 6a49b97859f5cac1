"""`serve` through the client libraries people build on, not only the openai SDK: LangChain's
`ChatOpenAI` (langchain-openai) and LiteLLM, each pointed at one real `python -m kvbridge serve` on
loopback with the embedded model (requirements-test.txt pins both).

Every test runs over both libraries: a chat; a stream whose pieces join to the greedy answer; a repeated
document whose second request reports cached prompt tokens where the library puts them; and serve's 400s
raised as the library's own exceptions (a bad X-KVBridge-Blend value as its invalid-request error, a
prompt beyond the context as its context-overflow error, the one its callers catch to trim a history).
Neither library may reach beyond loopback: every connection or name lookup elsewhere is refused and
counted, and each test fails if one was tried (LiteLLM fetches its model price list at import unless
LITELLM_LOCAL_MODEL_COST_MAP is set).
"""
from __future__ import annotations

import functools
import ipaddress
import operator
import socket
from dataclasses import dataclass

import pytest

from conftest import needs_model
from kvbridge.scheduler.exact import safe_reuse
from test_serve import DOCUMENT, QUESTION, Served

pytestmark = [needs_model, pytest.mark.timeout(300),
              # LiteLLM's own types, on import and on each stream: noise about pydantic, not about serve
              pytest.mark.filterwarnings("ignore:.*using the `ReadOnly` qualifier:UserWarning"),
              pytest.mark.filterwarnings("ignore:Accessing the 'model_(computed_)?fields' attribute")]
MAX_TOKENS = 16
LOOPBACK = ("127.0.0.1", "::1", "localhost")
FRUIT = [{"role": "user", "content": "Name one fruit."}]


def document_messages(library: str) -> list[dict]:
    """A document of the library's own (its name leads it, so no other test's cache covers it)."""
    return [{"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": f"Document ({library}):\n{DOCUMENT}\n\nQuestion: {QUESTION}"}]


@dataclass
class Answer:
    text: str
    prompt_tokens: int
    cached_tokens: int


class Offline:
    """Refuses (and records) every connection and name lookup beyond loopback while it is on."""

    def __init__(self) -> None:
        self.attempts: list[str] = []
        self._connect, self._getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def install(self, patch: pytest.MonkeyPatch) -> None:
        guard = self

        def connect(sock, address):
            if isinstance(address, tuple) and address[0] not in LOOPBACK:
                guard.attempts.append(f"connect {address[0]}:{address[1]}")
                raise OSError(f"test_serve_clients is offline: no connection to {address[0]}")
            return guard._connect(sock, address)

        def getaddrinfo(host, *args, **kwargs):
            name = host.decode() if isinstance(host, bytes) else host
            if name is not None and name not in LOOPBACK and not _is_address(name):   # an address: connect decides
                guard.attempts.append(f"lookup {name}")
                raise socket.gaierror(f"test_serve_clients is offline: no lookup of {name}")
            return guard._getaddrinfo(host, *args, **kwargs)

        patch.setattr(socket.socket, "connect", connect)
        patch.setattr(socket, "getaddrinfo", getaddrinfo)


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class LangChain:
    """langchain-openai's ChatOpenAI on the chat completions API. Cached tokens:
    `usage_metadata["input_token_details"]["cache_read"]`; a 400 is its `OpenAIInvalidRequestError`
    (a langchain_core ModelInvalidRequestError and an openai.BadRequestError), a prompt beyond the
    context its `OpenAIContextOverflowError` (a langchain_core ContextOverflowError)."""

    name = "langchain"

    def __init__(self, url: str) -> None:
        pytest.importorskip("langchain_openai", reason="langchain-openai is not installed (requirements-test.txt)")
        from langchain_core.exceptions import ContextOverflowError, ModelInvalidRequestError
        from langchain_openai import ChatOpenAI

        self.url, self._chat_model = url, ChatOpenAI
        self.invalid_request, self.context_overflow = ModelInvalidRequestError, ContextOverflowError

    def _model(self, headers: dict | None = None):
        return self._chat_model(base_url=self.url + "/v1", api_key="unused", model="x", temperature=0,
                                max_tokens=MAX_TOKENS, max_retries=0, timeout=120, use_responses_api=False,
                                stream_usage=True, default_headers=headers)

    def chat(self, messages: list[dict], headers: dict | None = None) -> Answer:
        return self._answer(self._model(headers).invoke(messages))

    def stream(self, messages: list[dict]) -> tuple[list[str], Answer]:
        chunks = list(self._model().stream(messages))
        whole = functools.reduce(operator.add, chunks)     # LangChain's own way to join chunks
        return [c.content for c in chunks if c.content], self._answer(whole)

    @staticmethod
    def _answer(message) -> Answer:
        usage = message.usage_metadata
        return Answer(message.content, usage["input_tokens"], usage["input_token_details"]["cache_read"])


class LiteLLM:
    """LiteLLM's `completion` with the `openai/` provider prefix and `api_base`. Cached tokens:
    `usage.prompt_tokens_details.cached_tokens`, as in OpenAI's object; a 400 is `litellm.BadRequestError`,
    a prompt beyond the context `litellm.ContextWindowExceededError` (a BadRequestError too)."""

    name = "litellm"

    def __init__(self, url: str) -> None:
        self.litellm = pytest.importorskip("litellm", reason="litellm is not installed (requirements-test.txt)")
        self.litellm.suppress_debug_info = True      # no "Give Feedback / Get Help" banner on each error
        self.url = url
        self.invalid_request, self.context_overflow = self.litellm.BadRequestError, self.litellm.ContextWindowExceededError

    def _completion(self, messages: list[dict], **kw):
        return self.litellm.completion(model="openai/x", api_base=self.url + "/v1", api_key="unused",
                                       messages=messages, temperature=0, max_tokens=MAX_TOKENS, num_retries=0,
                                       timeout=120, **kw)

    def chat(self, messages: list[dict], headers: dict | None = None) -> Answer:
        response = self._completion(messages, extra_headers=headers)
        return self._answer(response.choices[0].message.content, response.usage)

    def stream(self, messages: list[dict]) -> tuple[list[str], Answer]:
        chunks = list(self._completion(messages, stream=True, stream_options={"include_usage": True}))
        pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        usage = [c.usage for c in chunks if getattr(c, "usage", None)]
        assert usage, "no chunk carried the usage"
        return pieces, self._answer("".join(pieces), usage[-1])

    @staticmethod
    def _answer(text: str, usage) -> Answer:
        return Answer(text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)


@pytest.fixture(scope="module")
def offline():
    guard = Offline()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # the price list bundled with it, not fetched
        guard.install(patch)
        with pytest.raises(OSError):      # the guard itself works: TEST-NET-1 and a reserved name are refused
            socket.create_connection(("192.0.2.1", 80), timeout=1)
        with pytest.raises(OSError):
            socket.getaddrinfo("example.com", 443)
        assert guard.attempts == ["connect 192.0.2.1:80", "lookup example.com"]
        guard.attempts.clear()
        yield guard


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = Served(tmp_path_factory.mktemp("clients"), "clients").start()
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module", params=[LangChain, LiteLLM], ids=lambda library: library.name)
def client(request, offline, served):
    return request.param(served.url)      # imported only now, with the guard on


@pytest.fixture(autouse=True)
def stays_on_loopback(offline):
    yield
    assert not offline.attempts, f"a client library reached beyond loopback: {offline.attempts}"


def test_chat(client):
    answer = client.chat(FRUIT)
    assert answer.text.strip()
    assert answer.prompt_tokens > 0


def test_a_stream_joins_to_the_greedy_answer(client):
    whole = client.chat(FRUIT)
    pieces, streamed = client.stream(FRUIT)
    assert len(pieces) > 1                                  # it arrived in pieces, not as one block
    assert "".join(pieces) == streamed.text == whole.text
    # the same prompt again: its KV is reused, as far as exact mode's cut allows (serve's default)
    assert streamed.cached_tokens >= safe_reuse(streamed.prompt_tokens - 1, streamed.prompt_tokens)


def test_a_repeated_document_reports_cached_tokens(client):
    messages = document_messages(client.name)
    cold = client.chat(messages)
    warm = client.chat(messages)
    assert cold.cached_tokens < 64                          # at most the chat template's head
    assert warm.cached_tokens > 0 and warm.cached_tokens >= safe_reuse(warm.prompt_tokens - 32, warm.prompt_tokens)
    assert warm.text == cold.text


def test_serve_refusals_are_the_librarys_own_errors(client):
    with pytest.raises(client.invalid_request) as blend:
        client.chat(FRUIT, headers={"X-KVBridge-Blend": "maybe"})
    assert "X-KVBridge-Blend" in str(blend.value) and "'on' or 'off'" in str(blend.value)
    assert blend.value.status_code == 400
    with pytest.raises(client.context_overflow) as too_long:
        client.chat([{"role": "user", "content": "word " * 1500}])
    assert "prompt is too long" in str(too_long.value) and "KVB_CTX_SIZE" in str(too_long.value)
    assert client.chat(FRUIT).text.strip()                 # and serve keeps serving
