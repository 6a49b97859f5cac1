"""Ollama's wire format on `serve`: model names, request bodies checked into a `Generation`, and the
response bodies Ollama writes (kvbridge.serve.ollama_api answers the routes with them).

Ollama names a model `name[:tag]`, `user/name:tag` or `host/ns/name:tag` (kvbridge.backends.ollama.model_store
reads its store). A request naming a model serve does not run gets Ollama's 404, `{"error": "model 'x' not
found"}`; serve runs one model, so only its own name (any spelling Ollama would take for it) answers.

Options honoured: `num_predict`, `temperature`, `top_p`, `seed`, `stop`, `num_ctx` (at most the server's
context: a larger one is refused naming the field). Ollama's default temperature, 0.8, is kept; its default
top_p of 0.9 is not (top_p 1 unless sent: the llama-server engine cannot apply another). The other options (`top_k`, `repeat_penalty`, `num_thread`, ...) are accepted
and ignored, as Ollama ignores options a runner does not know. Fields that would change what comes back and
cannot be done (`format`, `tools`, `images`, `think`, `suffix`, `logprobs`, `template`) are refused by name,
as serve's OpenAI side refuses `tools` and `response_format`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvbridge.backends.ollama.model_store import DEFAULT_NAMESPACE, DEFAULT_REGISTRY, locate_ollama_model, \
    manifest_relpath
from kvbridge.serve.protocol import ApiError, Generation
from kvbridge.settings import Settings

API_VERSION = "0.12.0"   # the Ollama API level these routes follow (what /api/version answers), not a build of Ollama
DEFAULT_TEMPERATURE = 0.8   # Ollama's own default (api.DefaultOptions)
REFUSED = {
    "format": "structured output (format) is not supported; serve's OpenAI side refuses response_format too",
    "tools": "tool calls are not supported (the model's template would have to render them)",
    "images": "images are not supported: serve runs text models",
    "think": "thinking is not supported by this server",
    "suffix": "insertion (suffix) is not supported",
    "logprobs": "log probabilities are not returned",
    "top_logprobs": "log probabilities are not returned",
    "template": "Go templates are not interpreted here: send the prompt already formatted with raw: true, or "
                "leave template out and the model's own chat template is used",
}


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def display_name(name: str) -> str:
    """How Ollama lists a model: `llama3.2:latest`, `user/name:tag`, `host/ns/name:tag`."""
    host, namespace, *rest = manifest_relpath(name).parts
    model, tag = "/".join(rest[:-1]), rest[-1]
    if host == DEFAULT_REGISTRY:
        return f"{model}:{tag}" if namespace == DEFAULT_NAMESPACE else f"{namespace}/{model}:{tag}"
    return f"{host}/{namespace}/{model}:{tag}"


@dataclass(frozen=True)
class ServedModel:
    """The one model serve runs, as Ollama's routes name it."""

    name: str                # Ollama's name when it came from the store (KVB_OLLAMA_MODEL), else the GGUF's stem
    path: Path
    digest: str              # the manifest's sha256 (what Ollama's /api/tags shows), else the GGUF's file name
    size: int
    modified_at: str
    from_store: bool

    @classmethod
    def of(cls, settings: Settings, model_path: Path) -> "ServedModel":
        stat = model_path.stat()
        modified = datetime.fromtimestamp(stat.st_mtime, timezone.utc).isoformat().replace("+00:00", "Z")
        if not settings.model_path and settings.ollama_model:   # model_path_for took it from Ollama's store
            found = locate_ollama_model(settings.ollama_models, settings.ollama_model)
            if found is not None and found.gguf_path == model_path:
                return cls(display_name(settings.ollama_model), model_path, found.manifest_digest.split(":", 1)[1],
                           stat.st_size, modified, True)
        named = _store_name_of_blob(model_path)   # `serve -m ~/.ollama/models/blobs/sha256-...`: its manifest's name
        if named is not None:
            return cls(named[0], model_path, named[1], stat.st_size, modified, True)
        try:
            name = display_name(model_path.stem)
        except ValueError:   # a file name Ollama could not take as a model name: listed as it is
            name = model_path.stem
        return cls(name, model_path, model_path.name, stat.st_size, modified, False)

    def answers_to(self, name: Any) -> bool:
        """Whether a request's `model` names this model (`smollm2` and `smollm2:latest` both do)."""
        if not isinstance(name, str) or not name.strip():
            return False
        try:
            return display_name(name).lower() == self.name.lower()
        except ValueError:
            return False


def _store_name_of_blob(path: Path) -> tuple[str, str] | None:
    """(Ollama's name, manifest digest) of the first manifest (by path) whose model layer is this blob, when
    `path` lies in an Ollama store's blobs/ folder; None otherwise."""
    if path.parent.name != "blobs" or not path.name.startswith("sha256-"):
        return None
    manifests = path.parent.parent / "manifests"
    for manifest in sorted(m for m in manifests.rglob("*") if m.is_file()):
        parts = manifest.relative_to(manifests).parts
        if len(parts) < 4:
            continue
        name = "/".join(parts[:-1]) + ":" + parts[-1]
        found = locate_ollama_model(manifests.parent, name)
        if found is not None and found.gguf_path.resolve() == path.resolve():
            return display_name(name), found.manifest_digest.split(":", 1)[1]
    return None


def check_model(body: Any, served: ServedModel) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    name = body.get("model")
    if not isinstance(name, str) or not name.strip():
        raise ApiError(400, "model is required", param="model")
    if not served.answers_to(name):
        raise ApiError(404, f"model '{name}' not found", param="model", code="not_found")


def refuse_unsupported(body: dict, names: tuple[str, ...]) -> None:
    for name in names:
        if body.get(name) not in (None, False, "", [], {}):
            raise ApiError(400, f"'{name}' cannot be honoured here: {REFUSED[name]}", param=name,
                           code="unsupported_parameter")


def parse_options(body: dict, kind: str, settings: Settings, model: str) -> Generation:
    """A Generation from the body's `options`, `stream` (Ollama's default: true) and `keep_alive` (accepted:
    the model stays loaded and its KV in the store); `prompt` is filled in by the caller."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'options' must be an object", param="options")
    cap = settings.serve_max_tokens
    max_tokens = options.get("num_predict")
    if max_tokens is None or (_is_int(max_tokens) and max_tokens < 0):   # -1 (no limit), -2 (fill the context)
        max_tokens = cap
    if not _is_int(max_tokens) or max_tokens < 1 or max_tokens > cap:
        raise ApiError(400, f"'options.num_predict' must be a whole number from 1 to {cap} (KVB_SERVE_MAX_TOKENS="
                            f"{cap}), or -1 for that most; got {options.get('num_predict')!r}",
                       param="options.num_predict")
    num_ctx = options.get("num_ctx")
    if num_ctx is not None and (not _is_int(num_ctx) or num_ctx < 1 or num_ctx > settings.ctx_size):
        raise ApiError(400, f"'options.num_ctx' is {num_ctx!r}, more than this server's context: at most "
                            f"{settings.ctx_size} tokens a request (KVB_CTX_SIZE, serve's -c)",
                       param="options.num_ctx")
    temperature = _number(options, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0)
    top_p = _number(options, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise ApiError(400, "'options.top_p' must be more than 0", param="options.top_p")
    seed = options.get("seed")
    if seed is not None and (not _is_int(seed) or seed < -1):
        raise ApiError(400, f"'options.seed' must be a whole number, -1 for a random one; got {seed!r}",
                       param="options.seed")
    stop = options.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or len(stop) > 4 or any(not isinstance(s, str) or not s for s in stop):
        raise ApiError(400, "'options.stop' must be a list of up to 4 non-empty strings", param="options.stop")
    stream = body.get("stream", True)
    if stream is None:
        stream = True
    if not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be true or false, got {stream!r}", param="stream")
    keep_alive = body.get("keep_alive")
    if keep_alive is not None and (isinstance(keep_alive, bool) or not isinstance(keep_alive, (str, int, float))):
        raise ApiError(400, f"'keep_alive' must be a duration (\"5m\", \"-1\") or a number of seconds, got "
                            f"{keep_alive!r}", param="keep_alive")
    return Generation(kind, None, max_tokens, temperature, top_p, tuple(stop), None if seed in (None, -1) else seed,
                      stream, False, model)


def parse_chat(body: dict, settings: Settings, model: str) -> Generation:
    """An /api/chat body; `prompt` is its messages (an empty list: Ollama's load request, answered without a
    generation)."""
    refuse_unsupported(body, ("format", "tools", "think", "logprobs", "top_logprobs"))
    gen = parse_options(body, "chat", settings, model)
    messages = body.get("messages") or []
    if not isinstance(messages, list):
        raise ApiError(400, "'messages' must be a list of {role, content} objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}] needs a role of system, user or assistant (tool messages need "
                                "tools, which are not supported)", param=f"messages[{i}].role")
        for name in ("images", "tool_calls"):
            if message.get(name):
                raise ApiError(400, f"messages[{i}].{name} is not supported", param=f"messages[{i}].{name}")
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", param=f"messages[{i}].content")
        out.append({"role": message["role"], "content": content})
    return dataclasses.replace(gen, prompt=out)


@dataclass(frozen=True)
class GenerateAsk:
    """An /api/generate body, checked: the prompt text is built from it with the model's vocabulary
    (kvbridge.serve.ollama_api), since `context` ids must be turned back into text first, as Ollama does."""

    gen: Generation
    prompt: str
    system: str
    raw: bool
    context: tuple[int, ...]


def parse_generate(body: dict, settings: Settings, model: str) -> GenerateAsk:
    refuse_unsupported(body, ("format", "images", "think", "suffix", "logprobs", "top_logprobs", "template"))
    gen = parse_options(body, "completion", settings, model)
    fields = {}
    for name in ("prompt", "system"):
        value = body.get(name) or ""
        if not isinstance(value, str):
            raise ApiError(400, f"'{name}' must be a string", param=name)
        fields[name] = value
    raw = body.get("raw") or False
    if not isinstance(raw, bool):
        raise ApiError(400, f"'raw' must be true or false, got {raw!r}", param="raw")
    context = body.get("context") or []
    if not isinstance(context, list) or any(not _is_int(t) or t < 0 for t in context):
        raise ApiError(400, "'context' must be a list of token ids (what an earlier /api/generate returned)",
                       param="context")
    return GenerateAsk(gen, fields["prompt"], fields["system"], raw, tuple(context))


# -- responses ------------------------------------------------------------------------------------
def final_fields(record, total_ns: int, tier_view: dict) -> dict:
    """The counts and durations (nanoseconds) of a finished request, as Ollama's last object carries them.
    `prompt_eval_count` is the whole prompt, restored tokens included (Ollama's own cache counts them there
    too); `prompt_eval_cached_count` (Ollama's field) and `kvbridge.cached_tokens` the ones restored."""
    prompt_eval_ms = max(0.0, record.ttft_ms - record.queue_ms)   # admission to first token: restore + prefill
    body = {"total_duration": total_ns, "load_duration": 0,      # the model stays loaded: nothing to load
            "prompt_eval_count": record.prompt_tokens, "prompt_eval_duration": int(prompt_eval_ms * 1e6),
            "eval_count": record.gen_tokens, "eval_duration": int(max(0.0, record.total_ms - record.ttft_ms) * 1e6)}
    if record.matched_tokens:
        body["prompt_eval_cached_count"] = record.matched_tokens
    body["kvbridge"] = {"cached_tokens": record.matched_tokens, "tier": record.tier, **tier_view}
    return body


def error_body(exc: ApiError) -> dict:
    """Ollama's error object: `{"error": "message"}`."""
    return {"error": exc.message}


def _number(options: dict, name: str, default: float, low: float, high: float) -> float:
    value = options.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ApiError(400, f"'options.{name}' must be a number from {low:g} to {high:g}, got {value!r}",
                       param=f"options.{name}")
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
