"""Any OpenAI-compatible /chat/completions endpoint in shadow mode: hosted APIs, vLLM, llama-server.

Place in the flow: prompt -> **tokens (the server's /tokenize when it has one, else approximate)** ->
chunk hashes -> lookup (prediction only) -> **the provider prefills and streams** -> **the provider's
own cached-token counter, normalised (kvbridge.backends.usage)**.

The API key is read from the environment variable *named* by KVB_CLOUD_API_KEY_ENV at request time,
sent in one header, and never stored on this object, logged, or put in any message.
"""
from __future__ import annotations

import email.utils
import json
import logging
import os
import re
import threading
import time
import uuid
from datetime import datetime, timezone
from collections.abc import Mapping
from typing import Iterator, Sequence

import requests

from kvbridge.settings import CLOUD_PRESETS, CloudPreset, Settings, is_variable_name, looks_like_secret
from kvbridge.errors import BadSettings, BudgetExhausted, EngineUnavailable, KVBridgeError, NeedsKey
from kvbridge.backends.approx_tokenizer import ApproxTokenizer
from kvbridge.backends.base import Backend, EngineReport, Message, Prompt
from kvbridge.backends.chat_template import chatml
from kvbridge.backends.http_util import error_message, error_text, is_read_timeout, json_objects
from kvbridge.backends.registry import EngineSpec, register_engine
from kvbridge.backends.usage import UsageCounts, usage_counts_from

log = logging.getLogger(__name__)

COLD_NOTE = "cold: a unique nonce line starts the first message, so the provider's prompt cache cannot serve it"
# events counted in self.counters, so they reach CachedEngine's metrics
RETRY_COUNTER = "cloud_retries"
MALFORMED_COUNTER = "malformed_stream_lines"
_VAR_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def server_root(base_url: str) -> str:
    """http://host:8080/v1 -> http://host:8080 (llama-server's /tokenize lives at the root)."""
    return re.sub(r"/v1/?$", "", base_url.rstrip("/"))


def parse_extra_headers(text: str) -> dict[str, str]:
    if not text.strip():
        return {}
    try:
        headers = json.loads(text)
    except ValueError:
        headers = None
    if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise BadSettings('KVB_CLOUD_EXTRA_HEADERS is not a JSON object of strings; use e.g. {"X-Title": "kvbridge"}')
    return headers


def retry_delay_s(retry_after: str | None, attempt: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait before retry `attempt` (0-based): the server's Retry-After, else exponential backoff."""
    if retry_after:
        try:
            return min(cap_s, max(0.0, float(retry_after)))
        except ValueError:
            when = email.utils.parsedate_to_datetime(retry_after) if retry_after.strip() else None
            if when is not None:
                when = when if when.tzinfo else when.replace(tzinfo=timezone.utc)
                return min(cap_s, max(0.0, (when - datetime.now(timezone.utc)).total_seconds()))
    return min(cap_s, base_s * (2 ** attempt))


def sse_data_until_done(lines: Iterator[bytes]) -> Iterator[str]:
    """The events' data up to OpenAI's closing `[DONE]`."""
    for data in iter_sse_data(lines):
        if data.strip() == "[DONE]":
            return
        yield data


def iter_sse_data(lines: Iterator[bytes]) -> Iterator[str]:
    """The data of each server-sent event (data: lines joined); comments, event: and id: lines dropped."""
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        if not line.strip():
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield "\n".join(data)


def _cloud_settings_problems(s: Settings, environ: Mapping[str, str]) -> list[str]:
    problems = []
    known = ", ".join(CLOUD_PRESETS)
    preset = s.cloud_preset()
    if s.cloud_provider and preset is None:
        problems.append(f"KVB_CLOUD_PROVIDER={s.cloud_provider!r} is not a known provider; use one of {known}, "
                        "or leave it empty and set KVB_CLOUD_BASE_URL")
    elif not s.cloud_provider and not s.cloud_base_url:
        problems.append(f"the cloud engine needs KVB_CLOUD_PROVIDER (one of {known}) or KVB_CLOUD_BASE_URL "
                        "(any OpenAI-compatible server, e.g. http://127.0.0.1:8080/v1)")
    if not s.resolved_cloud_model():
        problems.append("KVB_CLOUD_MODEL is empty; name the model to call (a llama-server accepts any name)")
    problems += _key_variable_problems(s, environ, preset)
    problems += _extra_header_problems(s.cloud_extra_headers)
    return problems


def _key_variable_problems(s: Settings, environ: Mapping[str, str], preset: CloudPreset | None) -> list[str]:
    _, key_env = s.cloud_endpoint()
    if not key_env:
        return []
    if not is_variable_name(key_env) or looks_like_secret(key_env):
        # never echo it: it may be the key itself
        return ["KVB_CLOUD_API_KEY_ENV must be the NAME of an environment variable (like OPENAI_API_KEY), "
                "not the key itself"]
    if environ.get(key_env):
        return []
    where = "KVB_CLOUD_API_KEY_ENV names" if s.cloud_api_key_env else \
        f"the {preset.label if preset else 'cloud'} preset (KVB_CLOUD_PROVIDER) reads its key from"
    return [f"{where} {key_env} but that variable is not set; export it in your shell "
            "(KVBridge reads keys only from the environment, never from files)"]


def _extra_header_problems(text: str) -> list[str]:
    try:
        parse_extra_headers(text)
    except BadSettings as error:
        return [str(error)]
    if looks_like_secret(text):
        return ["KVB_CLOUD_EXTRA_HEADERS seems to carry a key or token; keys go in the variable named by "
                "KVB_CLOUD_API_KEY_ENV"]
    return []


class CloudBackend(Backend):
    key = "cloud"
    kv_mode = "shadow"

    @classmethod
    def settings_problems(cls, settings: Settings, environ: Mapping[str, str]) -> list[str]:
        return _cloud_settings_problems(settings, environ)
    prompts_leave_machine = True
    retry_base_s = 0.5       # first backoff on 429/5xx without Retry-After; doubles each retry
    retry_cap_s = 30.0       # longest single wait, whatever Retry-After says

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.base_url, self.key_env = settings.cloud_endpoint()
        self.model = settings.resolved_cloud_model()
        self.provider_label = preset.label if (preset := settings.cloud_preset()) else "OpenAI-compatible server"
        self.approx_tokens = True
        self.tokenizer_note = "not detected yet"
        self._tokenize_url: str | None = None
        self._tokenizer_detected = False
        self._approx = ApproxTokenizer()
        self._session = requests.Session()
        self._lock = threading.Lock()
        self._tokens_used = 0

    # lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if not self.base_url:
            raise BadSettings("the cloud engine needs KVB_CLOUD_PROVIDER (a preset) or KVB_CLOUD_BASE_URL "
                              "(any OpenAI-compatible server, e.g. http://127.0.0.1:8080/v1)")
        if not self.model:
            raise BadSettings("KVB_CLOUD_MODEL is empty; name the model to call")
        parse_extra_headers(self.settings.cloud_extra_headers)
        self._detect_tokenizer()

    def stop(self) -> None:
        self._session.close()
        self._session = requests.Session()

    def describe(self) -> str:
        return f"{self.provider_label} at {self.base_url}, model {self.model} (tokens: {self.tokenizer_note})"

    def kv_fingerprint(self) -> dict[str, str]:
        """What separates this index from another: endpoint, model, and which token ids it holds."""
        return {"engine": self.key, "url": self.base_url, "model": self.model,
                "tokens": "server /tokenize" if not self.approx_tokens else "approx v1"}

    # budget --------------------------------------------------------------------------------
    @property
    def tokens_used(self) -> int:
        return self._tokens_used

    def remaining_budget(self) -> int | None:
        """Tokens left under KVB_CLOUD_TOKEN_BUDGET; None when no budget is set."""
        budget = self.settings.cloud_token_budget
        return max(0, budget - self._tokens_used) if budget > 0 else None

    def _check_budget(self) -> None:
        budget = self.settings.cloud_token_budget
        if budget > 0 and self._tokens_used >= budget:
            raise BudgetExhausted(f"the cloud token budget is used up: {self._tokens_used} of "
                                  f"KVB_CLOUD_TOKEN_BUDGET={budget} prompt+completion tokens; requests are "
                                  "refused until you raise the budget or restart KVBridge")

    def _charge(self, tokens: int) -> None:
        with self._lock:
            self._tokens_used += max(0, tokens)

    # the key -------------------------------------------------------------------------------
    def _source_of_key_name(self) -> str:
        return "KVB_CLOUD_API_KEY_ENV names" if self.settings.cloud_api_key_env else \
            f"the {self.provider_label} preset reads the key from"

    def _auth_headers(self) -> dict[str, str]:
        """Headers for one request: extra headers, then the key (read now, from the environment)."""
        headers = parse_extra_headers(self.settings.cloud_extra_headers)
        if not self.key_env:
            return headers
        if not _VAR_NAME_RE.fullmatch(self.key_env) or looks_like_secret(self.key_env):
            raise NeedsKey("KVB_CLOUD_API_KEY_ENV must be the NAME of an environment variable "
                           "(like OPENAI_API_KEY), not the key itself")
        key = _read_env(self.key_env)
        if not key:
            raise NeedsKey(f"{self._source_of_key_name()} {self.key_env}, but {self.key_env} is not set in the "
                           f"environment; export {self.key_env} in the shell that starts KVBridge")
        headers["Authorization"] = f"Bearer {key}"
        return headers

    def _scrub(self, text: str) -> str:
        """Defence in depth: a provider echoing the key back never gets it into our messages."""
        key = _read_env(self.key_env) if self.key_env and _VAR_NAME_RE.fullmatch(self.key_env) else ""
        return text.replace(key, "[key]") if key else text

    # prompts -------------------------------------------------------------------------------
    def render(self, messages: Sequence[Message]) -> str:
        """A deterministic rendering for the shadow index (the provider applies its own template)."""
        return chatml(messages)

    def tokenize(self, text: str) -> list[int]:
        if not self._tokenizer_detected:
            self._detect_tokenizer()
        if self._tokenize_url is None:
            return self._approx.tokenize(text)
        body = self._post_json(self._tokenize_url, {"content": text})
        return [int(t) for t in body["tokens"]]

    def detokenize(self, tokens: Sequence[int]) -> str:
        if self._tokenize_url is None:
            return self._approx.detokenize(tokens)
        url = self._tokenize_url.removesuffix("/tokenize") + "/detokenize"
        return str(self._post_json(url, {"tokens": list(tokens)}).get("content", ""))

    def _detect_tokenizer(self) -> None:
        """Probe the server's /tokenize once (llama-server has one; hosted APIs do not)."""
        url = server_root(self.base_url) + "/tokenize"
        try:
            response = self._session.post(url, json={"content": "kvbridge"}, headers=self._probe_headers(),
                                          timeout=(10, self.settings.cloud_timeout))
        except requests.RequestException as err:
            raise self._unreachable(err) from None
        with response:
            try:
                body = response.json() if response.status_code == 200 else None
            except ValueError:
                body = None
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens):
            self._tokenize_url, self.approx_tokens = url, False
            self.tokenizer_note = f"the server's {url}"
        else:
            self._tokenize_url, self.approx_tokens = None, True
            self.tokenizer_note = f"approx (no /tokenize at {server_root(self.base_url)}: {response.status_code})"
        self._tokenizer_detected = True

    def _probe_headers(self) -> dict[str, str]:
        try:
            return self._auth_headers()
        except NeedsKey:
            return {}  # the probe goes out without a key; generate() will say what is missing

    def _post_json(self, url: str, body: dict) -> dict:
        try:
            response = self._session.post(url, json=body, headers=self._probe_headers(),
                                          timeout=(10, self.settings.cloud_timeout))
        except requests.RequestException as err:
            raise self._unreachable(err) from None
        with response:
            if response.status_code != 200:
                raise EngineUnavailable(f"{url} answered {response.status_code}: {self._scrub(error_text(response))}")
            return response.json()

    # generation ----------------------------------------------------------------------------
    def generate(self, prompt: Prompt, *, n_predict: int, temperature: float, use_native_cache: bool,
                 report: EngineReport) -> Iterator[str]:
        self._check_budget()
        headers = self._auth_headers()
        messages = [dict(m) for m in prompt.messages] if prompt.messages else [{"role": "user", "content": prompt.text}]
        if not use_native_cache:
            # The random hex comes first: any fixed lead-in would itself be a shared, cacheable prefix.
            messages[0]["content"] = f"{uuid.uuid4().hex} (kvbridge cold-run nonce)\n{messages[0]['content']}"
            report.notes.append(COLD_NOTE)
        body = {"model": self.model, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, "max_tokens": n_predict, "temperature": temperature}
        response = self._open_stream(body, headers, report)
        usage: UsageCounts | None = None
        pieces, malformed = 0, 0
        try:
            for event in json_objects(sse_data_until_done(response.iter_lines())):
                if event is None:
                    malformed += 1
                    continue
                if event.get("error"):
                    raise KVBridgeError(f"the provider reported an error mid-stream: "
                                        f"{self._scrub(error_message(event['error']))}")
                usage = usage_counts_from(event) or usage
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if isinstance(choice, dict) else None
                    if piece:
                        pieces += 1
                        yield piece
        except requests.RequestException as err:
            if is_read_timeout(err):
                raise EngineUnavailable(f"{self.base_url} sent nothing for KVB_CLOUD_TIMEOUT="
                                        f"{self.settings.cloud_timeout:g} s mid-stream (a long prefill on a slow "
                                        "server needs a larger value)") from None
            raise EngineUnavailable(f"the stream from {self.base_url} broke off ({type(err).__name__})") from None
        finally:
            response.close()
            self._charge(usage.billed_tokens if usage and usage.billed_tokens is not None
                         else len(prompt.tokens) + pieces)
        if malformed:
            self.counters[MALFORMED_COUNTER] += malformed
            report.notes.append(f"skipped {malformed} malformed line(s) in the provider's stream")
        self._fill_report(usage, report)

    def _fill_report(self, usage: UsageCounts | None, report: EngineReport) -> None:
        if usage is None:
            report.notes.append("the provider sent no usage block: cached tokens unknown, budget charged "
                                "with an estimate")
            return
        report.prompt_tokens, report.completion_tokens = usage.prompt_tokens, usage.completion_tokens
        report.engine_cached_tokens = usage.cached_tokens
        if usage.cached_tokens is None:
            report.notes.append("the provider reports no cached-token count")
        else:
            report.notes.append(f"cached tokens from {usage.cached_field}")
            if usage.prompt_tokens is not None:
                report.engine_prefill_tokens = max(0, usage.prompt_tokens - usage.cached_tokens)

    def _open_stream(self, body: dict, headers: dict[str, str], report: EngineReport) -> requests.Response:
        """POST with retries on 429/5xx (Retry-After honoured, bounded by KVB_CLOUD_MAX_RETRIES)."""
        url = f"{self.base_url}/chat/completions"
        max_retries = max(0, self.settings.cloud_max_retries)
        for attempt in range(max_retries + 1):
            try:
                response = self._session.post(url, json=body, headers=headers, stream=True,
                                              timeout=(min(10.0, self.settings.cloud_timeout),
                                                       self.settings.cloud_timeout))
            except requests.RequestException as err:
                raise self._unreachable(err) from None
            status = response.status_code
            if status == 200:
                if attempt:
                    report.notes.append(f"retried {attempt} time(s) after 429/5xx answers")
                return response
            if (status == 429 or status >= 500) and attempt < max_retries:
                delay = retry_delay_s(response.headers.get("Retry-After"), attempt, self.retry_base_s, self.retry_cap_s)
                response.close()
                self.counters[RETRY_COUNTER] += 1
                log.info("%s answered %d; retry %d of %d in %.2f s", url, status, attempt + 1, max_retries, delay)
                time.sleep(delay)
                continue
            raise self._refused(response, attempt)
        raise AssertionError("unreachable: the loop returns or raises")

    def _refused(self, response: requests.Response, attempt: int) -> KVBridgeError:
        status = response.status_code
        with response:
            detail = "" if status in (401, 403) else self._scrub(error_text(response))
        if status in (401, 403):
            if not self.key_env:
                return NeedsKey(f"{self.base_url} wants an API key ({status}); set KVB_CLOUD_API_KEY_ENV to the "
                                "NAME of the environment variable that holds it")
            return NeedsKey(f"the provider refused the key in ${self.key_env} ({status})")
        if status == 429 or status >= 500:
            return EngineUnavailable(f"{self.base_url} kept answering {status} after {attempt} retries "
                                     f"(KVB_CLOUD_MAX_RETRIES={self.settings.cloud_max_retries}): {detail}")
        if status == 404:
            return KVBridgeError(f"{self.base_url}/chat/completions answered 404: check KVB_CLOUD_BASE_URL and "
                                 f"KVB_CLOUD_MODEL ({self.model}): {detail}")
        return KVBridgeError(f"the provider refused the request ({status}): {detail}")

    def _unreachable(self, err: requests.RequestException) -> EngineUnavailable:
        where = "KVB_CLOUD_BASE_URL" if self.settings.cloud_base_url else \
            f"KVB_CLOUD_PROVIDER={self.settings.cloud_provider}"
        if isinstance(err, requests.Timeout):
            return EngineUnavailable(f"{self.base_url} did not answer within KVB_CLOUD_TIMEOUT="
                                     f"{self.settings.cloud_timeout:g} s ({where})")
        return EngineUnavailable(f"the provider at {self.base_url} is not reachable ({type(err).__name__}); "
                                 f"check {where} and that the server is running")


def _read_env(name: str) -> str:
    """The one place KVBridge reads an API key: the variable named by KVB_CLOUD_API_KEY_ENV."""
    return os.environ.get(name, "")


register_engine(EngineSpec(
    key="cloud",
    label="OpenAI-compatible API (shadow)",
    cls=CloudBackend,
    blurb="Any OpenAI-compatible /chat/completions (hosted, vLLM, llama-server); prompts leave this machine "
          "when the URL is not local. KVBridge predicts reuse and reads the provider's cached-token count.",
    aliases=("openai", "api"),
    fields=("cloud_provider", "cloud_base_url", "cloud_model", "cloud_api_key_env", "cloud_extra_headers",
            "cloud_token_budget", "cloud_timeout", "cloud_max_retries"),
))
