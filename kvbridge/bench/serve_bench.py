"""`python -m kvbridge bench-serve`: KVBridge's OpenAI endpoint against llama-server's own, through the
official `openai` SDK, on Document Q&A (issue 13, Performance).

Place in the flow: the client's side of `serve`. Each server is a child process on a free loopback
port (kvbridge.bench.common.private_serve), started and stopped here one at a time (never both up at once):

- **ours**: `python -m kvbridge serve --port P` (the in-process scheduler) with the caller's settings
  except: L2 in a private temp dir (KVB_L2_DIR; no cache server and no L3, so a restart restores
  from L2 on disk), KVB_CTX_SIZE=4096, KVB_SCHED_KV_CELLS=8192, KVB_SCHED_MAX_RUNNING=1 (the client
  is sequential), flash attention on (what llama-server's `-fa auto` picks on a CPU, so both run
  the same kernels) and no API key. Threads, chunk size, model and the rest are the caller's.
- **llama-server**: the same GGUF, `-m <gguf> -c 8192 -t <threads>`, otherwise its defaults. For
  the pinned build (b1-0c1e570, checked with --help and /props) they are: `-np -1` = auto, which
  is 4 slots over one unified KV cache (`--kv-unified` is on when the slot count is auto; each slot
  may use all 8192 cells; `-c 0` would give the model's 8192 as well), not `-np 1`; its prompt
  caches on: a request goes to the slot whose prompt matches best (`--slot-prompt-similarity 0.10`)
  and reuses the common prefix held there, and idle slots are saved to the RAM prompt cache
  (`--cache-ram 8192` MiB, `--cache-idle-slots`); `--cache-reuse 0` (no KV shifting); flash
  attention `auto`. ServerProcess adds a private `--slot-save-path`, used only when a slot is saved
  on request, and none is. Its endpoint reports `usage.prompt_tokens_details.cached_tokens` too.

Both are asked the same way: `chat.completions` with `stream=True`, `temperature=0`, a fixed
`max_tokens` and `stream_options={"include_usage": True}`, on the Document Q&A messages (the
built-in handbook and its questions, kvbridge.bench.common.scenarios). TTFT is measured by the client:
from just before the SDK call to the first chunk carrying content. `cached_tokens` is what each
server reports (ours: the tokens restored or shared instead of prefilled); ours also names the tier
that served the prompt (X-KVBridge-Tier).

1. Warm: each server in turn is started, asked a warm-up (question 1, cold), then the N questions,
   and stopped with SIGTERM.
2. After a restart, `repeats` times, the two servers alternating: start, question 1, stop. Ours
   restores the document from L2 (whose files may sit in the OS page cache: a process restart, not
   a reboot); llama-server's caches lived in its RAM, so it prefills the whole prompt again.

Also reported: seconds from start to ready, each stop's exit status, and whether the greedy answers
to question 1 (warm, after each restart) equal the cold warm-up's, for information (the oracle is
tests/test_serve.py). No target is judged here (Docs/Research.md does that). Left out: concurrent
clients (tests/test_serve.py, bench-scheduler) and warm-up passes beyond the one request.
"""
from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from kvbridge.bench.common.private_serve import OURS, THEIRS, OurServe, TheirServe, require_openai_sdk
from kvbridge.bench.common.report import write_result_json
from kvbridge.bench.common.scenarios import build_requests, builtin_document
from kvbridge.bench.common.streamed_chat import stream_chat
from kvbridge.bench.scheduler_compare import llama_server_binary
from kvbridge.settings import Settings

CTX_SIZE = 4096          # ours: the longest prompt + answer (the document with a question is ~1.8k tokens)
KV_CELLS = 8192          # ours: the scheduler's KV budget; llama-server: -c (the model's own context)
REQUEST_TIMEOUT_S = 600.0
TIER_HEADER = "X-KVBridge-Tier"   # read as any client reads it: the bench layer imports nothing of serve


@dataclass
class Answer:
    """One streamed request as the client saw it."""
    label: str
    ttft_ms: float | None = None     # request sent -> first chunk with content
    total_ms: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None: not reported
    completion_tokens: int = 0
    tier: str = ""                   # ours: X-KVBridge-Tier (resident, L1, L2, ...)
    text: str = ""
    error: str = ""


@dataclass
class ServerRun:
    server: str
    warmup: Answer | None = None
    warm: list[Answer] = field(default_factory=list)
    restarts: list[Answer] = field(default_factory=list)
    start_s: list[float] = field(default_factory=list)     # from start to ready, each start
    exit_codes: list[int | None] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def our_settings(settings: Settings, l2_dir: Path) -> Settings:
    return settings.replace(l2_dir=str(l2_dir), l2_enabled=True, store_url="", l3_url="", serve_engine="scheduler",
                            serve_host="127.0.0.1", serve_api_key_env="", serve_api_key_file="",
                            ctx_size=CTX_SIZE, sched_kv_cells=KV_CELLS,
                            sched_max_running=1, flash_attn=True, threads=settings.resolved_threads())


def llama_server_args(settings: Settings) -> list[str]:
    from kvbridge.backends.llama_cpp_model import model_path_for

    return ["-m", str(model_path_for(settings)), "-c", str(KV_CELLS), "-t", str(settings.resolved_threads())]


# -- the client ----------------------------------------------------------------------------------------
def ask(client, model: str, messages: list[dict], max_tokens: int, label: str) -> Answer:
    """One streamed, greedy chat request through the SDK; its error (if any) goes into the answer."""
    sent = stream_chat(client, model, messages, max_tokens)
    return Answer(label, tier=sent.headers.get(TIER_HEADER.lower(), ""), ttft_ms=sent.ttft_ms, total_ms=sent.total_ms,
                  prompt_tokens=sent.prompt_tokens, cached_tokens=sent.cached_tokens,
                  completion_tokens=sent.completion_tokens, text=sent.text, error=sent.error)


@contextlib.contextmanager
def running(server, run: ServerRun) -> Iterator:
    """The server started (time to ready recorded) with an SDK client on it; stopped on the way out."""
    import openai

    started = time.perf_counter()
    server.start()
    try:
        run.start_s.append(time.perf_counter() - started)
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    finally:
        if server.name == THEIRS and any(a.error for a in _answers(run)):
            run.notes.append("llama-server log, last lines:\n" + server.log_tail())
        run.exit_codes.append(server.stop())


def _answers(run: ServerRun) -> list[Answer]:
    return ([run.warmup] if run.warmup else []) + run.warm + run.restarts


# -- the run ---------------------------------------------------------------------------------------------
def document_text(document_chars: int | None) -> str:
    """The built-in handbook, or its start up to `document_chars` characters, cut at a space (a shorter run)."""
    text = builtin_document()
    if not document_chars or document_chars >= len(text):
        return text
    cut = text.rfind(" ", 0, document_chars + 1)
    return text[:cut if cut > 0 else document_chars]


def run_bench_serve(settings: Settings, *, questions: int = 12, repeats: int = 3, max_tokens: int = 16,
                    document_chars: int | None = None, progress: Callable[[str], None] = lambda line: None) -> dict:
    """Both phases on both servers; the whole result as plain data (format_bench_serve prints it)."""
    from kvbridge.backends.llama_cpp_model import model_path_for

    require_openai_sdk()
    binary = llama_server_binary(settings)   # said before anything starts
    document = document_text(document_chars)
    chats = build_requests("doc-qa", questions, document)
    first = list(chats[0].messages)
    model = model_path_for(settings).stem
    runs = {OURS: ServerRun(OURS), THEIRS: ServerRun(THEIRS)}
    with tempfile.TemporaryDirectory(prefix="kvb-bench-serve-") as temp:
        ours = OurServe(our_settings(settings, Path(temp) / "l2"), Path(temp) / "serve.log")
        theirs = TheirServe(binary, llama_server_args(settings), settings.llama_start_timeout)
        for server in (ours, theirs):
            run = runs[server.name]
            progress(f"{server.name}: warm-up, then {len(chats)} questions")
            with running(server, run) as client:
                run.warmup = ask(client, model, first, max_tokens, "warm-up: " + chats[0].label)
                run.warm = [ask(client, model, list(c.messages), max_tokens, c.label) for c in chats]
        for i in range(repeats):
            for server in (ours, theirs):   # alternating, so machine noise hits both alike
                progress(f"{server.name}: restart {i + 1}/{repeats}, question 1")
                with running(server, runs[server.name]) as client:
                    runs[server.name].restarts.append(ask(client, model, first, max_tokens, f"restart {i + 1}"))
        l2_dir = ours.settings.l2_dir
    setup = {"model": model_path_for(settings).name, "threads": settings.resolved_threads(),
             "chunk_size": settings.chunk_size, "ctx_size": CTX_SIZE, "kv_cells": KV_CELLS, "max_running": 1,
             "flash_attn": True, "l2_dir": l2_dir, "llama_server_binary": str(binary),
             "llama_server_args": llama_server_args(settings), "llama_server_build": theirs.props.get("build_info"),
             "llama_server_slots": theirs.props.get("total_slots"), "openai_sdk": _sdk_version(),
             "document_chars": len(document)}
    return {"command": "bench-serve", "questions": len(chats), "repeats": repeats, "max_tokens": max_tokens,
            "setup": setup, "runs": runs, "figures": {name: figures(run) for name, run in runs.items()},
            "ratios": ratios(runs), "answers": {name: answers_equal(run) for name, run in runs.items()}}


def _sdk_version() -> str:
    import openai

    return openai.__version__


# -- the figures -----------------------------------------------------------------------------------------
def _median(values: list) -> float | None:
    return statistics.median(values) if values else None


def figures(run: ServerRun) -> dict:
    warm = [a.ttft_ms for a in run.warm if not a.error]
    restarts = [a.ttft_ms for a in run.restarts if not a.error]
    done = [a for a in _answers(run) if not a.error]
    return {"requests": len(_answers(run)), "completed": len(done),
            "warm_mean_ttft_ms": statistics.fmean(warm) if warm else None, "warm_median_ttft_ms": _median(warm),
            "warm_cached_tokens": [a.cached_tokens for a in run.warm],
            "warm_prompt_tokens": [a.prompt_tokens for a in run.warm],
            "restart_median_ttft_ms": _median(restarts),
            "restart_cached_tokens": [a.cached_tokens for a in run.restarts],
            "restart_tiers": [a.tier for a in run.restarts],
            "start_median_s": _median(run.start_s)}


def ratios(runs: dict[str, ServerRun]) -> dict:
    """ours / llama-server for the warm mean; llama-server / ours (how many times faster) after a restart."""
    ours, theirs = figures(runs[OURS]), figures(runs[THEIRS])

    def divide(a, b):
        return a / b if a is not None and b else None

    return {"warm_mean_ttft_ours_vs_theirs": divide(ours["warm_mean_ttft_ms"], theirs["warm_mean_ttft_ms"]),
            "restart_speedup": divide(theirs["restart_median_ttft_ms"], ours["restart_median_ttft_ms"])}


def answers_equal(run: ServerRun) -> dict:
    """Question 1's greedy answer, warm and after each restart, against the cold warm-up's."""
    cold = run.warmup.text if run.warmup and not run.warmup.error else None

    def same(a: Answer) -> bool | None:
        return None if cold is None or a.error else a.text == cold

    return {"cold": cold, "warm": same(run.warm[0]) if run.warm else None,
            "restarts": [same(a) for a in run.restarts]}


def failed(result: dict) -> list[Answer]:
    return [a for run in result["runs"].values() for a in _answers(run) if a.error]


# -- the report -----------------------------------------------------------------------------------------
def _f(value, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _cached(values: list) -> str:
    known = [v for v in values if v is not None]
    return "not reported" if not known else (f"{min(known)}" if min(known) == max(known)
                                             else f"{min(known)}-{max(known)}")


def format_bench_serve(result: dict) -> str:
    s, runs, fig, r = result["setup"], result["runs"], result["figures"], result["ratios"]
    prompt = max(fig[OURS]["warm_prompt_tokens"] or [0])
    lines = [
        f"Document Q&A through the openai SDK {s['openai_sdk']} (streaming, temperature 0, max_tokens "
        f"{result['max_tokens']}): KVBridge serve against llama-server's own endpoint, one server up at a time",
        f"  {s['model']}, {s['threads']} thread(s) each, prompts of ~{prompt} tokens ({s['document_chars']}-char "
        f"document + question), {result['questions']} questions, {result['repeats']} restart(s)",
        f"  ours: scheduler, KV cells {s['kv_cells']}, context {s['ctx_size']}, 1 running, chunk {s['chunk_size']}, "
        f"flash attention on, L2 in a private temp dir {s['l2_dir']} (removed after)",
        f"  llama-server {s['llama_server_build'] or '?'}: {' '.join(s['llama_server_args'][2:])}, otherwise its "
        f"defaults ({s['llama_server_slots'] or '?'} slots, prompt caches on)",
        "  TTFT: the client's, request sent -> first content chunk; cached: each server's "
        "usage.prompt_tokens_details.cached_tokens",
        "",
        f"{'':34} {'ours':>12} {'llama-server':>12}   ratio",
        f"{'warm-up (question 1, cold) ms':34} {_f(runs[OURS].warmup and runs[OURS].warmup.ttft_ms):>12} "
        f"{_f(runs[THEIRS].warmup and runs[THEIRS].warmup.ttft_ms):>12}",
        f"{'warm: mean TTFT ms':34} {_f(fig[OURS]['warm_mean_ttft_ms']):>12} {_f(fig[THEIRS]['warm_mean_ttft_ms']):>12}"
        f"   ours / llama-server {_f(r['warm_mean_ttft_ours_vs_theirs'], '.2f', 'x')} (target <= 1.2x)",
        f"{'warm: median TTFT ms':34} {_f(fig[OURS]['warm_median_ttft_ms']):>12} "
        f"{_f(fig[THEIRS]['warm_median_ttft_ms']):>12}",
        f"{'warm: cached tokens':34} {_cached(fig[OURS]['warm_cached_tokens']):>12} "
        f"{_cached(fig[THEIRS]['warm_cached_tokens']):>12}",
        f"{'after a restart: TTFT ms (median)':34} {_f(fig[OURS]['restart_median_ttft_ms']):>12} "
        f"{_f(fig[THEIRS]['restart_median_ttft_ms']):>12}   llama-server / ours "
        f"{_f(r['restart_speedup'], '.1f', 'x')} (target >= 10x)",
        f"{'after a restart: cached tokens':34} {_cached(fig[OURS]['restart_cached_tokens']):>12} "
        f"{_cached(fig[THEIRS]['restart_cached_tokens']):>12}",
        f"{'start to ready s (median)':34} {_f(fig[OURS]['start_median_s'], '.2f'):>12} "
        f"{_f(fig[THEIRS]['start_median_s'], '.2f'):>12}",
        f"{'completed requests':34} {_done(fig[OURS]):>12} {_done(fig[THEIRS]):>12}",
        "",
        f"{'#':>3} {'request':40} {'ours ms':>9} {'cached':>6} {'tier':8} {'llama ms':>9} {'cached':>6}",
    ]
    pairs = [(runs[OURS].warmup, runs[THEIRS].warmup), *zip(runs[OURS].warm, runs[THEIRS].warm),
             *zip(runs[OURS].restarts, runs[THEIRS].restarts)]
    for i, (a, b) in enumerate(pairs):
        if a is None or b is None:
            continue
        lines.append(f"{i:>3} {a.label[:40]:40} {_f(a.ttft_ms):>9} {_f(a.cached_tokens, 'd'):>6} {a.tier[:8]:8} "
                     f"{_f(b.ttft_ms):>9} {_f(b.cached_tokens, 'd'):>6}")
    lines.append("")
    for name in (OURS, THEIRS):
        eq = result["answers"][name]
        restarts = ", ".join(_yes(x) for x in eq["restarts"]) or "-"
        lines.append(f"greedy answer to question 1, {name}: warm equals cold {_yes(eq['warm'])}; after each restart "
                     f"{restarts}  (cold: {(eq['cold'] or '').strip()[:50]!r})")
    for name in (OURS, THEIRS):
        for a in _answers(runs[name]):
            if a.error:
                lines.append(f"error, {name}, {a.label}: {a.error[:300]}")
        lines.extend(runs[name].notes)
        if any(code not in (0, None) for code in runs[name].exit_codes):
            lines.append(f"{name} exit statuses after SIGTERM: {runs[name].exit_codes}")
    return "\n".join(lines)


def _done(figures: dict) -> str:
    return f"{figures['completed']}/{figures['requests']}"


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")


def write_json(result: dict, output_dir) -> Path:
    return write_result_json(result, output_dir, "bench-serve")
