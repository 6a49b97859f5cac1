"""The scheduler against llama-server on the same workloads, in one run (issue 12, section 4).

Place in the flow: a Workload (kvbridge.bench.common.scheduler_workloads: chat requests, each with a
priority and an arrival time) runs on one engine, then on the other, never both at once:

- **ours**: kvbridge.scheduler.Scheduler with the workload's LabDefaults (KV cells, running
  sequences, watermarks), flash attention on (llama-server's `auto` on a CPU) and ctx_size = the whole budget (as a llama-server slot may use it all). A
  driver thread submits each request at its `at_s`. TTFT runs from that submission to the first
  piece of text streamed to `on_token`. KV cells used are sampled from `snapshot()["blocks"]` every
  ~50 ms (the live cells of every extent; a shared extent counts once).
- **llama-server**: the same GGUF, `-c <cells> -np <running> --kv-unified -t <threads>`, otherwise
  its defaults, so its RAM prompt cache (`--cache-ram`) and flash attention `auto` stay on.
  ServerProcess adds a private `--slot-save-path`, which is used only if a slot is saved, and none
  is. Each request is POSTed to /v1/chat/completions at its `at_s` on its own thread, streaming and
  greedy. TTFT runs to the first chunk carrying content. What it computed and what it reused come
  from the final chunk's `timings` (`prompt_n`, `cache_n`), and the generated tokens from its
  `usage`. KV cells used are the sum of the slots' `n_prompt_tokens` from GET /slots (on by
  default, so no `--metrics` is needed), polled every ~50 ms. Its slots share no cells, so the sum
  counts each cell once; a slot counts a token when it is put in a batch, so a batch that finds no
  room would count cells that never were, and the figure is capped at the budget. The server is
  stopped at the end, also on error.

Throughput is generated tokens of completed requests / the wall time of the whole workload (from
its start to the last request's end). Ratios are ours / llama-server; kvbridge.bench.scheduler_report
prints them. No target is judged here
(Docs/Research.md does that). Deliberately left out: warm-up passes and repeats (one pass per
engine; the real measurement is run on a quiet machine).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import requests

from kvbridge.backends.llama_server.api import LlamaServerError, sse_events
from kvbridge.backends.llama_server.process import (BUILD_SCRIPT, ServerProcess, built_binary, free_port,
                                                    pinned_llama_cpp_version)
from kvbridge.bench.common.scheduler_workloads import TimedRequest, Workload, priority_burst, shared_system_prompt
from kvbridge.errors import EngineUnavailable, KVBridgeError
from kvbridge.settings import Settings

POLL_S = 0.05           # how often KV cells used are sampled
RUN_TIMEOUT_S = 900.0   # the longest one engine may take for the whole workload
PARTS = ("swap", "burst", "shared")
OURS, THEIRS = "ours", "llama-server"
EXACT = "ours, exact"   # the scheduler again with KVB_SCHED_EXACT=1 (--exact): what the mode costs, side by side
NO_FA = "ours, flash attention off"   # --exact: the mode off on exact mode's kernels, to tell the two costs apart


@dataclass
class RequestResult:
    label: str
    priority: int
    urgent: bool
    submitted_s: float              # when it was sent, from the workload's start
    ttft_ms: float | None = None    # from its own submission to its first text
    total_ms: float | None = None
    prompt_tokens: int = 0
    computed_tokens: int = 0        # prompt tokens the engine prefilled for it
    reused_tokens: int = 0          # prompt tokens whose KV it found (shared, cached or restored)
    gen_tokens: int = 0
    preemptions: int = 0
    error: str = ""
    text: str = ""                  # ours: the answer (--exact checks it against the request's solo run)
    solo_equal: bool | None = None  # ours with --exact: the answer equals the same request run alone


@dataclass
class EngineRun:
    engine: str
    kv_cells: int                   # the KV budget as the engine reports it
    slots: int                      # sequences running at once
    threads: int
    wall_s: float = 0.0
    peak_cells: int = 0
    samples: int = 0                # cell samples taken
    failed_samples: int = 0         # polls that got no answer (llama-server busy or gone)
    requests: list[RequestResult] = field(default_factory=list)
    counters: dict = field(default_factory=dict)   # ours: the scheduler's snapshot()["counters"] at the end
    notes: list[str] = field(default_factory=list)


# -- ours -------------------------------------------------------------------------------------------
def scheduler_settings(workload: Workload, settings: Settings, exact: bool = False,
                       flash_attn: bool | None = None) -> Settings:
    d = workload.defaults
    # flash attention on, as llama-server's default `-fa auto` picks on a CPU (about 18% faster
    # prefill here): both engines run the same kernels. Exact mode needs it off (kvbridge.scheduler.exact)
    return settings.replace(sched_kv_cells=d.kv_cells, sched_max_running=d.max_running, sched_soft=d.soft,
                            sched_hard=d.hard, sched_critical=d.critical, ctx_size=d.kv_cells,
                            flash_attn=not exact if flash_attn is None else flash_attn, sched_exact=exact)


def run_scheduler(workload: Workload, settings: Settings, *, timeout_s: float = RUN_TIMEOUT_S,
                  exact: bool = False, flash_attn: bool | None = None) -> EngineRun:
    from kvbridge.scheduler import RequestRefused, Scheduler

    settings = scheduler_settings(workload, settings, exact, flash_attn)
    results = [_empty_result(r) for r in workload.requests]
    futures: list[Future | None] = [None] * len(results)
    first_text: list[float | None] = [None] * len(results)
    ended: list[float | None] = [None] * len(results)
    with Scheduler(settings) as scheduler:
        blocks = scheduler.snapshot()["blocks"]
        name = EXACT if exact else NO_FA if flash_attn is False else OURS
        run = EngineRun(name, blocks["total"] * blocks["block_tokens"],
                        settings.sched_max_running, settings.resolved_threads())
        start = time.perf_counter()

        def submit(i: int, timed: TimedRequest) -> None:
            def on_token(piece: str) -> None:
                if first_text[i] is None:
                    first_text[i] = time.perf_counter()

            sent = time.perf_counter()
            results[i].submitted_s = sent - start
            try:
                future = scheduler.submit(list(timed.messages), priority=timed.priority, n_predict=timed.n_predict,
                                          temperature=0.0, on_token=on_token, label=timed.label)
            except RequestRefused as exc:   # a full queue: counted as a failed request
                results[i].error, ended[i] = str(exc), time.perf_counter()
                return
            future.add_done_callback(lambda _: ended.__setitem__(i, time.perf_counter()))
            futures[i] = future

        driver = threading.Thread(target=_drive, args=(workload, start, submit), name="kvb-bench-driver", daemon=True)
        driver.start()
        deadline = start + timeout_s
        while time.perf_counter() < deadline and (driver.is_alive() or not all(
                f is None or f.done() for f in futures)):
            blocks = scheduler.snapshot()["blocks"]
            run.peak_cells = max(run.peak_cells, sum(e["cells"] for e in blocks["extents"]))
            run.samples += 1
            time.sleep(POLL_S)
        driver.join(timeout=max(0.0, deadline - time.perf_counter()))
        wait_futures([f for f in futures if f is not None], timeout=max(0.0, deadline - time.perf_counter()))
        for i, future in enumerate(futures):
            if future is None:
                if not results[i].error:
                    results[i].error = f"not submitted within {timeout_s:g} s"
                continue
            if not future.done():
                scheduler.cancel(future)
                results[i].error, ended[i] = f"did not finish within {timeout_s:g} s", time.perf_counter()
                continue
            try:
                record = future.result()
            except KVBridgeError as exc:
                results[i].error = str(exc)
                continue
            _fill_from_record(results[i], record, first_text[i], start)
        run.counters = scheduler.snapshot()["counters"]
    run.wall_s = max((t for t in ended if t is not None), default=start) - start
    run.requests = results
    return run


def _fill_from_record(result: RequestResult, record, first_text: float | None, start: float) -> None:
    sent = start + result.submitted_s
    # no text at all (the first token ended it): the scheduler's own TTFT, which starts after tokenizing
    result.ttft_ms = (first_text - sent) * 1e3 if first_text is not None else record.ttft_ms
    result.text = record.text
    result.total_ms = record.total_ms
    result.prompt_tokens = record.prompt_tokens
    result.computed_tokens = record.prefill_tokens
    result.reused_tokens = record.matched_tokens
    result.gen_tokens = record.gen_tokens
    result.preemptions = record.preemptions


# -- llama-server -------------------------------------------------------------------------------------
def llama_server_binary(settings: Settings) -> Path:
    """KVB_LLAMA_SERVER_BIN, else the binary scripts/build_llama_server.sh built."""
    binary = (Path(settings.llama_server_bin).expanduser() if settings.llama_server_bin
              else built_binary(pinned_llama_cpp_version()))
    if not binary.is_file():
        raise EngineUnavailable(f"llama-server binary {binary} does not exist; build it with ./{BUILD_SCRIPT} "
                                "(about 5 minutes on 2 cores) or point KVB_LLAMA_SERVER_BIN at one.")
    return binary


def llama_server_args(workload: Workload, settings: Settings) -> list[str]:
    from kvbridge.backends.llama_cpp_model import model_path_for

    d = workload.defaults
    return ["-m", str(model_path_for(settings)), "-c", str(d.kv_cells), "-np", str(d.max_running), "--kv-unified",
            "-t", str(settings.resolved_threads())]


def run_llama_server(workload: Workload, settings: Settings, *, timeout_s: float = RUN_TIMEOUT_S,
                     binary: Path | None = None) -> EngineRun:
    server = _start_server(binary or llama_server_binary(settings), llama_server_args(workload, settings),
                           settings.llama_start_timeout)
    try:
        return _run_on_server(workload, server, settings.resolved_threads(), timeout_s)
    finally:
        server.stop()


def _start_server(binary: Path, args: list[str], start_timeout_s: float) -> ServerProcess:
    for attempt in (1, 2):
        server = ServerProcess(binary, args, "127.0.0.1", free_port())
        server.start()
        try:
            server.wait_healthy(start_timeout_s)
            return server
        except EngineUnavailable as exc:
            # a free port can be taken between our probe and the server's bind: try another once
            if attempt == 2 or "KVB_LLAMA_SERVER_PORT" not in str(exc):
                raise
    raise AssertionError("unreachable")


def _run_on_server(workload: Workload, server: ServerProcess, threads: int, timeout_s: float) -> EngineRun:
    d = workload.defaults
    slots = _get_slots(server.url) or []
    run = EngineRun(THEIRS, int(slots[0]["n_ctx"]) if slots else d.kv_cells, d.max_running, threads)
    results = [_empty_result(r) for r in workload.requests]
    ended: list[float | None] = [None] * len(results)
    start = time.perf_counter()
    workers = []

    def send(i: int, timed: TimedRequest) -> None:
        _stream_chat(server.url, timed, results[i], start, timeout_s)
        ended[i] = time.perf_counter()

    for i, timed in enumerate(workload.requests):
        worker = threading.Thread(target=send, args=(i, timed), name=f"kvb-bench-{timed.label}", daemon=True)
        worker.start()
        workers.append(worker)
    deadline = start + timeout_s
    while time.perf_counter() < deadline and any(w.is_alive() for w in workers):
        slots = _get_slots(server.url)
        if slots is None:
            run.failed_samples += 1
        else:
            used = sum(int(s.get("n_prompt_tokens", 0)) for s in slots)
            run.peak_cells = max(run.peak_cells, min(used, run.kv_cells))
            run.samples += 1
        time.sleep(POLL_S)
    for worker in workers:
        worker.join(timeout=max(0.0, deadline - time.perf_counter()))
    for i, worker in enumerate(workers):
        if worker.is_alive():   # its socket closes when the server stops
            results[i].error, ended[i] = f"did not finish within {timeout_s:g} s", time.perf_counter()
    if any(r.error for r in results):
        run.notes.append("llama-server log, last lines:\n" + server.log_tail(20))
    run.wall_s = max((t for t in ended if t is not None), default=start) - start
    run.requests = results
    return run


def _get_slots(url: str) -> list[dict] | None:
    try:
        resp = requests.get(f"{url}/slots", timeout=5)
        return resp.json() if resp.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None


def _stream_chat(url: str, timed: TimedRequest, result: RequestResult, start: float, timeout_s: float) -> None:
    """One request at its arrival time; its figures (or its error) go into `result`."""
    _sleep_until(start + timed.at_s)
    sent = time.perf_counter()
    result.submitted_s = sent - start
    body = {"messages": list(timed.messages), "max_tokens": timed.n_predict, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    finish, usage, timings = None, {}, {}
    try:
        with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=(5, timeout_s)) as resp:
            if resp.status_code != 200:
                raise LlamaServerError("/v1/chat/completions", resp)
            for event in sse_events(resp):
                if "error" in event:
                    error = event["error"]
                    result.error = str(error.get("message", error) if isinstance(error, dict) else error)
                    return
                for choice in event.get("choices") or []:
                    if result.ttft_ms is None and (choice.get("delta") or {}).get("content"):
                        result.ttft_ms = (time.perf_counter() - sent) * 1e3
                    finish = choice.get("finish_reason") or finish
                usage = event.get("usage") or usage
                timings = event.get("timings") or timings
    except (requests.RequestException, KVBridgeError) as exc:
        result.error = str(exc)
        return
    result.total_ms = (time.perf_counter() - sent) * 1e3
    if finish is None:
        result.error = "the stream ended without a finish reason"
    result.computed_tokens = int(timings.get("prompt_n", 0))
    result.reused_tokens = int(timings.get("cache_n", 0))
    result.prompt_tokens = int(usage.get("prompt_tokens", result.computed_tokens + result.reused_tokens))
    result.gen_tokens = int(usage.get("completion_tokens", timings.get("predicted_n", 0)))


# -- shared helpers ---------------------------------------------------------------------------------
def _empty_result(timed: TimedRequest) -> RequestResult:
    return RequestResult(timed.label, timed.priority, timed.urgent, timed.at_s)


def _drive(workload: Workload, start: float, submit) -> None:
    """Call submit(i, request) for each request at its arrival time."""
    order = sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].at_s)
    for i in order:
        _sleep_until(start + workload.requests[i].at_s)
        submit(i, workload.requests[i])


def _sleep_until(when: float) -> None:
    time.sleep(max(0.0, when - time.perf_counter()))


def shared_prefix_tokens(workload: Workload, settings: Settings) -> int:
    """Tokens every prompt of the workload starts with (its shared system prompt as rendered), as
    our engines tokenize them."""
    from kvbridge.backends.gguf_vocab import GGUFVocab
    from kvbridge.backends.llama_cpp_model import model_path_for

    vocab = GGUFVocab(model_path_for(settings))
    prompts = [vocab.tokenize(vocab.render(list(r.messages))) for r in workload.requests]
    n = 0
    while all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


# -- the figures ------------------------------------------------------------------------------------
def common_figures(run: EngineRun) -> dict:
    done = [r for r in run.requests if not r.error]
    gen = sum(r.gen_tokens for r in done)
    return {"requests": len(run.requests), "completed": len(done), "gen_tokens": gen, "wall_s": run.wall_s,
            "throughput_tok_s": gen / run.wall_s if run.wall_s > 0 else None, "peak_cells": run.peak_cells,
            "kv_cells": run.kv_cells}


def burst_figures(run: EngineRun) -> dict:
    """Urgent TTFT (median, p95) of the urgent requests that completed, the low ones' for contrast."""
    def ttfts(urgent: bool) -> list[float]:
        return [r.ttft_ms for r in run.requests if r.urgent == urgent and not r.error and r.ttft_ms is not None]

    return {**common_figures(run), "urgent_ttft_median_ms": _percentile(ttfts(True), 50),
            "urgent_ttft_p95_ms": _percentile(ttfts(True), 95), "low_ttft_median_ms": _percentile(ttfts(False), 50),
            "preemptions": sum(r.preemptions for r in run.requests)}


def shared_figures(run: EngineRun, shared_tokens: int) -> dict:
    """How often the shared prompt was computed: requests that reused all of it, requests that computed
    at least its length, and its tokens computed over every completed request (ideal: shared_tokens)."""
    done = [r for r in run.requests if not r.error]
    return {**common_figures(run), "shared_tokens": shared_tokens,
            "reused_whole_shared": sum(r.reused_tokens >= shared_tokens for r in done),
            "computed_whole_shared": sum(r.computed_tokens >= shared_tokens for r in done),
            "shared_tokens_computed": sum(shared_tokens - min(shared_tokens, r.reused_tokens) for r in done)}


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def ratios(ours: dict, theirs: dict, names: tuple[str, ...]) -> dict:
    """ours / llama-server for each figure both have (None where either is missing or llama-server's is 0)."""
    out = {}
    for name in names:
        a, b = ours.get(name), theirs.get(name)
        out[name] = a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None
    return out


# -- the comparisons --------------------------------------------------------------------------------
BURST_RATIOS = ("urgent_ttft_median_ms", "urgent_ttft_p95_ms", "low_ttft_median_ms", "throughput_tok_s", "wall_s",
                "peak_cells")
SHARED_RATIOS = ("peak_cells", "shared_tokens_computed", "throughput_tok_s", "wall_s")


def compare_priority_burst(settings: Settings, *, timeout_s: float = RUN_TIMEOUT_S, exact: bool = False,
                           **sizes) -> dict:
    """priority_burst(**sizes) on our scheduler (with exact: again with KVB_SCHED_EXACT=1), then on llama-server."""
    workload = priority_burst(**sizes)
    runs = _run_both(workload, settings, timeout_s, exact)
    figures = {name: burst_figures(run) for name, run in runs.items()}
    return _result(workload, settings, runs, figures, ratios(figures[OURS], figures[THEIRS], BURST_RATIOS),
                   exact_figures(runs, figures, BURST_RATIOS))


def compare_shared_system_prompt(settings: Settings, *, timeout_s: float = RUN_TIMEOUT_S, exact: bool = False,
                                 **sizes) -> dict:
    """shared_system_prompt(**sizes) on our scheduler (with exact: again in exact mode), then on llama-server."""
    workload = shared_system_prompt(**sizes)
    shared = shared_prefix_tokens(workload, settings)
    runs = _run_both(workload, settings, timeout_s, exact)
    figures = {name: shared_figures(run, shared) for name, run in runs.items()}
    return _result(workload, settings, runs, figures, ratios(figures[OURS], figures[THEIRS], SHARED_RATIOS),
                   exact_figures(runs, figures, SHARED_RATIOS))


def _run_both(workload: Workload, settings: Settings, timeout_s: float, exact: bool = False) -> dict[str, EngineRun]:
    binary = llama_server_binary(settings)   # a missing binary is said before our run, not after it
    runs = {OURS: run_scheduler(workload, settings, timeout_s=timeout_s)}
    if exact:   # the mode on, right after it off: the same workload, the same machine, minutes apart
        runs[EXACT] = run_scheduler(workload, settings, timeout_s=timeout_s, exact=True)
        runs[NO_FA] = run_scheduler(workload, settings, timeout_s=timeout_s, flash_attn=False)
    runs[THEIRS] = run_llama_server(workload, settings, timeout_s=timeout_s, binary=binary)
    if exact:
        for name in (OURS, EXACT):
            check_against_solo(workload, scheduler_settings(workload, settings, name == EXACT), runs[name])
    return runs


def check_against_solo(workload: Workload, settings: Settings, run: EngineRun) -> None:
    """Each completed answer against the same request run alone (kvbridge.scheduler.exact.solo_answer on a
    context of its own, the run's K/V type and attention kernels), greedy, as long as the answer."""
    from kvbridge.backends.llama_context import LlamaContext
    from kvbridge.scheduler.exact import solo_answer

    ctx = LlamaContext(settings.replace(sched_exact=False), settings.ctx_size, 1)
    try:
        for timed, result in zip(workload.requests, run.requests):
            if result.error:
                continue
            tokens = ctx.tokenize(ctx.render(list(timed.messages)))
            answer = solo_answer(ctx, tokens, timed.n_predict)
            result.solo_equal = b"".join(ctx.piece(t) for t in answer).decode("utf-8", "replace") == result.text
    finally:
        ctx.close()


def exact_figures(runs: dict[str, EngineRun], figures: dict, names: tuple[str, ...]) -> dict:
    """--exact: the mode's figures against the mode off (exact / off) and how many answers equal their solo runs."""
    if EXACT not in runs:
        return {}
    done = {name: [r for r in runs[name].requests if not r.error] for name in (OURS, EXACT)}
    return {"exact_vs_off": ratios(figures[EXACT], figures[OURS], names),
            "exact_vs_off_flash_attention_off": ratios(figures[EXACT], figures[NO_FA], names),
            "exact_vs_llama_server": ratios(figures[EXACT], figures[THEIRS], names),
            "solo_equal": {name: [sum(bool(r.solo_equal) for r in done[name]), len(done[name])] for name in done}}


def _result(workload: Workload, settings: Settings, runs: dict[str, EngineRun], figures: dict, ratio: dict,
            exact: dict | None = None) -> dict:
    d = workload.defaults
    return {"workload": {"key": workload.key, "title": workload.title, "kv_cells": d.kv_cells,
                         "max_running": d.max_running, "threads": settings.resolved_threads(),
                         "watermarks": [d.soft, d.hard, d.critical],
                         "llama_server_args": llama_server_args(workload, settings),
                         "requests": [dataclasses.asdict(r) for r in workload.requests]},
            "runs": {name: dataclasses.asdict(run) for name, run in runs.items()},
            "figures": figures, "ratios": ratio, **({"exact": exact} if exact else {})}


def run_bench_scheduler(settings: Settings, parts=PARTS, *, swap: dict | None = None, burst: dict | None = None,
                        shared: dict | None = None, timeout_s: float = RUN_TIMEOUT_S, exact: bool = False) -> dict:
    """The parts asked for, in one run: swap cost, then the burst and shared-prompt comparisons."""
    from kvbridge.bench.scheduler_bench import bench_swap_vs_recompute

    result: dict = {"parts": list(parts)}
    if "swap" in parts:
        result["swap"] = bench_swap_vs_recompute(settings, **(swap or {}))
    if "burst" in parts:
        result["burst"] = compare_priority_burst(settings, timeout_s=timeout_s, exact=exact, **(burst or {}))
    if "shared" in parts:
        result["shared"] = compare_shared_system_prompt(settings, timeout_s=timeout_s, exact=exact, **(shared or {}))
    return result
