"""llama-server's own endpoints on `serve`, so its clients and scripts run on KVBridge's cache unchanged.

    POST /completion           {"prompt": text or token ids, "n_predict", "stream", ...} -> llama-server's body
    POST /detokenize           {"tokens": [...]} -> {"content": text}
    GET  /props                the context, the slots, the model file and its chat template
    GET  /slots                what each sequence slot is doing (the operator's: it would show others' work)
    GET  /v1/health            as /health
    (/tokenize takes llama-server's {"content"} beside vLLM's {"prompt"}: kvbridge.serve.worker)

A translation, as the Ollama side is (kvbridge.serve.ollama_api): a /completion body is checked as an OpenAI
completion (kvbridge.serve.protocol.parse_generation, so the same limits and refusals hold), run as a Job on
the same engine, tenant salt and metrics, and answered in llama-server's shape: `content`, `stop`,
`tokens_predicted`, `tokens_evaluated`, `tokens_cached` (the prompt tokens KVBridge restored or shared, as
llama-server reports what its slot reused), `timings`. A prompt of token ids is turned into text with the model's
vocabulary and tokenized again by the engine. `cache_prompt` and `id_slot` are accepted: every prompt is
cached, and the scheduler, not the caller, places it. Left out: `n_probs`, `grammar`, `json_schema`, `image_data`
(refused by name), multiple prompts in one body.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from typing import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvbridge.serve.engines import Job, ServeEngine
from kvbridge.serve.guards import as_api_error, error_response, read_json
from kvbridge.serve.metrics import ServeMetrics
from kvbridge.serve.misses import client_view
from kvbridge.serve.protocol import PRIORITY_HEADER, TIER_HEADER, ApiError, parse_generation, parse_priority
from kvbridge.serve.tenants import DEFAULT, TenantTable
from kvbridge.settings import Settings

REFUSED_FIELDS = {"n_probs": "token probabilities are not returned", "grammar": "constrained output is not supported",
                  "json_schema": "constrained output is not supported", "image_data": "the models here take no images"}
ENDPOINT = "llama_completion"


class LlamaServerApi:
    """llama-server's routes over one ServeEngine; `tenants` and `metrics` are the app's own."""

    def __init__(self, settings: Settings, engine: ServeEngine, tenants: TenantTable, metrics: ServeMetrics) -> None:
        self.settings, self.engine, self.tenants, self.metrics = settings, engine, tenants, metrics
        self._vocab = None
        self._vocab_lock = threading.Lock()

    def routes(self) -> list[Route]:
        return [Route("/completion", self.completion, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/props", self.props, methods=["GET"]),
                Route("/slots", self.slots, methods=["GET"])]

    def vocab(self):
        with self._vocab_lock:
            if self._vocab is None:
                from kvbridge.backends.gguf_vocab import GGUFVocab

                self._vocab = GGUFVocab(self.engine.model_path)
            return self._vocab

    # -- /completion -------------------------------------------------------------------------------------
    async def completion(self, request: Request) -> Response:
        try:
            asked = parse_priority(request.headers.get(PRIORITY_HEADER))
            body = await read_json(request, self.settings.serve_max_body_bytes)
            gen = await run_in_threadpool(self._generation, body)
            tenant = getattr(request.state, "tenant", DEFAULT)
            gen = dataclasses.replace(gen, cache_salt=tenant.cache_salt(gen.cache_salt), tenant=tenant.name)
            job = Job(asyncio.get_running_loop())
            await run_in_threadpool(self.engine.submit, gen, tenant.priority(asked), job, False)
        except ApiError as exc:
            self.metrics.answered(ENDPOINT, exc.status)
            return error_response(exc)
        full = self.tenants.sees_everything(tenant)
        if gen.stream:
            return StreamingResponse(self._stream(gen, job, full), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        pieces, last = [], None
        while True:
            event = await job.next_event()
            if event[0] == "text":
                pieces.append(event[1])
                continue
            last = event
            break
        if last[0] == "error":
            exc = as_api_error(last[1])
            self.metrics.answered(ENDPOINT, exc.status)
            return error_response(exc)
        record = last[1]
        self._finished(gen, record, full)
        return JSONResponse(self._final(gen, record, "".join(pieces)), headers={TIER_HEADER: record.tier})

    def _generation(self, body):
        """The body as an OpenAI completion (the same checks and limits), from llama-server's fields."""
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        for name, why in REFUSED_FIELDS.items():
            if body.get(name) not in (None, False, 0, [], {}, ""):
                raise ApiError(400, f"'{name}' cannot be honoured here: {why}", param=name)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                       for t in prompt):
            vocab = self.vocab()
            if max(prompt) >= vocab.n_vocab:
                raise ApiError(400, f"'prompt' holds token id {max(prompt)}, past this model's vocabulary "
                                    f"({vocab.n_vocab} tokens)", param="prompt")
            prompt = vocab.template.strip_bos(vocab.detokenize(prompt))
        n_predict = body.get("n_predict", -1)
        if isinstance(n_predict, bool) or not isinstance(n_predict, int) or n_predict < -1 or n_predict == 0:
            raise ApiError(400, f"'n_predict' must be -1 (as many as allowed) or a whole number of at least 1, got "
                                f"{n_predict!r}", param="n_predict")
        openai = {"prompt": prompt, "stream": body.get("stream", False), "seed": body.get("seed"),
                  "stop": body.get("stop"), "temperature": body.get("temperature", 0.8),
                  "top_p": body.get("top_p", 0.95), "cache_salt": body.get("cache_salt")}
        if n_predict > 0:   # -1: llama-server's "no limit", here KVB_SERVE_MAX_TOKENS
            openai["max_tokens"] = n_predict
        if openai["seed"] == -1:   # llama-server's "random"
            openai["seed"] = None
        return parse_generation({k: v for k, v in openai.items() if v is not None}, "completion",
                                max_tokens_cap=self.settings.serve_max_tokens)

    async def _stream(self, gen, job: Job, full: bool) -> AsyncIterator[bytes]:
        try:
            while True:
                kind, value = await job.next_event()
                if kind == "text":
                    yield _sse({"content": value, "stop": False, "id_slot": 0})
                elif kind == "done":
                    self._finished(gen, value, full)
                    yield _sse(self._final(gen, value, ""))
                    return
                else:   # llama-server's error object as the last event
                    exc = as_api_error(value)
                    self.metrics.answered(ENDPOINT, exc.status)
                    yield _sse({"error": {"code": exc.status, "message": exc.message, "type": "server_error"}})
                    return
        finally:
            if job.future is not None and not job.future.done():   # the client went away mid-stream
                job.cancel()

    def _finished(self, gen, record, full: bool) -> None:
        after = self.metrics.finished(ENDPOINT, record, gen.tenant, gen.cache_salt, client_view(record, full))
        if after is not None:
            threading.Thread(target=after, name="kvbridge-after-answer", daemon=True).start()

    def _final(self, gen, record, content: str) -> dict:
        limit = record.gen_tokens >= gen.max_tokens
        prompt_ms = max(0.0, record.ttft_ms - record.queue_ms)
        predicted_ms = max(0.0, record.total_ms - record.ttft_ms)
        computed = max(0, record.prompt_tokens - record.matched_tokens)
        return {"content": content, "id_slot": 0, "stop": True, "model": self.engine.model_id,
                "tokens_predicted": record.gen_tokens, "tokens_evaluated": record.prompt_tokens,
                "tokens_cached": record.matched_tokens, "stop_type": "limit" if limit else "eos",
                "truncated": False,
                "timings": {"cache_n": record.matched_tokens, "prompt_n": computed, "prompt_ms": prompt_ms,
                            "prompt_per_second": computed / prompt_ms * 1000 if prompt_ms and computed else 0.0,
                            "predicted_n": record.gen_tokens, "predicted_ms": predicted_ms,
                            "predicted_per_second": record.gen_tokens / predicted_ms * 1000 if predicted_ms else 0.0},
                "kvbridge": {"tier": record.tier, "cached_tokens": record.matched_tokens}}

    # -- the model and its slots -------------------------------------------------------------------------
    async def detokenize(self, request: Request) -> Response:
        try:
            body = await read_json(request, self.settings.serve_max_body_bytes)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                                   for t in tokens):
                raise ApiError(400, "'tokens' must be a list of token ids", param="tokens")
            vocab = await run_in_threadpool(self.vocab)
            if tokens and max(tokens) >= vocab.n_vocab:
                raise ApiError(400, f"'tokens' holds token id {max(tokens)}, past this model's vocabulary "
                                    f"({vocab.n_vocab} tokens)", param="tokens")
        except ApiError as exc:
            return error_response(exc)
        return JSONResponse({"content": vocab.detokenize(tokens) if tokens else ""})

    async def props(self, request: Request) -> Response:
        from kvbridge import __version__

        vocab = await run_in_threadpool(self.vocab)
        return JSONResponse({
            "default_generation_settings": {"n_ctx": self.settings.ctx_size, "model": self.engine.model_id,
                                            "params": {"n_predict": -1, "temperature": 0.8, "top_p": 0.95}},
            "total_slots": self.settings.sched_max_running, "model_path": str(self.engine.model_path),
            "chat_template": vocab.template.template, "build_info": f"kvbridge {__version__}",
            "modalities": {"vision": False, "audio": False}})

    async def slots(self, request: Request) -> Response:
        state = await run_in_threadpool(self.engine.state)
        running = int(state.get("running", 0))
        return JSONResponse([{"id": i, "n_ctx": self.settings.ctx_size, "is_processing": i < running}
                             for i in range(self.settings.sched_max_running)])


def tokenize_content(vocab, body: dict) -> dict:
    """llama-server's /tokenize: {"content", "add_special", "with_pieces"} -> {"tokens": ids or [{id, piece}]}."""
    content = body.get("content")
    if not isinstance(content, str):
        raise ApiError(400, "'content' must be a string", param="content")
    add_special = body.get("add_special", False)
    if not isinstance(add_special, bool):
        raise ApiError(400, f"'add_special' must be true or false, got {add_special!r}", param="add_special")
    ids = vocab.tokenize(content, add_bos=add_special)   # BOS only when asked, and the model wants one
    if body.get("with_pieces"):
        return {"tokens": [{"id": t, "piece": vocab.detokenize([t])} for t in ids]}
    return {"tokens": ids}


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
