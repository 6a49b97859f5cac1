"""The OpenAI wire format `serve` speaks: request bodies checked into one `Generation`, errors in
OpenAI's shape, and the response and stream-chunk bodies.

Every refusal names the field, as OpenAI's own errors do (`param`), so a client library shows the
person what to change. Fields a client sends that do not change the answer (`user`, `model`,
`presence_penalty` of 0, ...) are accepted and ignored; fields KVBridge cannot honour (`n` > 1,
`logprobs`, `tools`, ...) are refused rather than silently dropped.

Routers in front of a fleet (vllm-router) add vLLM's own fields to every body they forward. Those
that mean something here are honoured (`min_tokens`, `ignore_eos`, `kv_transfer_params`: the PD
legs, kvbridge.serve.pd); those about detokenizing or reasoning output (IGNORED) change nothing for
a plain text answer and are ignored at any value; those that would change the answer and cannot be
done (`return_hidden_states`, `continue_final_message`: true) are refused by name.
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

PRIORITY_HEADER = "x-kvbridge-priority"
BLEND_HEADER = "x-kvbridge-blend"   # on: reuse stored passages at any position (kvbridge.blend); absent: off
TIER_HEADER = "X-KVBridge-Tier"
PRIORITY_APPLIED_HEADER = "X-KVBridge-Priority-Applied"   # answered when X-KVBridge-Priority was sent: what counted
DEFAULT_PRIORITY = 5
# Fields that would change what a client gets back and that serve cannot do: refused by name.
UNSUPPORTED = {
    "logprobs": "log probabilities are not returned",
    "top_logprobs": "log probabilities are not returned",
    "tools": "tool calls are not supported",
    "tool_choice": "tool calls are not supported",
    "functions": "function calls are not supported",
    "function_call": "function calls are not supported",
    "response_format": "structured output is not supported",
    "logit_bias": "logit bias is not supported",
    "suffix": "insertion (suffix) is not supported",
    "echo": "echoing the prompt is not supported",
    "best_of": "best_of is not supported",
    "return_hidden_states": "hidden states are not returned",
    "continue_final_message": "continuing the last assistant message is not supported (the template opens a new one)",
}
# vLLM's fields a router adds that change nothing for a plain text answer: accepted at any value, ignored
IGNORED = ("skip_special_tokens", "no_stop_trim", "separate_reasoning", "stream_reasoning", "include_reasoning")


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Generation:
    """One request, checked: what to generate and how to answer."""

    kind: str                       # "chat" or "completion"
    prompt: Any                     # chat messages (list of {"role", "content"}) or a string
    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    model: str
    cache_salt: str = ""            # the request's own (vLLM's cache_salt); the app adds the tenant's in front
    tenant: str = "default"
    blend: bool = False             # X-KVBridge-Blend: on
    min_tokens: int = 0             # end-of-generation and stop strings not honoured before this many tokens
    ignore_eos: bool = False        # generate past end-of-generation tokens up to max_tokens
    kv_transfer_params: dict | None = None   # a PD leg's (kvbridge.serve.pd), as the router sent it


def parse_generation(body: Any, kind: str, *, max_tokens_cap: int) -> Generation:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, False, 0, [], {}) and not (name == "tool_choice" and body[name] == "none"):
            raise ApiError(400, f"'{name}' cannot be honoured here: {why}", param=name, code="unsupported_parameter")
    n = body.get("n", 1)
    if n is not None and (not _is_int(n) or n != 1):
        raise ApiError(400, f"'n' must be 1 here (one answer per request), got {n!r}", param="n",
                       code="unsupported_parameter")
    prompt = _chat_messages(body) if kind == "chat" else _completion_prompt(body)
    max_tokens = _max_tokens(body, max_tokens_cap)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)   # OpenAI's default
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise ApiError(400, "'top_p' must be more than 0", param="top_p")
    seed = _seed(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = bool((options or {}).get("include_usage", False))
    model = body.get("model", "")
    if not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, got {model!r}", param="model")
    cache_salt = body.get("cache_salt", "")
    if cache_salt is None:
        cache_salt = ""
    if not isinstance(cache_salt, str) or len(cache_salt) > 200:
        raise ApiError(400, "'cache_salt' must be a string of at most 200 characters: requests share cached KV only "
                            "with requests of the same salt", param="cache_salt")
    min_tokens = body.get("min_tokens")
    if min_tokens is None:
        min_tokens = 0
    if not _is_int(min_tokens) or not 0 <= min_tokens <= max_tokens:
        raise ApiError(400, f"'min_tokens' must be a whole number from 0 to max_tokens ({max_tokens}), got "
                            f"{min_tokens!r}", param="min_tokens")
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is None:
        ignore_eos = False
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, f"'ignore_eos' must be true or false, got {ignore_eos!r}", param="ignore_eos")
    kv_transfer_params = body.get("kv_transfer_params")
    if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
        raise ApiError(400, "'kv_transfer_params' must be an object (what a PD router sends), or absent",
                       param="kv_transfer_params")
    return Generation(kind, prompt, max_tokens, temperature, top_p, _stop(body), seed, stream, include_usage, model,
                      cache_salt, min_tokens=min_tokens, ignore_eos=ignore_eos,
                      kv_transfer_params=kv_transfer_params or None)


def parse_priority(value: str | None) -> int | None:
    """X-KVBridge-Priority as sent (None: not sent); whether it counts is the tenant's grant (Tenant.priority)."""
    if value is None or value == "":
        return None
    try:
        priority = int(value.strip())
    except ValueError:
        priority = -1
    if not 0 <= priority <= 9:
        raise ApiError(400, f"the X-KVBridge-Priority header must be 0 to 9 (higher is more urgent), got {value!r}",
                       param="X-KVBridge-Priority")
    return priority


def parse_blend(value: str | None) -> bool:
    """X-KVBridge-Blend: on or off (any case, spaces around ignored); absent is off."""
    if value is None:
        return False
    word = value.strip().lower()
    if word in ("on", "off"):
        return word == "on"
    raise ApiError(400, f"the X-KVBridge-Blend header must be 'on' or 'off', got {value!r}", param="X-KVBridge-Blend")


# -- responses ----------------------------------------------------------------------------------
def completion_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, kvbridge: dict | None = None) -> dict:
    """OpenAI's usage; `kvbridge`: why the prompt missed (kvbridge.serve.misses.MissView.usage_fields), an object
    of its own beside OpenAI's fields."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if kvbridge is not None:
        body["kvbridge"] = kvbridge
    return body


def response_body(gen: Generation, rid: str, model: str, text: str, finish_reason: str, usage_: dict) -> dict:
    created = int(time.time())
    if gen.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
                "usage": usage_}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
            "usage": usage_}


def chunk_body(gen: Generation, rid: str, model: str, piece: str | None, finish_reason: str | None,
               first: bool = False) -> dict:
    created = int(time.time())
    if gen.kind == "chat":
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if piece is not None:
            delta["content"] = piece
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    else:
        choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish_reason}
        body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if gen.include_usage:
        body["usage"] = None      # as OpenAI: every chunk carries the field, the last one its value
    return body


def usage_chunk(gen: Generation, rid: str, model: str, usage_: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if gen.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": [], "usage": usage_}


# -- fields ---------------------------------------------------------------------------------------
def _chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"messages[{i}] needs a role of system, developer, user or assistant",
                           param=f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, list):   # content parts: only text can be read here
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", param=f"messages[{i}].content")
        role = "system" if message["role"] == "developer" else message["role"]
        out.append({"role": role, "content": content})
    return out


def _completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise ApiError(400, "'prompt' must be one string here (a list of prompts asks for several answers)",
                       param="prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
    return prompt


def _max_tokens(body: dict, cap: int) -> int:
    """The request's max_completion_tokens (else max_tokens), at most `cap` (KVB_SERVE_MAX_TOKENS); `cap`
    when it names neither."""
    named = []
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise ApiError(400, f"'{name}' must be a whole number of at least 1, got {value!r}", param=name)
        if value > cap:
            raise ApiError(400, f"'{name}' is {value}, more than this server allows: at most {cap} "
                                f"(KVB_SERVE_MAX_TOKENS={cap})", param=name)
        named.append(int(value))
    return named[0] if named else cap


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ApiError(400, f"'{name}' must be a number from {low:g} to {high:g}, got {value!r}", param=name)
    return float(value)


def _seed(body: dict) -> int | None:
    """The request's seed; -1 means a random one, as in llama.cpp (its LLAMA_DEFAULT_SEED), and so None."""
    seed = body.get("seed")
    if seed is None or (seed == -1 and _is_int(seed)):
        return None
    if not _is_int(seed) or seed < 0:
        raise ApiError(400, f"'seed' must be a whole number of at least 0, or -1 for a random one; got {seed!r}",
                       param="seed")
    return seed


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or any(not isinstance(s, str) or not s for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of up to 4 non-empty strings", param="stop")
    return tuple(stop)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
