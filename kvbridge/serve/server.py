"""`python -m kvbridge serve`: load the engine, serve the app with uvicorn, drain on SIGTERM.

The ready line `KVBridge serve ready on http://HOST:PORT` is printed once the socket listens (what
scripts/serve.sh and kvbridge.fleet wait for). The socket is bound before the app is built, so the
instance id (X-KVBridge-Instance: host-port) has the real port under --port 0, and the engine joins
the fleet under it (its KV-event publisher, when KVB_KV_EVENTS_URL is set) before the ready line. SIGTERM or SIGINT: stop accepting, let running requests finish for up
to KVB_SERVE_DRAIN_TIMEOUT seconds, then close the engine (unfinished requests fail, their KV blocks
freed) and exit 0. `BackgroundServe` runs the same app beside the GUI (`gui --serve`). Both refuse
to listen beyond loopback without a key (`run` before the model loads).
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading

import uvicorn

from kvbridge.errors import BadSettings
from kvbridge.serve.app import build_app
from kvbridge.serve.engines import ServeEngine, make_serve_engine
from kvbridge.serve.tenants import TenantTable
from kvbridge.serve.worker import instance_id_for
from kvbridge.settings import Settings
from kvbridge.settings.checks import open_serve_problem
from kvbridge.settings.secrets import secret_from, secret_from_file

log = logging.getLogger(__name__)
READY = "KVBridge serve ready on http://{host}:{port}"


def api_key_from(settings: Settings, environ=os.environ) -> str:
    """The bearer token: from the key file (--api-key-file, KVB_SERVE_API_KEY_FILE), read once here, or from the
    variable KVB_SERVE_API_KEY_ENV names; '' when no key is asked for. BadSettings naming both when both are set."""
    if settings.serve_api_key_file and settings.serve_api_key_env:
        raise BadSettings("KVB_SERVE_API_KEY_FILE (--api-key-file) and KVB_SERVE_API_KEY_ENV both name serve's key; "
                          "keep one of them")
    if settings.serve_api_key_file:
        return secret_from_file("KVB_SERVE_API_KEY_FILE (--api-key-file)", settings.serve_api_key_file)
    return secret_from("KVB_SERVE_API_KEY_ENV", settings.serve_api_key_env, environ,
                       unset_hint="leave KVB_SERVE_API_KEY_ENV empty to need no key")


def admin_key_from(settings: Settings, environ=os.environ) -> str:
    """The operator's key from the variable KVB_SERVE_ADMIN_KEY_ENV names; '' when there is no operator key."""
    return secret_from("KVB_SERVE_ADMIN_KEY_ENV", settings.serve_admin_key_env, environ,
                       unset_hint="leave KVB_SERVE_ADMIN_KEY_ENV empty for no operator key")


def router_key_from(settings: Settings, environ=os.environ) -> str:
    """The router's key from the variable KVB_SERVE_ROUTER_KEY_ENV names; '' when there is no router key."""
    return secret_from("KVB_SERVE_ROUTER_KEY_ENV", settings.serve_router_key_env, environ,
                       unset_hint="leave KVB_SERVE_ROUTER_KEY_ENV empty for no router key")


def _config(app, settings: Settings, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                          timeout_graceful_shutdown=max(1, int(settings.serve_drain_timeout)), ws="none")


class _Server(uvicorn.Server):
    """uvicorn's server, printing the ready line once it listens."""

    def __init__(self, config: uvicorn.Config, on_ready=None) -> None:
        super().__init__(config)
        self._on_ready = on_ready

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self._on_ready is not None:
            self._on_ready(self.bound_port())

    def bound_port(self) -> int:
        """The port the socket listens on (what --port 0 was given)."""
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return self.config.port


def tenants_from(settings: Settings, environ=os.environ) -> TenantTable:
    """Who may call and as which tenant: the tenants file (plus the single key as `default`), the single
    key alone, or no key asked for (every caller is `default`); plus the operator's and the router's keys, if set."""
    key = api_key_from(settings, environ)
    if settings.serve_tenants_file:
        table = TenantTable.load(settings.serve_tenants_file, key)
    else:
        table = TenantTable.single(key) if key else TenantTable.open()
    return table.with_operator(admin_key_from(settings, environ)).with_router(router_key_from(settings, environ))


def model_label(settings: Settings) -> str:
    """The model serve will load, for its first line: the GGUF (-m, KVB_MODEL_PATH), an Ollama model's, or the
    embedded model's name."""
    if settings.model_path:
        return settings.model_path
    return f"Ollama's {settings.ollama_model}" if settings.ollama_model else f"the embedded {settings.model}"


def check_exposure(settings: Settings, host: str) -> None:
    """Refuse to listen beyond this machine without a key (BadSettings naming both settings). The
    settings check sees KVB_SERVE_HOST; this sees --host too."""
    problem = open_serve_problem(host, settings.serve_api_key_env, settings.serve_tenants_file,
                                 settings.serve_api_key_file)
    if problem:
        raise BadSettings(problem)


def cannot_bind(host: str, port: int) -> str:
    return (f"Cannot serve on {host}:{port}: the port is in use or the address is not available here "
            "(--port / KVB_SERVE_PORT, --host / KVB_SERVE_HOST).")


def check_port(host: str, port: int) -> None:
    """Refuse a port another process holds before the model loads (BadSettings naming the settings), not
    once it has loaded (the real socket is bound after)."""
    if port != 0:
        listen_socket(host, port).close()


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (port 0: a free one); BadSettings naming the settings when it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds: TIME_WAIT is no obstacle
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise BadSettings(f"{cannot_bind(host, port)} ({exc.strerror or exc})") from None
    return sock


def _bound_app(settings: Settings, engine: ServeEngine, host: str, port: int, tenants: TenantTable):
    """(socket, app): the socket bound first, so the instance id names the real port; the engine joins the
    fleet under that id (a closed socket when that fails)."""
    sock = listen_socket(host, port)
    try:
        instance_id = instance_id_for(settings, host, sock.getsockname()[1])
        engine.join_fleet(instance_id)
        return sock, build_app(settings, engine, host=host, tenants=tenants, instance_id=instance_id)
    except BaseException:
        sock.close()
        raise


def exact_line(engine: ServeEngine) -> str:
    """The start line saying whether answers are exact (kvbridge.scheduler.exact), and why not."""
    mode = engine.exact_mode()
    if not mode:
        return f"exact mode: the scheduler's; the {engine.name} engine runs one request at a time"
    if mode["exact"]:
        return "exact mode: on (every answer equals the same request run alone; --no-exact turns it off)"
    return f"exact mode: off: {mode['exact_off_reason']}"


def run(settings: Settings, host: str | None = None, port: int | None = None, engine_key: str | None = None) -> int:
    host = host or settings.serve_host
    port = settings.serve_port if port is None else port
    check_exposure(settings, host)
    check_port(host, port)
    tenants = tenants_from(settings)
    for sig in (signal.SIGTERM, signal.SIGINT):   # while the model loads: stop at once
        signal.signal(sig, lambda signum, frame: sys.exit(0))
    print(f"loading the {engine_key or settings.serve_engine} engine: {model_label(settings)}, context "
          f"{settings.ctx_size} tokens a request (-c), {settings.sched_max_running} at once (-np)…", flush=True)
    engine = make_serve_engine(settings, engine_key)
    print(exact_line(engine), flush=True)
    try:
        try:
            sock, app = _bound_app(settings, engine, host, port, tenants)
        except BadSettings as exc:   # the port was taken since check_port looked, or the publisher's was
            print(exc, file=sys.stderr)
            return 2
        server = _Server(_config(app, settings, host, port),
                         on_ready=lambda bound: print(READY.format(host=_url_host(host), port=bound), flush=True))
        # uvicorn drains on SIGTERM/SIGINT, then raises the signal again for the handler it found:
        # this one, so the engine below is still closed and the exit status is 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: None)
        try:
            server.run(sockets=[sock])
        except SystemExit:
            if server.started:
                raise
        finally:
            sock.close()
        if not server.started:
            print(cannot_bind(host, port), file=sys.stderr)
            return 2
    finally:
        engine.close()
    print("serve stopped.", flush=True)
    return 0


class BackgroundServe:
    """The app on a thread of this process, beside the GUI (`gui --serve`); signals stay with the caller.
    `stop()` drains like SIGTERM does; the engine is the caller's to close."""

    def __init__(self, settings: Settings, engine: ServeEngine, host: str | None = None,
                 port: int | None = None) -> None:
        self.host = host or settings.serve_host
        self.port = settings.serve_port if port is None else port
        check_exposure(settings, self.host)
        ready = threading.Event()
        self._sock, app = _bound_app(settings, engine, self.host, self.port, tenants_from(settings))
        self.metrics = app.state.metrics   # the GUI's lab shows its per-tenant usage
        self.server = _Server(_config(app, settings, self.host, self.port),
                              on_ready=lambda bound: (setattr(self, "port", bound), ready.set()))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                       name="kvbridge-serve", daemon=True)
        self.thread.start()
        if not ready.wait(30) or not self.server.started:
            self.stop(5)
            raise BadSettings(f"serve could not listen on {self.host}:{self.port}: the port is in use or the "
                              "address is not available (KVB_SERVE_PORT / KVB_SERVE_HOST)")

    @property
    def url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}"

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self._sock.close()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

