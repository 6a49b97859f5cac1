"""Ollama's REST API on `serve`, so Ollama's clients (the `ollama` Python and JS libraries, front ends that
speak `/api/chat`) run on KVBridge's cache, which survives a restart where Ollama's is dropped at unload.

    POST /api/chat, POST /api/generate   NDJSON stream (Ollama's default) or one object
    GET  /api/tags, POST /api/show, GET /api/ps, GET /api/version, POST /api/embed (501: no embeddings)
    GET  /   "Ollama is running", what Ollama's CLI and clients probe for; open, as /health is

A thin translation, as the OpenAI side is (kvbridge.serve.app): a body is checked into a Generation
(kvbridge.serve.ollama_protocol), run as a Job on the same engine, tenant salt and metrics as
/v1/chat/completions, and answered in Ollama's shapes and error object (`{"error": "..."}`). /api/generate's
prompt is built as Ollama builds it: the model's chat template around `system` and `prompt` unless `raw`, after
the text of the `context` ids an earlier answer returned; its answer's `context` is the ids of prompt and answer.
That needs the model's vocabulary (GGUFVocab, vocab only, loaded on first use); the tokens are the ones the
engine prefills, so `context` continues a conversation from the stored KV.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from typing import AsyncIterator

from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvbridge.serve.engines import Job, ServeEngine, client_gone, next_event
from kvbridge.serve.guards import as_api_error, read_json
from kvbridge.serve.metrics import ServeMetrics
from kvbridge.serve.misses import client_view
from kvbridge.serve.ollama_protocol import API_VERSION, ServedModel, check_model, error_body, final_fields, \
    now_rfc3339, parse_chat, parse_generate
from kvbridge.serve.protocol import PRIORITY_HEADER, TIER_HEADER, ApiError, Generation, parse_priority
from kvbridge.serve.tenants import DEFAULT, TenantTable
from kvbridge.settings import Settings

NDJSON = "application/x-ndjson"
NEVER = "2318-01-01T00:00:00Z"   # /api/ps's expires_at: the model stays loaded as long as serve runs
# llama.cpp's general.file_type, as Ollama names the quantization in a model's details
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              32: "BF16"}


class OllamaApi:
    """The /api/* routes over one ServeEngine; `tenants` and `metrics` are the app's own."""

    def __init__(self, settings: Settings, engine: ServeEngine, tenants: TenantTable, metrics: ServeMetrics) -> None:
        self.settings, self.engine, self.tenants, self.metrics = settings, engine, tenants, metrics
        self.served = ServedModel.of(settings, engine.model_path)
        self._vocab = None
        self._vocab_lock = threading.Lock()

    def routes(self) -> list[Route]:
        return [Route("/api/chat", self.chat, methods=["POST"]),
                Route("/api/generate", self.generate, methods=["POST"]),
                Route("/api/tags", self.tags, methods=["GET"]),
                Route("/api/show", self.show, methods=["POST"]),
                Route("/api/ps", self.ps, methods=["GET"]),
                Route("/api/version", self.version, methods=["GET"]),
                Route("/api/embed", self.embed, methods=["POST"]),
                Route("/", self.heartbeat, methods=["GET"])]

    def vocab(self):
        """The model's vocabulary and template (on a worker thread: loading it reads the GGUF's vocabulary)."""
        with self._vocab_lock:
            if self._vocab is None:
                from kvbridge.backends.gguf_vocab import GGUFVocab

                self._vocab = GGUFVocab(self.engine.model_path)
            return self._vocab

    # -- generation -------------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._generation(request, "chat")

    async def generate(self, request: Request) -> Response:
        return await self._generation(request, "generate")

    async def _generation(self, request: Request, kind: str) -> Response:
        started = time.perf_counter_ns()
        endpoint = f"ollama_{kind}"
        try:
            asked = parse_priority(request.headers.get(PRIORITY_HEADER))
            body = await read_json(request, self.settings.serve_max_body_bytes)
            check_model(body, self.served)
            if kind == "chat":
                gen, prompt_text = parse_chat(body, self.settings, self.served.name), None
                empty = not gen.prompt
            else:
                ask = parse_generate(body, self.settings, self.served.name)
                empty = not ask.prompt
                if not empty:
                    prompt_text = await run_in_threadpool(self._prompt_text, ask)
                    gen = dataclasses.replace(ask.gen, prompt=prompt_text)
            if empty:   # Ollama's way to load (keep_alive 0: unload) a model: nothing runs, the model stays loaded
                return JSONResponse(self._loaded(kind, body.get("keep_alive") in (0, "0", "0s")))
            tenant = getattr(request.state, "tenant", DEFAULT)
            gen = dataclasses.replace(gen, cache_salt=tenant.cache_salt(), tenant=tenant.name)
            job = Job(asyncio.get_running_loop())
            await run_in_threadpool(self.engine.submit, gen, tenant.priority(asked), job, False)
        except ApiError as exc:
            self.metrics.answered(endpoint, exc.status)
            return _error(exc)
        full = self.tenants.sees_everything(tenant)
        gone = asyncio.ensure_future(client_gone(request))
        try:
            first = await next_event(job, gone)
        finally:
            gone.cancel()
        if first is None:
            self.metrics.answered(endpoint, 499)
            return Response(status_code=499)
        if first[0] == "error":
            exc = as_api_error(first[1])
            self.metrics.answered(endpoint, exc.status)
            return _error(exc)
        events = self._events(job, first, gen, prompt_text, endpoint, started, full)
        later: list = []
        if gen.stream:
            return StreamingResponse(_ndjson(events, job, later), media_type=NDJSON,
                                     background=BackgroundTask(_run_all, later))
        collector = asyncio.ensure_future(_collect(events, later))
        gone = asyncio.ensure_future(client_gone(request))
        try:
            done, _ = await asyncio.wait({collector, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if collector not in done:   # the client left: the request is cancelled, its blocks freed
            collector.cancel()
            job.cancel()
            self.metrics.answered(endpoint, 499)
            return Response(status_code=499)
        text, last = collector.result()
        if "error" in last:
            return _error(ApiError(last.pop("_status"), last["error"]))
        if kind == "chat":
            last["message"]["content"] = "".join(text)
        else:
            last["response"] = "".join(text)
        return JSONResponse(last, headers={TIER_HEADER: last["kvbridge"]["tier"]},
                            background=BackgroundTask(_run_all, later))

    async def _events(self, job: Job, first, gen: Generation, prompt_text: str | None, endpoint: str,
                      started: int, full: bool) -> AsyncIterator:
        """The answer's objects as Ollama writes them: one per piece of text, then the last with the counts
        (an `_After` between: what metrics run once the answer has left)."""
        event = first
        while True:
            kind, value = event
            if kind == "text":
                yield self._piece(gen, value)
            elif kind == "done":
                shown = client_view(value, full)
                after = self.metrics.finished(endpoint, value, gen.tenant, gen.cache_salt, shown)
                if after is not None:
                    yield _After(after)
                last = self._piece(gen, "")
                last.update(done=True, done_reason="length" if value.gen_tokens >= gen.max_tokens else "stop",
                            **final_fields(value, time.perf_counter_ns() - started, shown.usage_fields()))
                if gen.kind == "completion":
                    last["context"] = await run_in_threadpool(self.vocab().tokenize, prompt_text + value.text)
                yield last
                return
            else:
                exc = as_api_error(value)
                self.metrics.answered(endpoint, exc.status)
                yield {**error_body(exc), "_status": exc.status}
                return
            event = await job.next_event()

    def _piece(self, gen: Generation, text: str) -> dict:
        body = {"model": self.served.name, "created_at": now_rfc3339()}
        if gen.kind == "chat":
            body["message"] = {"role": "assistant", "content": text}
        else:
            body["response"] = text
        body["done"] = False
        return body

    def _prompt_text(self, ask) -> str:
        """What /api/generate prefills, built as Ollama builds it: the text of `context`, then the prompt in the
        model's chat template (with `system`), or as sent when `raw`."""
        vocab = self.vocab()
        prefix = ""
        if ask.context:
            if max(ask.context) >= vocab.n_vocab:
                raise ApiError(400, f"'context' holds a token id of {max(ask.context)}, past this model's vocabulary "
                                    f"({vocab.n_vocab} tokens): send the context an answer of this model returned",
                               param="context")
            prefix = vocab.template.strip_bos(vocab.detokenize(ask.context))
        if ask.raw:
            return prefix + ask.prompt
        messages = ([{"role": "system", "content": ask.system}] if ask.system else []) + \
            [{"role": "user", "content": ask.prompt}]
        return prefix + vocab.render(messages)

    def _loaded(self, kind: str, unload: bool) -> dict:
        body = {"model": self.served.name, "created_at": now_rfc3339()}
        body.update({"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""})
        body.update(done=True, done_reason="unload" if unload else "load")
        return body

    # -- the model ----------------------------------------------------------------------------------------
    async def tags(self, request: Request) -> Response:
        return JSONResponse({"models": [await run_in_threadpool(self._entry)]})

    async def ps(self, request: Request) -> Response:
        entry = await run_in_threadpool(self._entry)
        entry.pop("modified_at")
        entry.update(expires_at=NEVER, size_vram=0, context_length=self.settings.ctx_size)
        return JSONResponse({"models": [entry]})

    async def show(self, request: Request) -> Response:
        try:
            body = await read_json(request, self.settings.serve_max_body_bytes)
            check_model(body, self.served)
        except ApiError as exc:
            return _error(exc)
        return JSONResponse(await run_in_threadpool(self._show))

    async def heartbeat(self, request: Request) -> Response:
        # the words Ollama answers at / (its CLI's heartbeat, and clients that probe for an Ollama server, read them)
        return PlainTextResponse("Ollama is running")

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": API_VERSION})

    async def embed(self, request: Request) -> Response:
        try:
            check_model(await read_json(request, self.settings.serve_max_body_bytes), self.served)
        except ApiError as exc:
            return _error(exc)
        return _error(ApiError(501, f"model '{self.served.name}' does not support embeddings here: serve runs "
                                    "generation on its scheduler and computes no embeddings (no /v1/embeddings "
                                    "either)"))

    def _details(self) -> dict:
        meta = self.vocab().metadata
        arch = meta.get("general.architecture", "")
        file_type = meta.get("general.file_type", "")
        return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch] if arch else None,
                "parameter_size": meta.get("general.size_label", ""),
                "quantization_level": FILE_TYPES.get(int(file_type), "") if file_type.isdigit() else ""}

    def _entry(self) -> dict:
        s = self.served
        return {"name": s.name, "model": s.name, "modified_at": s.modified_at, "size": s.size, "digest": s.digest,
                "details": self._details()}

    def _show(self) -> dict:
        vocab = self.vocab()
        meta = vocab.metadata
        info = {k: int(v) if v.isdigit() else v for k, v in meta.items() if not k.startswith("tokenizer.")}
        return {"license": meta.get("general.license", ""), "modelfile": f"FROM {self.served.path}\n",
                "parameters": "", "template": vocab.template.template, "details": self._details(),
                "model_info": info, "capabilities": ["completion"], "modified_at": self.served.modified_at}


@dataclasses.dataclass
class _After:
    call: object


async def _collect(events: AsyncIterator, later: list) -> tuple[list[str], dict]:
    """A whole answer: its pieces of text and its last object (or the error)."""
    text = []
    async for part in events:
        if isinstance(part, _After):
            later.append(part.call)
        elif "error" in part or part["done"]:
            return text, part
        else:
            text.append(part["message"]["content"] if "message" in part else part["response"])
    raise RuntimeError("an answer ended without its last object")


async def _ndjson(events: AsyncIterator, job: Job, later: list) -> AsyncIterator[bytes]:
    try:
        async for part in events:
            if isinstance(part, _After):
                later.append(part.call)
                continue
            part.pop("_status", None)   # an error after the stream began: Ollama's error object as the last line
            yield json.dumps(part, separators=(",", ":")).encode() + b"\n"
    finally:
        if job.future is not None and not job.future.done():   # the client went away mid-stream
            job.cancel()


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)


def _run_all(calls: list) -> None:
    for call in calls:
        call()
