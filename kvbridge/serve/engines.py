"""What `serve` runs requests on: the in-process scheduler (many at once, with priorities and
preemption) or CachedEngine over llama-server in lmcache mode (one at a time, queued).

Both hand back a `Job`: the text pieces as they are generated and then the RequestRecord, delivered
into the event loop that waits for them (the engines run on their own threads), and a cancel that
frees what the request holds. The shadow engines (Ollama, hosted providers) hold no KV of ours to
serve from and are refused.

The event loop never calls into an engine itself: the scheduler holds its lock across store I/O and
multi-MB copies (a swap-out), so one such call there would stall every stream and /health. The app
submits on a worker thread, `Job.cancel` hands the cancel to one, and `LiveState` reads the state
for /health and /metrics on one, answering the last state read when the engine is busy.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from kvbridge.engine.records import RequestRecord
from kvbridge.errors import BadSettings, KVBridgeError
from kvbridge.serve.protocol import ApiError, Generation
from kvbridge.settings import Settings
from kvbridge.settings.checks import SERVE_ENGINES

log = logging.getLogger(__name__)
RETRY_AFTER_S = 2


class Job:
    """One request's events, read by the HTTP side: ("text", piece) ... then ("done", record) or
    ("error", exception). Producers call from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._events: asyncio.Queue = asyncio.Queue()
        self.future: Future | None = None
        self._cancel = None

    def push(self, kind: str, value) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))
        except RuntimeError:   # the loop is gone (the server stopped): nobody is listening
            pass

    async def next_event(self) -> tuple[str, object]:
        return await self._events.get()

    def follow(self, future: Future) -> None:
        """Push the future's outcome as the last event."""
        self.future = future

        def done(f: Future) -> None:
            if f.cancelled():
                self.push("error", ApiError(499, "the request was cancelled", code="cancelled"))
            elif f.exception() is not None:
                self.push("error", f.exception())
            else:
                self.push("done", f.result())

        future.add_done_callback(done)

    def cancel(self) -> None:
        """Cancel on a thread of its own (the engine's cancel may wait for its lock); never blocks the caller."""
        if self._cancel is not None and self.future is not None and not self.future.done():
            threading.Thread(target=self._cancel, args=(self.future,), name="kvbridge-serve-cancel",
                             daemon=True).start()


async def client_gone(request) -> None:
    """Returns when the client disconnects (its body is read: all that can arrive now is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def next_event(job: Job, gone: asyncio.Future):
    """The job's next event, or None when the client disconnected first (the job is then cancelled)."""
    waiter = asyncio.ensure_future(job.next_event())
    done, _ = await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
    if waiter in done:
        return waiter.result()
    waiter.cancel()
    job.cancel()
    return None


class LiveState:
    """`engine.state()` for /health and /metrics without the event loop waiting on the engine: read on a
    worker thread, one read at a time; a read not back within `wait_s` answers the last state read
    (the numbers are then `age_s` old), so /health answers while a swap holds the scheduler's lock."""

    def __init__(self, engine: "ServeEngine", wait_s: float = 0.5) -> None:
        self._engine, self._wait_s = engine, wait_s
        self._last: tuple[dict[str, int], float | None] = ({}, None)   # (state, time.monotonic() it was read)
        self._reading: asyncio.Future | None = None
        self.held: dict[str, dict[str, int]] | None = None   # engine.bytes_held() at the last read

    async def read(self) -> tuple[dict[str, int], float | None]:
        """(state, age_s): age 0 when read now, None when the engine has not answered yet ({} then)."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.get_running_loop().run_in_executor(None, self._read_now)
        done, _ = await asyncio.wait({self._reading}, timeout=self._wait_s)
        if done:
            self._reading.result()   # an engine error is the caller's, not a stale answer
            return self._last[0], 0.0
        state, read_at = self._last
        return state, None if read_at is None else round(time.monotonic() - read_at, 3)

    def _read_now(self) -> None:
        self.held = self._engine.bytes_held()
        self._last = (self._engine.state(), time.monotonic())


class ServeEngine:
    """The base: a model id, submit, live state for /metrics and the lab, close."""

    name = ""
    kv_events = None   # kvbridge.kv_events' running publisher (.endpoint, .replay_endpoint), once join_fleet started it

    def __init__(self, settings: Settings) -> None:
        from kvbridge.backends.llama_cpp_model import model_path_for

        self.settings = settings
        self.model_path: Path = model_path_for(settings)
        # -a/--alias (KVB_SERVE_MODEL_ALIAS): the first of its names, as llama-server shows its first alias
        self.model_aliases = [name.strip() for name in settings.serve_model_alias.split(",") if name.strip()]
        self.model_id = self.model_aliases[0] if self.model_aliases else self.model_path.stem

    def submit(self, gen: Generation, priority: int, job: Job, store_before_answer: bool = False) -> None:
        """Start the request; `store_before_answer` (a PD prefill leg, kvbridge.serve.pd): its answer comes only
        once its prompt's KV is in the store."""
        raise NotImplementedError

    def tokens_of(self, gen: Generation) -> list[int]:
        """The token ids this request prefills (its prompt as the engine renders and tokenizes it): what a
        router's render call is answered with."""
        raise NotImplementedError

    def join_fleet(self, instance_id: str) -> None:
        """Called once serve knows its instance id (its port bound), before the ready line: start what a
        fleet worker publishes (KV events, when KVB_KV_EVENTS_URL is set)."""

    def state(self) -> dict[str, int]:
        return {}

    def exact_mode(self) -> dict[str, object]:
        """{"exact": on or off, "exact_off_reason": why off ("" when on), "exact_cut": where its restores end} for
        /health and /get_server_info; {}
        for an engine without the mode (llama-server's queue runs one request at a time)."""
        return {}

    def bytes_held(self) -> dict[str, dict[str, int]] | None:
        """{cache salt: {tier: bytes}} of KV stored per salt; None when the engine cannot tell."""
        return None

    def close(self) -> None:
        pass


class SchedulerEngine(ServeEngine):
    """kvbridge.scheduler: continuous batching, shared prefixes, priority preemption with swap."""

    name = "scheduler"

    def __init__(self, settings: Settings, scheduler=None) -> None:
        super().__init__(settings)
        from kvbridge.scheduler import Scheduler

        self.scheduler = scheduler if scheduler is not None else Scheduler(settings)
        self._own = scheduler is None
        # One submit at a time: Scheduler.submit counts the waiting queue, tokenizes, then appends, so
        # submits racing on worker threads would all pass the KVB_SCHED_MAX_WAITING check.
        self._submitting = threading.Lock()

    def submit(self, gen: Generation, priority: int, job: Job, store_before_answer: bool = False) -> None:
        from kvbridge.scheduler import QueueFull

        try:
            with self._submitting:
                future = self.scheduler.submit(gen.prompt, priority=priority, n_predict=gen.max_tokens,
                                               temperature=gen.temperature, top_p=gen.top_p, seed=gen.seed,
                                               stop=gen.stop, on_token=lambda piece: job.push("text", piece),
                                               label=f"serve {gen.kind} ({gen.tenant})", cache_salt=gen.cache_salt,
                                               blend=gen.blend, min_tokens=gen.min_tokens, ignore_eos=gen.ignore_eos,
                                               store_before_answer=store_before_answer)
        except QueueFull as exc:
            raise ApiError(429, str(exc), code="queue_full", kind="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        job._cancel = self.scheduler.cancel
        job.follow(future)

    def tokens_of(self, gen: Generation) -> list[int]:
        return self.scheduler.tokens_of(gen.prompt)

    def join_fleet(self, instance_id: str) -> None:
        if self.settings.kv_events_url and self.kv_events is None:
            from kvbridge.kv_events import start_kv_events   # here: a serve without a publisher never loads zmq

            try:
                self.kv_events = start_kv_events(self.settings, self.scheduler, instance_id)
            except ValueError as exc:   # the publisher's URL cannot be bound (its message names KVB_KV_EVENTS_URL)
                raise BadSettings(str(exc)) from None

    def state(self) -> dict[str, int]:
        snapshot = self.scheduler.snapshot()
        return {"running": len(snapshot["running"]), "waiting": len(snapshot["waiting"]),
                "swapped": len(snapshot["swapped"]), "free_blocks": snapshot["blocks"]["free"],
                "total_blocks": snapshot["blocks"]["total"], "preemptions": snapshot["counters"]["preemptions"],
                "exact": int(self.scheduler.exact)}

    def exact_mode(self) -> dict[str, object]:
        return {"exact": self.scheduler.exact, "exact_off_reason": self.scheduler.exact_off_reason,
                "exact_cut": self.scheduler.cut_rule.describe() if self.scheduler.exact else ""}

    def bytes_held(self) -> dict[str, dict[str, int]] | None:
        return self.scheduler.bytes_held()

    def close(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self._own:
            self.scheduler.close()


class LlamaServerEngine(ServeEngine):
    """CachedEngine in lmcache mode over llama-server: one request at a time, the rest queued
    (KVB_SCHED_MAX_WAITING of them); priority does not reorder them."""

    name = "llama-server"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        from kvbridge.backends.registry import make_backend
        from kvbridge.engine.cached_engine import CachedEngine

        self.engine = CachedEngine(settings, make_backend("llama-server", settings))
        self.engine.start()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbridge-serve")
        self._lock = threading.Lock()
        self._queued = 0

    def submit(self, gen: Generation, priority: int, job: Job, store_before_answer: bool = False) -> None:
        for refused, param, why in ((store_before_answer, "kv_transfer_params", "a PD prefill leg (or KVB_SERVE_ROLE="
                                     "prefill) stores the prompt before answering"),
                                    (gen.min_tokens > 1, "min_tokens", "min_tokens above 1"),
                                    (gen.ignore_eos, "ignore_eos", "ignore_eos")):
            if refused:
                raise ApiError(400, f"'{param}': {why} needs the scheduler engine (KVB_SERVE_ENGINE=scheduler); "
                                    "llama-server decides where its own generation ends", param=param,
                               code="unsupported_parameter")
        if gen.cache_salt:
            raise ApiError(400, "'cache_salt' (and tenants, KVB_SERVE_TENANTS_FILE) need the scheduler engine "
                                "(KVB_SERVE_ENGINE=scheduler): llama-server's own cache would share KV across them",
                           param="cache_salt")
        if gen.blend:
            raise ApiError(400, "X-KVBridge-Blend: on needs the scheduler engine (KVB_SERVE_ENGINE=scheduler): "
                                "blend mode runs on llama.cpp in-process", param="X-KVBridge-Blend")
        if gen.top_p != 1.0:
            raise ApiError(400, "'top_p' is not supported with the llama-server engine (KVB_SERVE_ENGINE); "
                                "use the scheduler engine or leave top_p at 1", param="top_p")
        with self._lock:
            if self._queued >= self.settings.sched_max_waiting:
                raise ApiError(429, f"{self._queued} requests are queued already (KVB_SCHED_MAX_WAITING="
                                    f"{self.settings.sched_max_waiting}); try again shortly", code="queue_full",
                               kind="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})
            self._queued += 1
        future = self._pool.submit(self._run, gen, job)
        future.add_done_callback(lambda _: self._release())
        job._cancel = lambda f: f.cancel()    # a queued request leaves the queue; a running one finishes
        job.follow(future)

    def tokens_of(self, gen: Generation) -> list[int]:
        return list(self.engine.prepare(gen.prompt).tokens)   # llama-server's own template and tokenizer

    def _release(self) -> None:
        with self._lock:
            self._queued -= 1

    def _run(self, gen: Generation, job: Job) -> RequestRecord:
        stopper = _StopCutter(gen.stop, lambda piece: job.push("text", piece))
        record = self.engine.infer(gen.prompt, mode="lmcache", n_predict=gen.max_tokens,
                                   temperature=gen.temperature, label="serve", on_text=stopper.feed)
        if record.error:
            raise KVBridgeError(record.error)
        record.text = stopper.finish(record.text)
        return record

    def state(self) -> dict[str, int]:
        with self._lock:
            return {"running": min(1, self._queued), "waiting": max(0, self._queued - 1)}

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.engine.stop()


class _StopCutter:
    """Stop strings for an engine that cannot stop itself: text after the first stop string is
    neither streamed nor returned (what could still become a stop string is held back)."""

    def __init__(self, stop: tuple[str, ...], emit) -> None:
        self.stop, self.emit = stop, emit
        self.text, self.sent, self.stopped = "", 0, False

    def feed(self, piece: str) -> None:
        if self.stopped:
            return
        self.text += piece
        cut = self._cut()
        if cut is not None:
            self.stopped = True
            self._send(cut)
            return
        hold = max((len(s) - 1 for s in self.stop), default=0)
        self._send(max(self.sent, len(self.text) - hold))

    def finish(self, text: str) -> str:
        self.text = text
        cut = self._cut()
        end = cut if cut is not None else len(text)
        if not self.stopped:
            self._send(end)
        return text[:end]

    def _cut(self) -> int | None:
        found = [self.text.find(s) for s in self.stop if s in self.text]
        return min(found) if found else None

    def _send(self, upto: int) -> None:
        if upto > self.sent:
            self.emit(self.text[self.sent:upto])
            self.sent = upto


SERVE_ENGINE_CLASSES = {"scheduler": SchedulerEngine, "llama-server": LlamaServerEngine}   # keyed as SERVE_ENGINES


def make_serve_engine(settings: Settings, engine: str | None = None) -> ServeEngine:
    """The engine `serve` runs on: KVB_SERVE_ENGINE (or --engine), checked before anything loads."""
    key = engine or settings.serve_engine
    if key not in SERVE_ENGINES:
        raise BadSettings(f"serve cannot run on the engine {key!r} (--engine / KVB_SERVE_ENGINE); use "
                          f"{' or '.join(SERVE_ENGINES)}: serve answers from KV that KVBridge holds, which the shadow "
                          "engines (Ollama, the cloud providers) keep out of its reach")
    return SERVE_ENGINE_CLASSES[key](settings)
