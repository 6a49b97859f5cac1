"""The HTTP side of `serve`: OpenAI's endpoints on a Starlette app, over a ServeEngine.

    POST /v1/chat/completions, POST /v1/completions   (stream or not; stream_options.include_usage)
    GET  /v1/models, GET /health, GET /metrics (Prometheus text)
    what a router calls on a fleet worker (render, /tokenize, /get_load, ...): kvbridge.serve.worker
    llama-server's (/completion, /detokenize, /props, /slots, /v1/health): kvbridge.serve.llama_api
    Ollama's (/api/chat, /api/generate, /api/tags, ...): kvbridge.serve.ollama_api

Every response names this instance in `X-KVBridge-Instance`; a PD router's prefill leg is stored
before it is answered and says what it stored (kvbridge.serve.pd).

Who sees what: /health says up or down to anyone, the engine's state only to the operator; /metrics
is the operator's whole registry, or to a tenant only its own series (kvbridge.serve.metrics); the
routes that show the server's state (/get_load, /get_server_info, /kv_event_sources) answer the operator
or the router, never a tenant (kvbridge.serve.guards.ROUTE_CALLERS, the one table of who calls what). The
operator is the key in KVB_SERVE_ADMIN_KEY_ENV, or anyone when no key is configured at all; the router
the key in KVB_SERVE_ROUTER_KEY_ENV. X-KVBridge-Priority counts up to the tenant's grant
(kvbridge.serve.tenants, max_priority), and X-KVBridge-Priority-Applied answers what it ran at.

A response is started only once the request's first event arrives (its first piece of text, or its
end, or its error), so a request refused by the engine (a prompt beyond the context, say) gets a
proper status and OpenAI's error object, and `X-KVBridge-Tier` can say where its KV came from and
`X-KVBridge-Miss` why the rest was computed. `usage.prompt_tokens_details.cached_tokens` counts the prompt
tokens KVBridge restored or shared instead of prefilling, and `usage.kvbridge` says why the others were not
(as the tenant rules allow: kvbridge.serve.misses). A client that disconnects, streaming or not, cancels its request (its KV
blocks are freed). What a request must pass first (its Host, key, Content-Type and size) is
kvbridge.serve.guards. The event loop never calls into the engine itself (a swap-out holds the
scheduler's lock): submits run on worker threads, cancels on threads of their own, and /health and
/metrics read the state through `LiveState`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import AsyncIterator

from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvbridge.serve import pd
from kvbridge.serve.engines import Job, LiveState, ServeEngine, client_gone, next_event
from kvbridge.serve.guards import BearerAuth, HostCheck, allowed_hosts, as_api_error, error_response, read_json
from kvbridge.serve.tenants import DEFAULT, Tenant, TenantTable
from kvbridge.serve.metrics import ServeMetrics
from kvbridge.serve.misses import MISS_HEADER, client_view, header_value
from kvbridge.serve.llama_api import LlamaServerApi
from kvbridge.serve.ollama_api import OllamaApi
from kvbridge.serve.protocol import (
    BLEND_HEADER, PRIORITY_APPLIED_HEADER, PRIORITY_HEADER, TIER_HEADER, ApiError, Generation, chunk_body, completion_id, parse_blend,
    parse_generation, parse_priority, response_body, usage, usage_chunk,
)
from kvbridge.serve.worker import INSTANCE_HEADER, WorkerApp, instance_id_for, worker_routes
from kvbridge.settings import Settings

log = logging.getLogger(__name__)


def build_app(settings: Settings, engine: ServeEngine, api_key: str = "", host: str | None = None,
              tenants: TenantTable | None = None, admin_key: str = "", instance_id: str | None = None,
              router_key: str = "") -> WorkerApp:
    """The app; `tenants` (kvbridge.serve.server.tenants_from) says whose key is whose; `api_key` alone is
    one tenant's; neither: no token needed and every caller is the tenant `default`. `admin_key`: the
    operator's, `router_key` the router's (each also taken when `tenants` has one already). `host`: the address serve listens on
    (default KVB_SERVE_HOST), a name the Host check lets in. `instance_id`: X-KVBridge-Instance (default:
    KVB_SERVE_INSTANCE_ID, else host-KVB_SERVE_PORT; the server passes the port it bound)."""
    host = host or settings.serve_host
    if instance_id is None:
        instance_id = instance_id_for(settings, host, settings.serve_port)
    if tenants is None:
        tenants = TenantTable.single(api_key) if api_key else TenantTable.open()
    tenants = tenants.with_operator(admin_key).with_router(router_key)
    metrics = ServeMetrics()
    live_state = LiveState(engine)

    async def chat(request: Request) -> Response:
        return await _generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await _generate(request, "completion")

    async def _generate(request: Request, kind: str) -> Response:
        endpoint = "chat" if kind == "chat" else "completions"
        try:
            asked = parse_priority(request.headers.get(PRIORITY_HEADER))
            blend = parse_blend(request.headers.get(BLEND_HEADER))
            body = await read_json(request, settings.serve_max_body_bytes)
            gen = parse_generation(body, kind, max_tokens_cap=settings.serve_max_tokens)
            tenant = getattr(request.state, "tenant", DEFAULT)
            priority = tenant.priority(asked)   # granted in the tenants file (max_priority), not claimed
            full = tenants.sees_everything(tenant)   # what a miss's detail may say (kvbridge.serve.misses)
            gen = dataclasses.replace(gen, cache_salt=tenant.cache_salt(gen.cache_salt), tenant=tenant.name,
                                      blend=blend)
            stored_first = pd.stores_before_answer(gen, settings.serve_role)
            job = Job(asyncio.get_running_loop())
            # tokenizing, and the engine's lock
            await run_in_threadpool(engine.submit, gen, priority, job, stored_first)
        except ApiError as exc:
            metrics.answered(endpoint, exc.status)
            return error_response(exc)
        gone = asyncio.ensure_future(client_gone(request))
        try:
            response = await _answer(gen, job, endpoint, gone, stored_first, full)
        finally:
            gone.cancel()   # a stream's own disconnect listener (Starlette's) takes over from here
        if asked is not None:   # the priority it ran at: less than asked when the tenant's grant is smaller
            response.headers[PRIORITY_APPLIED_HEADER] = str(priority)
        return response

    async def _answer(gen: Generation, job: Job, endpoint: str, gone: asyncio.Future, stored_first: bool,
                      full: bool) -> Response:
        first = await next_event(job, gone)
        rid = completion_id(gen.kind)
        if gen.stream and first is not None and first[0] != "error":
            headers = {TIER_HEADER: _tier(job, first), MISS_HEADER: header_value(_record(job, first)),
                       "Cache-Control": "no-cache", **_decode_headers(gen, _record(job, first))}
            later: list = []   # what _stream's end hands over to run once the stream has left
            return StreamingResponse(_stream(gen, job, first, rid, endpoint, full, later),
                                     media_type="text/event-stream", headers=headers,
                                     background=BackgroundTask(_run_all, later))
        last = first
        while last is not None and last[0] == "text":   # a whole answer: read past its pieces
            last = await next_event(job, gone)
        if last is None:                       # the client left: the request was cancelled, its blocks freed
            metrics.answered(endpoint, 499)
            return Response(status_code=499)
        if last[0] == "error":
            exc = as_api_error(last[1])
            metrics.answered(endpoint, exc.status)
            return error_response(exc)
        record = last[1]
        shown = client_view(record, full)
        after = metrics.finished(endpoint, record, gen.tenant, gen.cache_salt, shown)
        body = response_body(gen, rid, engine.model_id, record.text, _finish_reason(gen, record),
                             _usage(record, shown))
        if stored_first:
            body["kv_transfer_params"] = pd.prefill_params(instance_id, record, settings.chunk_size, engine.model_id)
        return JSONResponse(body, headers={TIER_HEADER: record.tier, MISS_HEADER: shown.reason,
                                           **_decode_headers(gen, record)}, background=_after_answer(after))

    async def _stream(gen: Generation, job: Job, first, rid: str, endpoint: str, full: bool,
                      later: list) -> AsyncIterator[bytes]:
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
                    shown = client_view(value, full)
                    if gen.include_usage:
                        yield _sse(usage_chunk(gen, rid, engine.model_id, _usage(value, shown)))
                    yield b"data: [DONE]\n\n"
                    after = metrics.finished(endpoint, value, gen.tenant, gen.cache_salt, shown)
                    if after is not None:
                        later.append(after)
                    return
                else:   # an error after the stream began: OpenAI's error object as the last event
                    exc = as_api_error(value)
                    metrics.answered(endpoint, exc.status)
                    yield _sse(exc.body())
                    return
                event = await job.next_event()
        finally:
            if job.future is not None and not job.future.done():   # the client went away mid-stream
                job.cancel()                                       # on its own thread: no await here
                metrics.answered(endpoint, 499)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": engine.model_id, "object": "model", "created": int(engine.model_path.stat().st_mtime),
             "owned_by": "kvbridge", "aliases": engine.model_aliases}]})   # -a's names, as llama-server lists them

    def caller(request: Request) -> Tenant:
        return getattr(request.state, "tenant", DEFAULT)

    async def health(request: Request) -> Response:
        if not tenants.sees_everything(caller(request)):
            # up or down and nothing else, without waiting on the engine: how long a read of its state
            # takes would tell whether another tenant's swap holds the scheduler
            return JSONResponse({"status": "ok"})
        state, age_s = await live_state.read()
        return JSONResponse({"status": "ok", "engine": engine.name, "model": engine.model_id, **state,
                             **engine.exact_mode(), "state_age_s": age_s})

    async def prometheus(request: Request) -> Response:
        who = caller(request)
        if tenants.sees_everything(who):
            state, _ = await live_state.read()
            body, content_type = metrics.render(state, live_state.held)
        else:
            body, content_type = metrics.render_tenant(who.name)
        return Response(body, media_type=content_type)

    async def not_found(request: Request, exc) -> Response:
        return error_response(ApiError(404, f"no such endpoint: {request.method} {request.url.path}",
                                       code="not_found"))

    async def wrong_method(request: Request, exc) -> Response:
        status = getattr(exc, "status_code", 405)
        return error_response(ApiError(status, f"{request.method} is not allowed on {request.url.path}"))

    llama = LlamaServerApi(settings, engine, tenants, metrics)
    routes = [Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", prometheus, methods=["GET"]),
              Route("/v1/health", health, methods=["GET"]),   # llama-server's second name for it
              *worker_routes(settings, engine, live_state, instance_id, vocab=llama.vocab),
              *llama.routes(),   # llama-server's /completion, /detokenize, /props, /slots (kvbridge.serve.llama_api)
              *OllamaApi(settings, engine, tenants, metrics).routes()]   # Ollama's /api/* (kvbridge.serve.ollama_api)
    # outermost first (WorkerApp's X-KVBridge-Instance outside them all): a wrong Host is refused before CORS
    # or the key are looked at
    hosts = allowed_hosts(settings.serve_allowed_hosts, host)
    middleware = [Middleware(HostCheck, allowed=hosts)]
    origins = [o.strip() for o in settings.serve_cors_origins.split(",") if o.strip()]
    if origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type", "X-KVBridge-Priority", "X-KVBridge-Blend"],
                                     expose_headers=[TIER_HEADER, MISS_HEADER, INSTANCE_HEADER, pd.RESTORED_HEADER,
                                                     PRIORITY_APPLIED_HEADER]))
    middleware.append(Middleware(BearerAuth, tenants=tenants, paths=frozenset(route.path for route in routes)))
    app = WorkerApp(routes=routes, middleware=middleware, exception_handlers={404: not_found, 405: wrong_method})
    app.instance_id = instance_id
    app.state.engine = engine
    app.state.metrics = metrics
    return app


# -- helpers ----------------------------------------------------------------------------------------


def _record(job: Job, first):
    """The request's record: final once done, else the live one the scheduler fills at admission."""
    record = first[1] if first[0] == "done" else None
    if record is None and job.future is not None:
        record = getattr(job.future, "record", None)
    return record


def _tier(job: Job, first) -> str:
    return getattr(_record(job, first), "tier", None) or "pending"


def _decode_headers(gen: Generation, record) -> dict[str, str]:
    """A PD decode leg's: how many prompt tokens were restored or shared (logged when fewer than stored)."""
    entry = pd.decode_leg(gen)
    if entry is None or record is None:
        return {}
    pd.check_restore(entry, record)
    return {pd.RESTORED_HEADER: str(record.matched_tokens)}


def _after_answer(after) -> BackgroundTask | None:
    """What runs once the answer has left (Starlette runs a plain function on a worker thread): the operator's
    probe across other salts (kvbridge.serve.metrics), whose time no client's answer includes."""
    return BackgroundTask(after) if after is not None else None


def _run_all(calls: list) -> None:
    for call in calls:
        call()


def _usage(record, shown) -> dict:
    return usage(record.prompt_tokens, record.gen_tokens, record.matched_tokens, shown.usage_fields())


def _finish_reason(gen: Generation, record) -> str:
    return "length" if record.gen_tokens >= gen.max_tokens else "stop"


def _sse(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

