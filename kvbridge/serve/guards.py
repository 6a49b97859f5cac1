"""What a request must pass before `serve` reads it, each refused in OpenAI's error shape naming the
setting that decides it:

    the Host header     a name this server answers to (KVB_SERVE_ALLOWED_HOSTS), else 400: a web page
                        that rebinds its own name to 127.0.0.1 sends that name, so it cannot read answers;
    the key             `Authorization: Bearer <key>` when serve has a key (KVB_SERVE_API_KEY_FILE,
                        KVB_SERVE_API_KEY_ENV) or the tenants file lists keys, else 401;
    the caller          each route answers the callers ROUTE_CALLERS names (a tenant, the operator's key
                        KVB_SERVE_ADMIN_KEY_ENV, the router's key KVB_SERVE_ROUTER_KEY_ENV), else 403: the
                        routes that show the server's state answer no tenant, completions no operator or
                        router;
    the Content-Type    application/json, else 415: a page's "simple" cross-site form post cannot send it;
    the body size       at most KVB_SERVE_MAX_BODY_BYTES, else 413, from Content-Length before a byte of
                        the body is read, and counted as a chunked body arrives.

The first two are ASGI middleware around every route; the last two are how the POST routes read their
body (`read_json`). `error_response` is where every refusal of `serve` becomes a response.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from kvbridge.errors import KVBridgeError
from kvbridge.serve.protocol import ApiError
from kvbridge.settings import format_size
from kvbridge.settings.checks import host_list
from kvbridge.serve.tenants import DEFAULT, TenantTable

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/v1/health", "/")   # up or down, to anyone: "/" is the heartbeat Ollama's clients probe
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
TENANT, OPERATOR, ROUTER = "tenant", "operator", "router"   # Tenant.role
_ANY = frozenset({TENANT, OPERATOR, ROUTER})
_STATE = frozenset({OPERATOR, ROUTER})
# Who may call each route of the app, with a key (the table in Docs/Serve.md, "Who may call which route"; a
# test walks every route of the app against it). /health is open without a key too (up or down only); with no
# key configured at all every caller is the operator. A route of the app missing here answers the operator only.
ROUTE_CALLERS: dict[str, frozenset[str]] = {
    "/v1/chat/completions": frozenset({TENANT}),
    "/v1/completions": frozenset({TENANT}),
    "/v1/models": _ANY,
    "/health": _ANY,
    "/metrics": frozenset({TENANT, OPERATOR}),      # a tenant's own series; the operator's whole registry
    "/v1/chat/completions/render": _ANY,            # the caller's own prompt as token ids: nothing of anyone else
    "/v1/completions/render": _ANY,
    "/tokenize": _ANY,
    "/get_load": _STATE,                            # the whole server's load: another tenant's requests move it
    "/get_server_info": _STATE,                     # the model file's path, the KV-event endpoints
    "/kv_event_sources": _STATE,
    # llama-server's (kvbridge.serve.llama_api): generation as the OpenAI side's; the model's facts to anyone; the
    # slots, which show what else runs, to the operator
    "/completion": frozenset({TENANT}),
    "/detokenize": _ANY,
    "/props": _ANY,
    "/slots": frozenset({OPERATOR}),
    "/v1/health": _ANY,
    # Ollama's API (kvbridge.serve.ollama_api): generation as the OpenAI side's, the model's own facts to anyone
    "/api/chat": frozenset({TENANT}),
    "/api/generate": frozenset({TENANT}),
    "/api/embed": frozenset({TENANT}),
    "/api/tags": _ANY,
    "/api/show": _ANY,
    "/api/ps": _ANY,
    "/api/version": _ANY,
    "/": _ANY,
}
# why each kind of caller is refused a route, naming the settings that decide it
_REFUSED = {
    TENANT: "shows the whole server's state: it answers the operator's key (KVB_SERVE_ADMIN_KEY_ENV) or the "
            "router's (KVB_SERVE_ROUTER_KEY_ENV), never a tenant's",
    OPERATOR: "runs requests of a tenant: send it with a tenant's key (KVB_SERVE_TENANTS_FILE, KVB_SERVE_API_KEY_FILE "
              "or KVB_SERVE_API_KEY_ENV); the operator's key (KVB_SERVE_ADMIN_KEY_ENV) reads /metrics and /health",
    ROUTER: "is not a router's: the router's key (KVB_SERVE_ROUTER_KEY_ENV) calls render, /tokenize, /get_load, "
            "/get_server_info, /kv_event_sources, /health and /v1/models; completions need a tenant's key "
            "(KVB_SERVE_TENANTS_FILE, KVB_SERVE_API_KEY_FILE or KVB_SERVE_API_KEY_ENV)",
}
_CODES = {TENANT: "not_for_tenants", OPERATOR: "operator_key", ROUTER: "router_key"}
# Ollama's clients send no key unless told: how to tell them
_OLLAMA_KEY_HINT = ("; Ollama's clients send it when told: ollama.Client(host, headers={'Authorization': 'Bearer <key>'}) "
                    "or OLLAMA_API_KEY=<key> in the client's environment")


def route_refusal(method: str, path: str, caller, no_keys: bool) -> "ApiError | None":
    """403 when `caller` (a Tenant) may not call `path` (ROUTE_CALLERS), else None; `no_keys`: no key is configured
    at all, so the one local user may call everything."""
    if no_keys:
        return None
    role = caller.role
    if role in ROUTE_CALLERS.get(path, frozenset({OPERATOR})):
        return None
    return ApiError(403, f"{method} {path} {_REFUSED[role]}", code=_CODES[role], kind="permission_error")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def allowed_hosts(setting: str, bind_host: str) -> frozenset[str]:
    """The Host names answered: KVB_SERVE_ALLOWED_HOSTS plus the address serve listens on (a client that
    reached it by that address named it itself)."""
    return frozenset([*host_list(setting), *host_list(bind_host)])


def host_name(header: str) -> str:
    """'Example.COM:8000' -> 'example.com', '[::1]:8000' -> '::1' (no port, lower case, no final dot)."""
    header = header.strip().lower()
    if header.startswith("["):
        name = header[1:].partition("]")[0]
    else:
        name = header.partition(":")[0]
    return name.rstrip(".")


class HostCheck:
    """400 unless the Host header names this server (`allowed` holds '*': any)."""

    def __init__(self, app, allowed: frozenset[str]) -> None:
        self.app, self._allowed = app, allowed

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or "*" in self._allowed:
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if host_name(header) not in self._allowed:
            shown = header or "(none)"
            response = error_response(ApiError(
                400, f"this server does not answer to the host name {shown!r}; add the name clients use to "
                     "KVB_SERVE_ALLOWED_HOSTS (comma-separated) where serve runs",
                param="Host", code="host_not_allowed"))
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BearerAuth:
    """Who calls: `Authorization: Bearer <key>` resolved to a tenant, the operator or the router (digests
    compared in constant time), put in request.state.tenant. Where a key is needed (every path but /health
    and preflights, when keys are configured) a key that names nobody is 401; elsewhere the caller is
    `default`. Then the route must answer that caller (ROUTE_CALLERS), else 403; `paths`: the app's routes
    (a path it does not have goes on to its 404)."""

    def __init__(self, app, tenants: TenantTable, paths: frozenset[str] = frozenset(ROUTE_CALLERS)) -> None:
        self.app, self._tenants, self._paths = app, tenants, paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        caller = self._tenants.resolve(token.strip()) if scheme.lower() == b"bearer" and token.strip() else None
        refusal = None
        if caller is None and self._tenants.required and scope["path"] not in OPEN_PATHS:
            refusal = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with serve's key "
                                    "(KVB_SERVE_API_KEY_FILE or the variable KVB_SERVE_API_KEY_ENV names), or a "
                                    "tenant's key (KVB_SERVE_TENANTS_FILE)" + _OLLAMA_KEY_HINT * scope["path"].startswith("/api/"),
                               code="invalid_api_key", kind="authentication_error")
        elif scope["path"] in self._paths and not (caller is None and scope["path"] in OPEN_PATHS):
            refusal = route_refusal(scope["method"], scope["path"], caller or DEFAULT, self._tenants.no_keys)
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = caller or DEFAULT
        await self.app(scope, receive, send)


def as_api_error(exc: Any) -> ApiError:
    """An engine's failure as the error a client gets: a refusal is 400, naming the prompt when it is too long."""
    if isinstance(exc, ApiError):
        return exc
    from kvbridge.scheduler import RequestRefused

    if isinstance(exc, RequestRefused):
        message = str(exc)
        if "prompt has" in message:
            # "prompt is too long" is the phrase LangChain and LiteLLM read (besides the code) to raise
            # their context-overflow errors, which their callers catch to trim a history or fall back
            return ApiError(400, f"prompt is too long: {message}", param="messages", code="context_length_exceeded")
        return ApiError(400, message)
    if isinstance(exc, KVBridgeError):
        return ApiError(500, str(exc), kind="server_error")
    log.error("a request failed unexpectedly: %r", exc)
    return ApiError(500, f"the request failed unexpectedly ({type(exc).__name__}); see the server log",
                    kind="server_error")


async def read_json(request: Request, max_bytes: int) -> Any:
    """The body as JSON: 415 unless it is sent as application/json, 413 past `max_bytes`, 400 if malformed."""
    content_type = request.headers.get("content-type", "")
    if not _is_json_type(content_type):
        raise ApiError(415, f"send the body as JSON with 'Content-Type: application/json' (got "
                            f"{content_type or 'no Content-Type'})", param="Content-Type",
                       code="unsupported_media_type")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(499, "the client disconnected while sending the request", code="cancelled") from None
    try:
        return json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None


def _is_json_type(content_type: str) -> bool:
    """application/json, with at most a UTF-8 charset (JSON is UTF-8: another charset would be misread)."""
    media, *params = [part.strip().lower() for part in content_type.split(";")]
    charsets = [p.partition("=")[2].strip('"') for p in params if p.startswith("charset=")]
    return media == "application/json" and all(c in ("utf-8", "utf8") for c in charsets)


def _too_large(max_bytes: int) -> ApiError:
    # Connection: close: the rest of the body is not read, and the connection cannot carry another request
    return ApiError(413, f"the request body is larger than KVB_SERVE_MAX_BODY_BYTES={format_size(max_bytes)} allows; "
                         "send less, or raise the setting where serve runs", code="request_too_large",
                    headers={"Connection": "close"})
