"""`Fleet`: N `serve` workers on loopback behind vllm-router, sharing one cache server.

Start order: what a SIGKILLed fleet left is cleaned (kvbridge.fleet.record), then the cache server
(unless KVB_STORE_URL names one already, or shared_cache is off), the workers (each `python -m kvbridge
serve --port 0`, its bound URL read from its ready line; under kv_aware each publishes KV events on an
ipc socket in a folder of mode 0700), then the router, which is ready once the listener on its port is
the router's own socket, its /health answers and its /list_workers names every worker. Stop order is
the reverse: router, workers, cache server; then what a killed cache server left, the socket folder and
the record go.

Each start makes a fresh router key: the workers accept it on their state routes, render and /tokenize
(KVB_SERVE_ROUTER_KEY_ENV names the variable that holds it) and the router sends it there; it reaches
both through the environment only. Each child logs to its own file under KVB_OUTPUT_DIR/fleet/; a child
that exits while the fleet starts fails start() with the last lines of its log, and start() stops
everything it started.
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvbridge.errors import BadSettings
from kvbridge.fleet.children import Child, free_port, owns_listener, port_is_free, spawn_held, stop_all
from kvbridge.fleet.record import RECORD_NAME, SOCKET_DIR_PREFIX, FleetRecord, clean_after_dead_fleets
from kvbridge.fleet.router import PINNED as PINNED_NAME
from kvbridge.fleet.router import (PD_BLOCK_SIZE, ROUTER_KEY_VAR, get_json, lists_workers, router_argv,
                                   router_binary, router_command)
from kvbridge.settings import Settings
from kvbridge.settings.checks import FLEET_POLICIES
from kvbridge.settings.core import settings_to_env

START_TIMEOUT_S = 600.0        # a worker loads its model on a busy machine
ROUTER_TIMEOUT_S = 120.0
ROUTER_STOP_S = 10.0           # SIGTERM to SIGKILL, the router
CACHE_SERVER_STOP_S = 60.0     # SIGTERM to SIGKILL, the cache server (it flushes L1 to L2 first)
SERVE_READY = r"KVBridge serve ready on (http://\S+)"
ROUTER_KEY_SETTING = "KVB_SERVE_ROUTER_KEY_ENV"
CACHE_SERVER_READY = r"cache server ready on (\S+)"


CUT_PROBE_TIMEOUT_S = 900.0   # about a minute a model on 2 quiet cores, several on a busy one


def prove_cut(settings: Settings) -> str:
    """Prove exact mode's cut for the workers' own settings once (`kvbridge cut-probe --save --if-missing` with
    them), so that their restores end where the probe proved and not on the fixed grid of 32: a PD decode leg
    otherwise computes 32 or more of the tokens the prefill leg stored (Docs/Research.md §34). setup.sh proves
    the default thread count only, and a fleet often gives each worker fewer threads. Runs in a child process
    (the fleet's own process loads no llama.cpp); the probe's last line, or why it failed."""
    from kvbridge.scheduler.exact import off_reason

    if off_reason(settings):
        return f"no cut probe: exact mode is off ({off_reason(settings)})"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVB_")}
    env.update(settings_to_env(settings))
    try:
        done = subprocess.run([sys.executable, "-m", "kvbridge.models.cut_probe", "--save", "--if-missing"], env=env,
                              capture_output=True, text=True, timeout=CUT_PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"the cut probe did not finish within {CUT_PROBE_TIMEOUT_S:.0f} s: restores use the fixed grid"
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    return last if done.returncode == 0 else f"the cut probe failed (status {done.returncode}): {last}"


@dataclass(frozen=True)
class Worker:
    """One serve instance of the fleet."""
    name: str                  # worker-1, worker-2, ... (its X-KVBridge-Instance)
    url: str                   # http://127.0.0.1:PORT, read from its ready line
    pid: int
    role: str                  # both, prefill or decode
    events_url: str            # where it publishes KV events ('' unless kv_aware)

    @property
    def instance_id(self) -> str:
        return self.name


class Fleet:
    """Start with .start() (or `with Fleet(...) as fleet:`), send requests to .url, stop with .stop()."""

    def __init__(self, settings: Settings, workers: int = 3, policy: str = "kv_aware", port: int = 0,
                 shared_cache: bool = True, pd: bool = False, env: dict | None = None,
                 router_log_level: str = "info") -> None:
        if policy not in FLEET_POLICIES:
            raise BadSettings(f"--policy / KVB_FLEET_POLICY {policy!r} is not a policy the fleet runs; "
                              f"use {', '.join(FLEET_POLICIES)}")
        if not 1 <= workers <= 64:
            raise BadSettings(f"--workers / KVB_FLEET_WORKERS={workers} must be from 1 to 64")
        if pd and workers < 2:
            raise BadSettings(f"--pd needs at least 2 workers (one prefill, the rest decode); "
                              f"--workers / KVB_FLEET_WORKERS is {workers}")
        if pd and not (shared_cache or settings.store_url or settings.l3_url):
            raise BadSettings("--pd hands the KV over through a shared cache: drop --no-shared-cache, "
                              "or set KVB_STORE_URL or KVB_L3_URL")
        if pd and (settings.serve_tenants_file or settings.serve_api_key_env):
            raise BadSettings("--pd cannot run with KVB_SERVE_TENANTS_FILE or KVB_SERVE_API_KEY_ENV: vllm-router "
                              f"({PINNED_NAME}) sends both legs of a PD request with an empty bearer instead of the "
                              "client's, so the workers could not tell tenants apart (or any client from none); "
                              "run the fleet without --pd, where the router forwards each client's own key")
        if pd and policy == "kv_aware" and settings.chunk_size != PD_BLOCK_SIZE:
            raise BadSettings(f"--pd with --policy kv_aware needs KVB_CHUNK_SIZE={PD_BLOCK_SIZE} (vllm-router reads "
                              f"PD KV events in {PD_BLOCK_SIZE}-token blocks; it is {settings.chunk_size}): "
                              "set it, or use --policy round_robin or cache_aware")
        if port and not port_is_free(port):
            raise BadSettings(f"the router's port 127.0.0.1:{port} is in use: choose another with --port / "
                              "KVB_FLEET_PORT (0: any free port)")
        self.settings = settings
        self.n_workers = workers
        self.policy = policy
        self.port = port or free_port()
        self.shared_cache = shared_cache
        self.pd = pd
        self.router_log_level = router_log_level
        self._base_env = dict(os.environ if env is None else env)
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers: list[Worker] = []
        self.store_url = settings.store_url if shared_cache else ""   # off: each worker its own embedded store
        self.log_root = Path(settings.output_dir).expanduser() / "fleet"
        self.log_dir: Path | None = None     # a folder of its own per start, named by time (start() makes it)
        self.socket_dir: Path | None = None  # the workers' KV-event sockets, mode 0700 (start() makes it)
        self._router_key = ""                # fresh per start; never printed, never on a command line
        self._record: FleetRecord | None = None
        self._cache_server: Child | None = None
        self._worker_children: list[Child] = []
        self._router: Child | None = None
        self._started: list[Child] = []      # every child, in start order, recorded as it starts

    # --- start ---------------------------------------------------------------------------------------

    def start(self) -> "Fleet":
        """Start everything; returns once the router answers. On any failure, stops what it started."""
        binary = router_binary()          # before anything starts: a missing router is a setup problem
        self.log_root.mkdir(parents=True, exist_ok=True)
        for line in clean_after_dead_fleets(self.log_root):
            print(f"fleet: cleaned what a stopped fleet left: {line}", flush=True)
        self.log_dir = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=self.log_root))
        self._router_key = secrets.token_urlsafe(32)
        print(f"fleet logs: {self.log_dir}/ (cache-server.log, worker-N.log, router.log)", flush=True)
        try:
            # short (an ipc path must fit in 107 bytes) and private: mkdtemp makes it 0700, so no other
            # account can reach a socket inside
            self.socket_dir = Path(tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX))
            self._record = FleetRecord(self.log_dir / RECORD_NAME, self.socket_dir)
            self._start_cache_server()
            self._start_workers()
            self._start_router(binary)
        except BaseException:
            self.stop()
            raise
        print(f"KVBridge fleet ready on {self.url} ({self.n_workers} workers, policy {self.policy}"
              f"{', prefill/decode' if self.pd else ''})", flush=True)
        return self

    def _spawn(self, name: str, argv: list[str], env: dict, log_name: str, hint: str) -> Child:
        """Start a child and record it before any stop signal is taken (children.spawn_held)."""
        with spawn_held():
            child = Child(name, argv, env, self.log_dir / log_name, hint)
            self._started.append(child)
            if self._record is not None:
                self._record.add(child)
        return child

    def _env(self, **extra: str) -> dict:
        env = {k: v for k, v in self._base_env.items() if not k.startswith("KVB_") and k != ROUTER_KEY_VAR}
        env.update(settings_to_env(self.settings))
        env.update(extra)
        project = str(Path(__file__).resolve().parents[2])   # where `python -m kvbridge` finds this package
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [project, env.get("PYTHONPATH", "")]))
        return env

    def _start_cache_server(self) -> None:
        if not self.shared_cache or self.settings.store_url:
            return      # none asked for, or the workers use the one KVB_STORE_URL names
        url = f"tcp://127.0.0.1:{free_port()}"
        self.store_url = url        # before it starts: what a killed server leaves is found by its URL
        self._record.set_store_url(url)
        argv = [sys.executable, "-m", "kvbridge", "cache-server", "--url", url]
        self._cache_server = self._spawn("cache server", argv, self._env(), "cache-server.log",
                                         "its pool is KVB_L1_BYTES, its L2 KVB_L2_DIR; --no-shared-cache runs "
                                         "without it")
        self._cache_server.wait_for_line(CACHE_SERVER_READY, START_TIMEOUT_S)

    def _roles(self) -> list[str]:
        if not self.pd:
            return ["both"] * self.n_workers
        return ["prefill"] + ["decode"] * (self.n_workers - 1)

    def _start_workers(self) -> None:
        started = []
        for i, role in enumerate(self._roles(), start=1):
            name = f"worker-{i}"
            publishes = self.policy == "kv_aware" and role != "decode"    # PD: the router reads the prefill's only
            events_url = f"ipc://{self.socket_dir}/{name}.events" if publishes else ""
            env = self._env(KVB_SERVE_INSTANCE_ID=name, KVB_SERVE_ROLE=role, KVB_KV_EVENTS_URL=events_url,
                            KVB_STORE_URL=self.store_url, **self._router_key_env())
            child = self._spawn(name, [sys.executable, "-m", "kvbridge", "serve", "--host", "127.0.0.1", "--port", "0"],
                                env, f"{name}.log",
                                "it runs `kvbridge serve` with these settings: KVB_MODEL_PATH, KVB_CTX_SIZE, "
                                "KVB_SCHED_KV_CELLS, KVB_SERVE_ENGINE")
            self._worker_children.append(child)
            started.append((child, role, events_url))
        for child, role, events_url in started:    # they load their models at the same time
            url = child.wait_for_line(SERVE_READY, START_TIMEOUT_S).group(1)
            self.workers.append(Worker(child.name, url, child.pid, role, events_url))

    def _router_key_env(self) -> dict:
        """A worker's: the router key in ROUTER_KEY_VAR, and KVB_SERVE_ROUTER_KEY_ENV naming that variable."""
        return {ROUTER_KEY_SETTING: ROUTER_KEY_VAR, ROUTER_KEY_VAR: self._router_key}

    def _start_router(self, binary: Path) -> None:
        args = router_argv(self.port, free_port(), self.policy, self.workers, pd=self.pd,
                           log_level=self.router_log_level)
        argv, key_env = router_command(binary, args, self._router_key)
        self._router = self._spawn("router", argv, {**self._env(), **key_env}, "router.log",
                                   f"vllm-router on --port / KVB_FLEET_PORT {self.port}, --policy {self.policy}")
        deadline = time.monotonic() + ROUTER_TIMEOUT_S
        while not self._router_ready():
            self._router.check_running()
            for child in self._worker_children:
                child.check_running()
            if time.monotonic() > deadline:
                raise self._router.failure(f"did not answer {self.url}/health and list every worker within "
                                           f"{ROUTER_TIMEOUT_S:.0f} s")
            time.sleep(0.3)

    def _router_ready(self) -> bool:
        """The router's own listener answers /health and lists every worker: an answer on the port from any
        other process (one that took the port free_port() chose first) proves nothing."""
        if not owns_listener(self._router.pid, self.port):
            return False
        return get_json(f"{self.url}/health") is not None and lists_workers(self.url, [w.url for w in self.workers])

    # --- while running ---------------------------------------------------------------------------------

    def exited(self) -> list[str]:
        """Children that have exited since start: 'name (status N, log PATH)' each."""
        return [f"{child.name} (status {child.proc.returncode}, log {child.log_path})"
                for child in self._children() if not child.alive()]

    def _children(self) -> list[Child]:
        return [c for c in (self._router, *self._worker_children, self._cache_server) if c is not None]

    # --- stop ------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Router first, then the workers (they drain), then the cache server (it flushes L1 to L2);
        SIGKILL whatever outlives its bound; then what a killed cache server left, the socket folder and
        the record. Safe to call twice."""
        killed = []
        if self._router is not None:
            killed += stop_all([self._router], ROUTER_STOP_S)
        killed += stop_all(self._worker_children, self.settings.serve_drain_timeout + 30)
        named = {id(c) for c in (self._router, self._cache_server, *self._worker_children)}
        killed += stop_all([c for c in self._started if id(c) not in named], ROUTER_STOP_S)   # started, unnamed
        if self._cache_server is not None:
            killed += stop_all([self._cache_server], CACHE_SERVER_STOP_S)
        if self._started_cache_server():
            self._forget_cache_server_files()
        if killed:
            print(f"fleet: killed {', '.join(killed)} after SIGTERM's bound", file=sys.stderr, flush=True)
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
        if self._record is not None and not any(child.alive() for child in self._started):
            self._record.remove()

    def _started_cache_server(self) -> bool:
        return self._record is not None and bool(self._record.data["store_url"])

    def _forget_cache_server_files(self) -> None:
        """What a killed cache server leaves: token and key files, its /dev/shm segment (a clean stop removes
        them itself; nothing is removed while the server still runs)."""
        from kvbridge.cache_server.leftovers import forget_server_files

        forget_server_files(self.store_url)

    def __enter__(self) -> "Fleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def describe(self) -> list[str]:
        """One line per child: what it is, its URL and pid."""
        lines = [f"worker {w.name}: {w.url} (pid {w.pid}, role {w.role}"
                 f"{', KV events ' + w.events_url if w.events_url else ''})" for w in self.workers]
        if self._cache_server is not None:
            lines.insert(0, f"cache server: {self.store_url} (pid {self._cache_server.pid})")
        from kvbridge.scheduler.exact import off_reason   # here: the fleet's own process loads no llama.cpp

        off = off_reason(self.settings)   # a worker's own log says it again, with what its model adds
        lines.append("exact mode: on in every worker (answers equal cold runs; --no-exact turns it off)" if not off
                     else f"exact mode: off: {off}")
        if self._router is not None:   # the last line: who waits for the fleet's lines waits for this one
            lines.append(f"router: {self.url} (pid {self._router.pid}, vllm-router --policy {self.policy})")
        return lines
