"""The matrix's paths: one zoo model through each way KVBridge can restore it, with the restore oracle.

Place in the flow: matrix.py picks (architecture, path) -> **run_path** -> the path's steps (cold
answers, a store, warm answers after the context was first filled with something else) -> the
Oracle's verdict (matrix_oracle.py).

- in-process: CachedEngine on llama.cpp in this process; a restore from L1, then from L2 after a
  restart that drops L1, then in a new engine over the same L2 directory (as a new process would);
- cache-server: the store is a real cache server (ZMQ on loopback, served from a thread), a second
  engine restores from it;
- l3: Debian's redis-server as L3; one engine stores, another with its own empty L2 restores from L3;
- llama-server: the llama-server KVBridge builds, its slot files in a private directory (started with
  --swa-full for a sliding-window model, as the backend does);
- scheduler: kvbridge.scheduler as it is today: a warm answer from the resident prefix and from the
  store in a new scheduler, against its own first (cold) answer; or its refusal.
Every path's store lives under the run's work directory; nothing is left running after a row.
"""
from __future__ import annotations

import dataclasses
import shutil
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from kvbridge.errors import KVBridgeError
from kvbridge.models.matrix_oracle import DOCUMENT, FILLER, FOLLOW_UP, QUESTION, Oracle, Row
from kvbridge.settings import Settings

PATHS = ("in-process", "cache-server", "l3", "llama-server", "scheduler")
# test: small chunks and a prompt of several sliding windows (n_swa 32); bench: the speed figures' 2k tokens
CHUNK_SIZE = {"test": 32, "bench": 256}
DOC_REPEATS = {"test": 6, "bench": 55}   # bench: 2,046 tokens of SmolLM2's tokenizer


def prompt_of(size: str) -> str:
    return DOCUMENT * DOC_REPEATS[size] + QUESTION


def base_settings(model: Path, workdir: Path, size: str, **changes) -> Settings:
    """Defaults only (no .env, no environment), a private L2 under workdir, the size's chunk."""
    base = dict(model_path=str(model), ctx_size=2048 if size == "test" else 4096, chunk_size=CHUNK_SIZE[size],
                n_predict=16, l2_dir=str(workdir / "l2"), output_dir=str(workdir / "output"),
                input_dir=str(workdir / "input"), llama_start_timeout=120.0)
    base.update(changes)
    return dataclasses.replace(Settings(), **base)


def in_process_engine(settings: Settings):
    from kvbridge.backends.llamacpp import LlamaCppBackend
    from kvbridge.engine.cached_engine import CachedEngine

    return CachedEngine(settings, LlamaCppBackend(settings))


def engine_of(kind: str, settings: Settings):
    from kvbridge.backends import make_backend
    from kvbridge.engine.cached_engine import CachedEngine

    return CachedEngine(settings, make_backend(kind, settings))


def warm_steps(engine, oracle: Oracle, prompt: str, tag: str = "") -> bool:
    """Cold answers to the prompt and its follow-up, a store, then restores after a filler: the prompt
    itself and the follow-up (a restore of the prompt's chunks as a prefix)."""
    follow = prompt + FOLLOW_UP
    if engine.kv_refusal:
        oracle.row.refuse(engine.kv_refusal)
        return False
    if not (oracle.set_cold(prompt, engine.infer(prompt, mode="cold"))
            and oracle.set_cold(follow, engine.infer(follow, mode="cold"))):
        return False
    engine.infer(FILLER, mode="lmcache")
    stored = engine.infer(prompt, mode="lmcache")
    if stored.error:
        oracle.row.refuse(f"storing failed: {stored.error}")
        return False
    engine.infer(FILLER, mode="lmcache")
    oracle.check(f"restore{tag}", prompt, engine.infer(prompt, mode="lmcache"))
    engine.infer(FILLER, mode="lmcache")
    oracle.check(f"prefix restore{tag}", follow, engine.infer(follow, mode="lmcache"))
    return True


def native_text(engine) -> Callable[[str], str]:
    """What llama.cpp's own reuse answers: the prompt once more with its cells still in the context."""
    def native(prompt: str) -> str:
        engine.infer(prompt, mode="cold")
        return engine.infer(prompt, mode="native").text
    return native


def run_in_process(row: Row, model: Path, workdir: Path, size: str) -> Row:
    settings = base_settings(model, workdir, size)
    prompt = prompt_of(size)
    oracle = Oracle(row)
    with in_process_engine(settings) as engine:
        if not warm_steps(engine, oracle, prompt):
            return row
        engine.restart_backend(drop_l1=True)
        engine.infer(FILLER, mode="cold")
        oracle.check("after restart (L2)", prompt, engine.infer(prompt, mode="lmcache"))
        native = native_text(engine)
        if not all(s.equal for s in row.steps):
            return oracle.decide(native)
    with in_process_engine(settings) as fresh:   # a new engine over the same L2: a new process's view
        fresh.infer(FILLER, mode="lmcache")
        oracle.check("fresh engine (L2)", prompt, fresh.infer(prompt, mode="lmcache"))
        return oracle.decide(native_text(fresh))


def run_cache_server(row: Row, model: Path, workdir: Path, size: str) -> Row:
    from kvbridge.cache_server.server import CacheServer

    server_settings = base_settings(model, workdir, size, l2_dir=str(workdir / "server-l2"), l1_bytes=256 << 20,
                                    cache_server_page_bytes=256 << 10, cache_server_timeout=10.0)
    server = CacheServer(server_settings, url=f"tcp://127.0.0.1:{free_port()}")
    server.bind()
    thread = threading.Thread(target=server.serve_forever, name="matrix-cache-server", daemon=True)
    thread.start()
    try:
        settings = base_settings(model, workdir, size, store_url=server.url, cache_server_timeout=10.0)
        prompt = prompt_of(size)
        oracle = Oracle(row)
        with in_process_engine(settings) as engine:
            if not warm_steps(engine, oracle, prompt, " (server)"):
                return row
        with in_process_engine(settings) as fresh:   # a new engine: only the server holds the chunks
            fresh.infer(FILLER, mode="cold")
            oracle.check("fresh engine (server)", prompt, fresh.infer(prompt, mode="lmcache"))
            return oracle.decide(native_text(fresh))
    finally:
        server.stop()
        thread.join(timeout=10)
        server.close()


def run_l3(row: Row, model: Path, workdir: Path, size: str) -> Row:
    binary = shutil.which("redis-server")
    if binary is None:
        return row.refuse("redis-server not found: ./scripts/setup.sh installs Debian's redis-server")
    prompt = prompt_of(size)
    with redis_server(binary, workdir / "redis") as url:
        host_a = base_settings(model, workdir, size, l2_dir=str(workdir / "l2-a"), l3_url=url, l3_timeout=5.0)
        host_b = dataclasses.replace(host_a, l2_dir=str(workdir / "l2-b"))
        with in_process_engine(host_a) as a:
            if a.kv_refusal:
                return row.refuse(a.kv_refusal)
            stored = a.infer(prompt, mode="lmcache")
            if stored.error:
                return row.refuse(f"storing failed: {stored.error}")
        # closing host A waited for its L3 writes; host B has an empty L1 and L2 of its own
        oracle = Oracle(row)
        with in_process_engine(host_b) as b:
            if not oracle.set_cold(prompt, b.infer(prompt, mode="cold")):
                return row
            b.infer(FILLER, mode="lmcache")
            oracle.check("other host (L3)", prompt, b.infer(prompt, mode="lmcache"))
            return oracle.decide(native_text(b))


def run_llama_server(row: Row, model: Path, workdir: Path, size: str) -> Row:
    settings = base_settings(model, workdir, size, engine="llama-server")
    prompt = prompt_of(size)
    oracle = Oracle(row)
    try:
        with engine_of("llama-server", settings) as engine:
            if not warm_steps(engine, oracle, prompt):
                return row
            if not all(s.equal for s in row.steps):
                return oracle.decide(native_text(engine))
        with engine_of("llama-server", settings) as fresh:   # a new server: the chunks come from L2
            fresh.infer(FILLER, mode="cold")
            oracle.check("new server (L2)", prompt, fresh.infer(prompt, mode="lmcache"))
            return oracle.decide(native_text(fresh))
    except KVBridgeError as exc:
        return row.refuse(str(exc))


def run_scheduler(row: Row, model: Path, workdir: Path, size: str) -> Row:
    """The scheduler's own first answer is its cold one (the store is empty); a warm answer from its
    resident prefix, then from the store in a new scheduler that keeps no finished prompt resident."""
    from kvbridge.scheduler import Scheduler

    settings = base_settings(model, workdir, size, sched_kv_cells=4096 if size == "test" else 8192)
    prompt = prompt_of(size)
    oracle = Oracle(row)
    try:
        with Scheduler(settings) as scheduler:
            first = scheduler.submit(prompt).result(timeout=600)
            if not oracle.set_cold(prompt, first):
                return row
            scheduler.submit(FILLER).result(timeout=600)
            oracle.check("resident prefix", prompt, scheduler.submit(prompt).result(timeout=600))
            scheduler.drain(600)
        with Scheduler(dataclasses.replace(settings, sched_cached_prefixes=0)) as fresh:
            fresh.submit(FILLER).result(timeout=600)
            oracle.check("new scheduler (store)", prompt, fresh.submit(prompt).result(timeout=600))
            return oracle.decide()
    except KVBridgeError as exc:
        return row.refuse(str(exc))


RUNNERS: dict[str, Callable[[Row, Path, Path, str], Row]] = {
    "in-process": run_in_process, "cache-server": run_cache_server, "l3": run_l3,
    "llama-server": run_llama_server, "scheduler": run_scheduler}


def run_path(arch: str, path: str, model: Path, workdir: Path, size: str) -> Row:
    """One row of the matrix; an engine error the path does not catch is the row's refusal, never a crash."""
    row = Row(arch=arch, path=path)
    started = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        RUNNERS[path](row, model, workdir, size)
    except KVBridgeError as exc:
        row.refuse(str(exc))
    row.seconds = time.perf_counter() - started
    return row


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def redis_server(binary: str, directory: Path):
    """A private redis-server on a free loopback port (nothing persisted); yields its URL."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                time.sleep(0.05)
        else:
            raise KVBridgeError(f"redis-server did not answer on port {port} within 15 s")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
