"""`serve` as one worker of a fleet behind a router (vllm-router; kvbridge.fleet starts one): the
routes a router calls besides the completions, and the instance's name on every response.

    POST /v1/chat/completions/render, POST /v1/completions/render   -> {"token_ids": [...]}
    POST /tokenize   ({"prompt": str} or {"messages": [...]})       -> {"tokens", "count", "max_model_len"}
                     ({"content": str}, llama-server's)            -> {"tokens"}
    GET  /get_load                                                  -> {"load": running + waiting}
    GET  /get_server_info                                           -> model, instance, block size, role
    GET  /kv_event_sources                                          -> {"0": {"endpoint": ...}} or {}

Who may call them is kvbridge.serve.guards.ROUTE_CALLERS: render and /tokenize any authenticated caller (its
own prompt's ids), the last three, which show the whole server's state, the operator or the router
(KVB_SERVE_ROUTER_KEY_ENV), never a tenant.

A router routing by prefix (`cache_aware`, `kv_aware`) asks every worker for a request's token ids
and matches them against what it knows each worker holds; a render here is the completion's own parse
(the same Generation, refused the same way) and the engine's own template and tokenizer, so its ids
are exactly the ones the completion prefills. `kv_aware` hashes those ids in blocks of the chunk size
(`kv_block_size`) against the KV events this instance publishes (kvbridge.kv_events, at the endpoint
/kv_event_sources names).

`X-KVBridge-Instance` names this instance on every response (a router forwards it, so a client sees
which worker answered): KVB_SERVE_INSTANCE_ID, else host-port with the port serve bound.
"""
from __future__ import annotations

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvbridge.serve.engines import LiveState, ServeEngine
from kvbridge.serve.guards import as_api_error, error_response, read_json
from kvbridge.serve.protocol import ApiError, parse_generation
from kvbridge.settings import Settings

INSTANCE_HEADER = "X-KVBridge-Instance"
# what /get_server_info calls each role (vllm-router's worker types)
WORKER_TYPES = {"both": "regular", "prefill": "prefill", "decode": "decode"}


def instance_id_for(settings: Settings, host: str, port: int) -> str:
    """KVB_SERVE_INSTANCE_ID, else host-port (the port serve bound: --port 0 is known only then)."""
    return settings.serve_instance_id or f"{host}-{port}"


class InstanceHeader:
    """X-KVBridge-Instance on every response: pure ASGI, so streams pass through untouched."""

    def __init__(self, app, instance_id: str) -> None:
        self.app, self._header = app, (INSTANCE_HEADER.lower().encode(), instance_id.encode("latin-1"))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self._header]}
            await send(message)

        await self.app(scope, receive, send_named)


class WorkerApp(Starlette):
    """The Starlette app with InstanceHeader outside everything, Starlette's own error middleware too (a
    500 it answers carries the header as well)."""

    instance_id = ""

    def build_middleware_stack(self):
        return InstanceHeader(super().build_middleware_stack(), self.instance_id)


def worker_routes(settings: Settings, engine: ServeEngine, live_state: LiveState, instance_id: str,
                  vocab=None) -> list[Route]:
    """The routes a router calls besides the completions; `vocab()`: the model's vocabulary, for llama-server's
    form of /tokenize."""

    async def tokens_of(body, kind: str) -> list[int]:
        """The ids the completion of this body would prefill; ApiError as the completion would refuse it."""
        gen = parse_generation(body, kind, max_tokens_cap=settings.serve_max_tokens)
        try:
            return [int(t) for t in await run_in_threadpool(engine.tokens_of, gen)]
        except NotImplementedError:
            raise ApiError(501, f"the {engine.name} engine (KVB_SERVE_ENGINE) cannot tell a prompt's token ids; "
                                "use the scheduler engine for a router that routes by prefix",
                           code="not_implemented") from None
        except ApiError:
            raise
        except Exception as exc:   # the engine refused the prompt (empty, say): the completion's error
            raise as_api_error(exc) from None

    async def render(request: Request, kind: str) -> Response:
        try:
            tokens = await tokens_of(await read_json(request, settings.serve_max_body_bytes), kind)
        except ApiError as exc:
            return error_response(exc)
        return JSONResponse({"token_ids": tokens})

    async def chat_render(request: Request) -> Response:
        return await render(request, "chat")

    async def completion_render(request: Request) -> Response:
        return await render(request, "completion")

    async def tokenize(request: Request) -> Response:
        """vLLM's /tokenize: a chat when the body has messages, else a prompt; llama-server's when the body has
        `content` (kvbridge.serve.llama_api: the text's ids, BOS only with add_special)."""
        try:
            body = await read_json(request, settings.serve_max_body_bytes)
            if isinstance(body, dict) and "content" in body and vocab is not None:
                from kvbridge.serve.llama_api import tokenize_content

                return JSONResponse(await run_in_threadpool(tokenize_content, vocab(), body))
            kind = "chat" if isinstance(body, dict) and "messages" in body else "completion"
            tokens = await tokens_of(body, kind)
        except ApiError as exc:
            return error_response(exc)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": settings.ctx_size})

    async def get_load(request: Request) -> Response:
        state, _ = await live_state.read()
        return JSONResponse({"load": int(state.get("running", 0)) + int(state.get("waiting", 0))})

    async def server_info(request: Request) -> Response:
        info = {"model_id": engine.model_id, "model_path": str(engine.model_path), "instance_id": instance_id,
                "kv_block_size": settings.chunk_size, "worker_type": WORKER_TYPES.get(settings.serve_role, "regular"),
                "role": settings.serve_role, "engine": engine.name, **engine.exact_mode()}
        if engine.kv_events is not None:   # what the router needs to index the events (kvbridge.kv_events)
            info.update(engine.kv_events.server_info_fields())
        return JSONResponse(info)

    async def kv_event_sources(request: Request) -> Response:
        """Keyed by data-parallel rank, as vLLM's (kvbridge.kv_events writes the body); {} when this instance
        publishes nothing."""
        events = engine.kv_events
        return JSONResponse(events.kv_event_sources() if events is not None else {})

    return [Route("/v1/chat/completions/render", chat_render, methods=["POST"]),
            Route("/v1/completions/render", completion_render, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/get_load", get_load, methods=["GET"]),
            Route("/get_server_info", server_info, methods=["GET"]),
            Route("/kv_event_sources", kv_event_sources, methods=["GET"])]
