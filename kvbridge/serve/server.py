"""`python -m kvbridge serve`: load the engine, serve the app with uvicorn, drain on SIGTERM.

The ready line `KVBridge serve ready on http://HOST:PORT` is printed once the socket listens (what
scripts/serve.sh and kvbridge.fleet wait for). The socket is bound before the app is built, so the
instance id (X-KVBridge-Instance: host-port) has the real port under --port 0, and the engine joins
the fleet under it (its KV-event publisher, when KVB_KV_EVENTS_URL is set) before the ready line. SIGTERM or SIGINT: stop accepting, let running requests finish for up
to KVB_SERVE_DRAIN_TIMEOUT seconds, then close the engine (unfinished requests fail, their KV blocks
freed) and exit 0. `BackgroundServe` runs the same app beside the GUI (`gui --serve`). Both refuse
to listen beyond loopback without a key (`run` before the model loads).

While the model loads, `run` already holds its socket and answers every request there as llama-server does then:
503 `{"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}` (LoadingAnswer), so a
health check that polls /health or /v1/health sees "loading", not "refused". It says nothing else (no key is
asked for: the answer shows nothing), and it stops before uvicorn takes the socket.
"""
from __future__ import annotations

import json
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
from kvbridge.serve.tenants import DEFAULT, TenantTable, key_digest
from kvbridge.serve.worker import instance_id_for
from kvbridge.settings import Settings
from kvbridge.settings.checks import open_serve_problem
from kvbridge.settings.flags import LLAMA_API_KEY
from kvbridge.settings.secrets import secret_from, secret_from_file

log = logging.getLogger(__name__)
READY = "KVBridge serve ready on http://{host}:{port}"


def api_key_from(settings: Settings, environ=os.environ) -> str:
    """The bearer token: from the key file (--api-key-file, KVB_SERVE_API_KEY_FILE), read once here, or from the
    variable KVB_SERVE_API_KEY_ENV names; '' when no key is asked for. BadSettings naming both when both are set."""
    if settings.serve_api_key_file and settings.serve_api_key_env:
        raise BadSettings("KVB_SERVE_API_KEY_FILE (--api-key-file) and KVB_SERVE_API_KEY_ENV both name serve's key; "
                          "keep one of them")
    if settings.serve_api_key_file:   # llama-server's format: a key a line, `#` lines comments (api_keys_from)
        return secret_from_file("KVB_SERVE_API_KEY_FILE (--api-key-file)", settings.serve_api_key_file, per_line=True)
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


def api_keys_from(settings: Settings, environ=os.environ) -> list[str]:
    """serve's keys: the key file's, one a line (llama-server's --api-key-file), KVB_SERVE_API_KEY_ENV's one, or,
    read from llama-server's LLAMA_API_KEY (serve's drop-in reading, kvbridge.settings.flags), its comma-separated
    keys, as llama-server splits them: any of them is the `default` tenant's (llama-server has no tenants: one cache
    for every key). BadSettings when LLAMA_API_KEY holds none."""
    key = api_key_from(settings, environ)
    if settings.serve_api_key_file:
        return key.splitlines()
    if settings.serve_api_key_env != LLAMA_API_KEY:
        return [key] if key else []
    keys = [part.strip() for part in key.split(",") if part.strip()]
    if not keys:
        raise BadSettings(f"{LLAMA_API_KEY} is set but holds no key (comma-separated keys, as llama-server reads it); "
                          "set a key in it or unset it to need none")
    return keys


def tenants_from(settings: Settings, environ=os.environ) -> TenantTable:
    """Who may call and as which tenant: the tenants file (plus the single key as `default`), the single
    key alone (or LLAMA_API_KEY's keys), or no key asked for (every caller is `default`); plus the operator's and the
    router's keys, if set."""
    keys = api_keys_from(settings, environ)
    if settings.serve_tenants_file:
        if len(keys) > 1:
            where = "KVB_SERVE_API_KEY_FILE (--api-key-file)" if settings.serve_api_key_file else LLAMA_API_KEY
            raise BadSettings(f"{where} holds {len(keys)} keys and KVB_SERVE_TENANTS_FILE names tenants: give each "
                              f"key its own tenant in the file and keep one key (or none) in {where}")
        table = TenantTable.load(settings.serve_tenants_file, keys[0] if keys else "")
    else:
        table = TenantTable([(key_digest(key), DEFAULT) for key in keys]) if keys else TenantTable.open()
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


LOADING = json.dumps({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}).encode()


class LoadingAnswer:
    """llama-server's 503 "Loading model" to every request on the bound socket while the engine loads, one
    connection at a time (a thread, stopped before uvicorn takes the socket; connections waiting then are
    uvicorn's). A request whose head does not arrive within a second is dropped."""

    def __init__(self, sock: socket.socket) -> None:
        sock.listen(128)
        self._sock = sock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvbridge-loading", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._sock.settimeout(0.1)   # so stop() is seen within a tenth of a second
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:   # the socket closed under it (serve stopped while loading)
                return
            with conn:
                self._answer(conn)

    @staticmethod
    def _answer(conn: socket.socket) -> None:
        conn.settimeout(1.0)
        head = b""
        try:
            while b"\r\n\r\n" not in head and len(head) < 65536:
                piece = conn.recv(4096)
                if not piece:
                    return
                head += piece
            conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nRetry-After: 1\r\nConnection: close\r\n\r\n" % len(LOADING)
                         + LOADING)
        except OSError:   # the client went away or was too slow: nothing to answer
            return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.settimeout(None)


def _bound_app(settings: Settings, engine: ServeEngine, host: str, port: int, tenants: TenantTable,
               sock: socket.socket | None = None):
    """(socket, app): the socket bound first (or `sock`, bound already), so the instance id names the real port;
    the engine joins the fleet under that id (a closed socket when that fails)."""
    sock = sock or listen_socket(host, port)
    try:
        instance_id = instance_id_for(settings, host, sock.getsockname()[1])
        engine.join_fleet(instance_id)
        return sock, build_app(settings, engine, host=host, tenants=tenants, instance_id=instance_id)
    except BaseException:
        sock.close()
        raise


def kv_budget_line(settings: Settings, engine_key: str) -> str:
    """One line when a request's context (-c, KVB_CTX_SIZE) is larger than the KV every request shares
    (KVB_SCHED_KV_CELLS): the scheduler would refuse every prompt past the budget, so say it at start."""
    if engine_key != "scheduler" or settings.ctx_size <= settings.sched_kv_cells:
        return ""
    return (f"note: a request may use {settings.ctx_size} tokens (-c, KVB_CTX_SIZE) but every request together has "
            f"{settings.sched_kv_cells} KV cells (KVB_SCHED_KV_CELLS): a prompt and answer over "
            f"{settings.sched_kv_cells} tokens can never run; raise KVB_SCHED_KV_CELLS or lower -c")


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
    tenants = tenants_from(settings)
    for sig in (signal.SIGTERM, signal.SIGINT):   # while the model loads: stop at once
        signal.signal(sig, lambda signum, frame: sys.exit(0))
    print(f"loading the {engine_key or settings.serve_engine} engine: {model_label(settings)}, context "
          f"{settings.ctx_size} tokens a request of {settings.sched_kv_cells} shared (-c), "
          f"{settings.sched_max_running} at once (-np)…", flush=True)
    too_small = kv_budget_line(settings, engine_key or settings.serve_engine)
    if too_small:
        print(too_small, file=sys.stderr, flush=True)
    sock = listen_socket(host, port)   # held from now on: a port another process holds is refused before the load
    loading = LoadingAnswer(sock)
    try:
        engine = make_serve_engine(settings, engine_key)
    except BaseException:
        loading.stop()
        sock.close()
        raise
    loading.stop()
    print(exact_line(engine), flush=True)
    try:
        try:
            sock, app = _bound_app(settings, engine, host, port, tenants, sock)
        except BadSettings as exc:   # the KV-event publisher's port was taken
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

