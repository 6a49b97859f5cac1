"""The HTTP side of `serve`: OpenAI's endpoints on a Starlette app, over a ServeEngine.

    POST /v1/chat/completions, POST /v1/completions   (stream or not; stream_options.include_usage)
    GET  /v1/models, GET /health, GET /metrics (Prometheus text)

A response is started only once the request's first event arrives (its first piece of text, or its
end, or its error), so a request refused by the engine (a prompt beyond the context, say) gets a
proper status and OpenAI's error object, and `X-KVBridge-Tier` can say where its KV came from.
`usage.prompt_tokens_details.cached_tokens` counts the prompt tokens KVBridge restored or shared
instead of prefilling. A client that disconnects cancels its request (its KV blocks are freed).
"""
from __future__ import annotations

import hmac
import json
import logging
import time
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvbridge.errors import KVBridgeError
from kvbridge.serve.engines import Job, ServeEngine
from kvbridge.serve.metrics import ServeMetrics
from kvbridge.serve.protocol import (
    PRIORITY_HEADER, TIER_HEADER, ApiError, Generation, chunk_body, completion_id, parse_generation, parse_priority,
    response_body, usage, usage_chunk,
)
from kvbridge.settings import Settings

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health",)


def build_app(settings: Settings, engine: ServeEngine, api_key: str = "") -> Starlette:
    """The app; `api_key` empty: no token needed (the caller reads it from KVB_SERVE_API_KEY_ENV)."""
    metrics = ServeMetrics(engine)

    async def chat(request: Request) -> Response:
        return await _generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await _generate(request, "completion")

    async def _generate(request: Request, kind: str) -> Response:
        endpoint = "chat" if kind == "chat" else "completions"
        try:
            gen = parse_generation(await _json_body(request), kind, max_tokens_cap=settings.serve_max_tokens)
            priority = parse_priority(request.headers.get(PRIORITY_HEADER))
            job = Job(_running_loop())
            engine.submit(gen, priority, job)
        except ApiError as exc:
            metrics.answered(endpoint, exc.status)
            return error_response(exc)
        started = time.perf_counter()
        first = await _first_event(request, job)
        if first is None:                      # the client left before anything came
            metrics.answered(endpoint, 499)
            return Response(status_code=499)
        if first[0] == "error":
            exc = _as_api_error(first[1])
            metrics.answered(endpoint, exc.status)
            return error_response(exc)
        rid = completion_id(kind)
        if gen.stream:
            headers = {TIER_HEADER: _tier(job, first), "Cache-Control": "no-cache"}
            return StreamingResponse(_stream(request, gen, job, first, rid, started, endpoint),
                                     media_type="text/event-stream", headers=headers)
        text, record = await _collect(job, first)
        if record is None:
            exc = _as_api_error(text)
            metrics.answered(endpoint, exc.status)
            return error_response(exc)
        metrics.finished(endpoint, record)
        body = response_body(gen, rid, engine.model_id, record.text, _finish_reason(gen, record), _usage(record))
        return JSONResponse(body, headers={TIER_HEADER: record.tier})

    async def _stream(request: Request, gen: Generation, job: Job, first, rid: str, started: float,
                      endpoint: str) -> AsyncIterator[bytes]:
        event, opened = first, True
        try:
            while True:
                kind, value = event
                if kind == "text":
                    yield _sse(chunk_body(gen, rid, engine.model_id, value, None, first=opened))
                    opened = False
                elif kind == "done":
                    yield _sse(chunk_body(gen, rid, engine.model_id, "" if gen.kind == "chat" and opened else None,
                                          _finish_reason(gen, value), first=opened))
                    if gen.include_usage:
                        yield _sse(usage_chunk(gen, rid, engine.model_id, _usage(value)))
                    yield b"data: [DONE]\n\n"
                    metrics.finished(endpoint, value)
                    return
                else:   # an error after the stream began: OpenAI's error object as the last event
                    exc = _as_api_error(value)
                    metrics.answered(endpoint, exc.status)
                    yield _sse(exc.body())
                    return
                event = await job.next_event()
        finally:
            if job.future is not None and not job.future.done():   # the client went away mid-stream
                job.cancel()
                metrics.answered(endpoint, 499)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": engine.model_id, "object": "model", "created": int(engine.model_path.stat().st_mtime),
             "owned_by": "kvbridge"}]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "engine": engine.name, "model": engine.model_id, **engine.state()})

    async def prometheus(request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    async def not_found(request: Request, exc) -> Response:
        return error_response(ApiError(404, f"no such endpoint: {request.method} {request.url.path}",
                                       code="not_found"))

    async def wrong_method(request: Request, exc) -> Response:
        status = getattr(exc, "status_code", 405)
        return error_response(ApiError(status, f"{request.method} is not allowed on {request.url.path}"))

    routes = [Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", prometheus, methods=["GET"])]
    middleware = []
    origins = [o.strip() for o in settings.serve_cors_origins.split(",") if o.strip()]
    if origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type", "X-KVBridge-Priority"],
                                     expose_headers=[TIER_HEADER]))
    if api_key:
        middleware.append(Middleware(BearerAuth, api_key=api_key))
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={404: not_found, 405: wrong_method})
    app.state.engine = engine
    app.state.metrics = metrics
    return app


class BearerAuth:
    """401 in OpenAI's shape unless `Authorization: Bearer <key>` (compared in constant time)."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self._key = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
            response = error_response(ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                                    "with the key in the variable KVB_SERVE_API_KEY_ENV names",
                                               code="invalid_api_key", kind="authentication_error"))
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


# -- helpers ----------------------------------------------------------------------------------------
async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None


async def _first_event(request: Request, job: Job):
    """The job's first event, or None when the client disconnects first (the job is then cancelled)."""
    import asyncio

    waiter = asyncio.ensure_future(job.next_event())
    while True:
        done, _ = await asyncio.wait({waiter}, timeout=0.25)
        if done:
            return waiter.result()
        if await request.is_disconnected():
            waiter.cancel()
            job.cancel()
            return None


async def _collect(job: Job, first) -> tuple[Any, Any]:
    """(text, record) of a finished job, or (error, None)."""
    event = first
    while True:
        kind, value = event
        if kind == "done":
            return value.text, value
        if kind == "error":
            return value, None
        event = await job.next_event()


def _as_api_error(exc: Any) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    from kvbridge.scheduler import RequestRefused

    if isinstance(exc, RequestRefused):
        message = str(exc)
        param = "messages" if "prompt has" in message else None
        code = "context_length_exceeded" if "prompt has" in message else None
        return ApiError(400, message, param=param, code=code)
    if isinstance(exc, KVBridgeError):
        return ApiError(500, str(exc), kind="server_error")
    log.error("a request failed unexpectedly: %r", exc)
    return ApiError(500, f"the request failed unexpectedly ({type(exc).__name__}); see the server log",
                    kind="server_error")


def _tier(job: Job, first) -> str:
    record = first[1] if first[0] == "done" else None
    if record is None and job.future is not None:
        record = getattr(job.future, "record", None)
    return getattr(record, "tier", None) or "pending"


def _usage(record) -> dict:
    return usage(record.prompt_tokens, record.gen_tokens, record.matched_tokens)


def _finish_reason(gen: Generation, record) -> str:
    return "length" if record.gen_tokens >= gen.max_tokens else "stop"


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _running_loop():
    import asyncio

    return asyncio.get_running_loop()
