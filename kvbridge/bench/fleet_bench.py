"""`python -m kvbridge bench-fleet`: a fleet of `serve` workers behind vllm-router, per routing policy, with
and without the shared cache server (issue 34, deliverables 4 and 5).

Place in the flow: the client's side of kvbridge.fleet. Each fleet is a real `Fleet` (the cache server,
the workers, vllm-router on loopback), started, asked the workload of kvbridge.bench.fleet_workload
through the official openai SDK, and stopped before the next one starts (never two at once, except
the PD pair below, which alternate requests). Every fleet gets the caller's settings except:

- memory: one worker holds ~2 documents' prompts (WORKER_DOCUMENTS) while the workload has more
  documents (6 by default), in its KV cells (KVB_SCHED_KV_CELLS) and in its store's L1 (KVB_L1_BYTES,
  from the model's K/V bytes per token). No finished prompt stays resident in the cells
  (KVB_SCHED_CACHED_PREFIXES=0, see exactness below), so what a worker remembers between requests is
  its L1: a reused prompt is restored from the store. KVB_CTX_SIZE is the longest prompt plus the answer.
- threads: one core's share each (cores // workers, at least 1), the same in every fleet here.
- exactness: f32 K/V, one running sequence per worker (KVB_SCHED_MAX_RUNNING=1) and no resident
  cached prefixes, the settings under which the scheduler's answers are proven equal to solo runs
  (Docs/Research.md §11: llama.cpp on CPU is not batch-invariant, with f16 K/V an answer depends on
  where its cells lie, and even with f32 decoding over other sequences' cells moves the logits; a
  run here with resident prefixes shared gave "can be" for a cold "can control"). The fleet still runs
  CLIENT_THREADS requests at once, one per worker.
- the store: no L2 and no L3 (memory stays bounded; one L2 folder would be a cache the workers share
  through the disk), no KVB_STORE_URL: nothing from an earlier fleet or run is found. Shared cache on:
  the fleet's own cache server, its pool the workers' L1 together (workers x one worker's); off: each
  worker its own embedded L1. The single instance: SINGLE_SCALE x one worker's cells and L1.
- no API key, loopback only.
- `--exact` (issue 47): instead of f32 and one running sequence, the defaults that decide an answer: the caller's
  K/V types (f16 by default) and KVB_SCHED_MAX_RUNNING sequences at once, in exact mode (KVB_SCHED_EXACT, flash
  attention off). The single instance (the cold oracle) runs so too, and every policy's fleet runs twice: in
  exact mode (its usual name) and then with the mode off on its default kernels, flash attention on (the name
  plus OFF_SUFFIX), so `ratios["exact_vs_off_tokens_per_s"]` compares the two side by side in one run. The
  mode off's answers are counted against the cold ones but fail nothing: it makes no such promise. Before any
  fleet starts, exact mode's cut is proven for the workers' own settings (kvbridge.fleet.fleet.prove_cut, once per
  machine): their thread count is seldom the one setup.sh proved, and without a verdict a restore leaves 32 or
  more tokens to compute (a PD decode leg recomputed 54 of the 598 its prefill leg stored, Research §34).

Runs, in this order:
1. **single**: one instance with all the memory (`Fleet(workers=1)`, 3x a worker's cells and cached
   prefixes, no shared cache). First every distinct question once, one at a time, under a fresh
   `cache_salt` each (nothing reused): the cold answers every other answer is compared with. Then the
   workload, as the reference hit rate.
2. for each policy, shared cache off then on: `Fleet(workers=3, policy=...)` and the workload.
3. PD: `Fleet(pd=True, workers=2)` (one prefill, one decode, through the shared cache server) and
   `Fleet(workers=1)` colocated, both up; each is asked question 0 of document 0 (the prefix warms),
   then PD_QUESTIONS new questions on the same document, alternating between the two fleets.

The workload: every document's questions, interleaved (seeded), one user per document who asks the
next question `think_s` seconds after the last was answered, up to CLIENT_THREADS requests in flight
(different documents). With no think time a question can reach a worker before the last answer's
prompt has landed in the store (written behind the answer), and a worker's KV events claim blocks only
once stored: at 0 s a follow-up often recomputes what the 2 s default restores.
Figures per fleet: hit rate = sum(cached_tokens) / sum(prompt_tokens) (usage), mean and median TTFT,
completion tokens/s and requests/s over the workload's wall time, the instance that answered each
request (X-KVBridge-Instance), answers equal to their cold runs. No target is judged here
(Docs/Research.md does that); the machine is shared, so the ratios of one run are what to read.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvbridge.bench.common.private_serve import require_openai_sdk
from kvbridge.bench.fleet_workload import (QUESTIONS, Answer, Document, Question, ask, client, documents,
                                           interleaved, messages)
from kvbridge.settings import Settings

POLICIES = ("round_robin", "cache_aware", "kv_aware")
SEED = 34
DOCUMENT_CHARS = 2400          # ~560 tokens of SmolLM2 per document; with the question ~600 per prompt
QUICK_DOCUMENT_CHARS = 1200
WORKER_DOCUMENTS = 2.5         # a worker's cells and L1: ~2 prompts, and room for part of the next one
SINGLE_SCALE = 3               # "one instance with all the memory": this many workers' cells
CLIENT_THREADS = 3
PD_QUESTIONS = 3               # new questions on the warm document, per PD fleet
OFF_SUFFIX = " (mode off)"     # --exact: the mode-off twin of a policy's fleet
TEMPLATE_TOKENS = 24           # the chat template's own tokens around the two messages (SmolLM2: ~15)


@dataclass(frozen=True)
class Sizing:
    """What every fleet's workers get: cells, context and threads, from the longest prompt."""
    prompt_tokens: int         # the longest prompt, counted with the model's tokenizer (+ the template)
    worker_cells: int
    worker_l1_bytes: int       # WORKER_DOCUMENTS documents' store objects (document_bytes)
    ctx_size: int
    threads: int


@dataclass
class FleetRun:
    """One fleet and what it answered."""
    name: str                       # "single", "kv_aware/shared", "round_robin/no-shared", "pd", "colocated"
    policy: str
    workers: int
    shared_cache: bool
    pd: bool = False
    cells: int = 0
    answers: list[Answer] = field(default_factory=list)
    warmup: Answer | None = None     # PD and colocated: question 0 of document 0
    wall_s: float = 0.0              # the workload, first request sent -> last answer in
    start_s: float = 0.0             # Fleet.start() until the router answers
    instances: list[str] = field(default_factory=list)
    error: str = ""                  # the fleet did not start or broke; its figures are missing
    exact: bool | None = None        # --exact: the fleet in exact mode (True) or its mode-off twin (False)


def run_name(policy: str, shared: bool) -> str:
    return f"{policy}/{'shared' if shared else 'no-shared'}"


def sizing(settings: Settings, docs: list[Document], max_tokens: int, workers: int, questions: int) -> Sizing:
    """Cells for ~2 prompts per worker, counted with the model's own tokenizer (vocab only: no weights)."""
    import llama_cpp

    vocab = llama_cpp.Llama(str(settings.resolved_model_path()), vocab_only=True, verbose=False)

    def count(text: str) -> int:
        return len(vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True))

    longest = max(sum(count(m["content"]) for m in messages(d, q)) for d in docs for q in range(len(QUESTIONS)))
    prompt = longest + TEMPLATE_TOKENS
    block = settings.sched_block_tokens
    cells = -(-int(WORKER_DOCUMENTS * (prompt + max_tokens)) // block) * block
    l1 = int(WORKER_DOCUMENTS * document_bytes(prompt, settings.chunk_size, questions, vocab.metadata))
    ctx = -(-(prompt + max_tokens + 64) // 256) * 256
    return Sizing(prompt, cells, l1, ctx, max(1, settings.resolved_threads() // workers))


def document_bytes(prompt: int, chunk: int, questions: int, metadata: dict) -> int:
    """What the store holds for one document asked `questions` questions: its whole chunks once, and each
    question's own tail (the tokens after the last whole chunk, stored per prompt), in f32 K/V."""
    whole = prompt // chunk * chunk
    return kv_bytes_per_token(metadata) * (whole + questions * (prompt - whole))


def kv_bytes_per_token(metadata: dict) -> int:
    """f32 K and V of every layer for one token, from the GGUF's own keys (SmolLM2-135M: 46,080)."""
    arch = metadata["general.architecture"]
    heads = int(metadata[f"{arch}.attention.head_count"])
    heads_kv = int(metadata.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(metadata[f"{arch}.embedding_length"]) // heads
    return int(metadata[f"{arch}.block_count"]) * heads_kv * head_dim * 2 * 4


def fleet_settings(settings: Settings, size: Sizing, folder: Path, *, scale: int = 1, pool: bool = False,
                   exact: bool | None = None) -> Settings:
    """A fleet's settings: `scale` x one worker's cells and L1 (the single instance, a shared pool). pool: L1 is
    a cache server's pool, which evicts down to KVB_CACHE_SERVER_TARGET_FREE free once below SOFT_FREE: it is
    given that much more, so that it holds what the workers' L1s hold together. exact (--exact): None, f32 K/V and
    one running sequence with the mode off; True, the caller's K/V and running sequences in exact mode; False, the
    same with the mode off and flash attention on."""
    l1 = size.worker_l1_bytes * scale / ((1 - settings.cache_server_soft_free) if pool else 1)
    answers = (dict(sched_max_running=1, cache_type_k="f32", cache_type_v="f32", flash_attn=False, sched_exact=False)
               if exact is None else dict(flash_attn=not exact, sched_exact=exact))
    return settings.replace(
        ctx_size=size.ctx_size, sched_kv_cells=size.worker_cells * scale, l1_bytes=int(l1), **answers,
        sched_cached_prefixes=0,
        threads=size.threads, serve_engine="scheduler", serve_host="127.0.0.1", serve_api_key_env="",
        serve_api_key_file="",
        serve_admin_key_env="", serve_tenants_file="", l2_dir=str(folder / "l2"), l2_enabled=False, l3_url="",
        store_url="")


@contextlib.contextmanager
def started(run: FleetRun, settings: Settings, **fleet_options):
    """A started Fleet (its start time and instances in `run`); its own lines go to stderr, not the table."""
    from kvbridge.fleet import Fleet

    fleet = Fleet(settings, workers=run.workers, shared_cache=run.shared_cache, pd=run.pd, **fleet_options)
    begun = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        fleet.start()
    try:
        run.start_s = time.perf_counter() - begun
        run.instances = [w.instance_id for w in fleet.workers]
        yield fleet
    finally:
        with contextlib.redirect_stdout(sys.stderr):
            fleet.stop()


def workload(fleet_url: str, model: str, docs: list[Document], order: list[Question], max_tokens: int,
             think_s: float = 0.0) -> tuple:
    """The questions, up to CLIENT_THREADS at once: whenever a client is free it sends the first question in
    `order` whose user (one per document) is not waiting for an answer and has read the last one for
    `think_s` seconds, as a user asks the next question after reading the last answer. Answers in the
    order sent, and the wall seconds (think time included)."""
    sdk = client(fleet_url)
    pending, running, answers, ready_at = list(order), {}, [], {}
    begun = time.perf_counter()
    with ThreadPoolExecutor(CLIENT_THREADS) as pool:
        while pending or running:
            now = time.perf_counter()
            waiting = {q.doc for q in running.values()} | {d for d, at in ready_at.items() if at > now}
            for question in list(pending):
                if len(running) == CLIENT_THREADS:
                    break
                if question.doc in waiting:
                    continue
                waiting.add(question.doc)
                pending.remove(question)
                running[pool.submit(ask, sdk, model, docs, question, max_tokens, started=begun)] = question
            reading = [at - now for at in ready_at.values() if at > now]   # users who will be ready then
            if not running:   # every user left is reading: wait for the first to finish
                time.sleep(min(reading))
                continue
            done, _ = wait(running, timeout=min(reading) if reading else None, return_when=FIRST_COMPLETED)
            for future in done:
                question = running.pop(future)
                answers.append(future.result())
                ready_at[question.doc] = time.perf_counter() + think_s
    return sorted(answers, key=lambda a: a.sent_s), time.perf_counter() - begun


def cold_runs(fleet_url: str, model: str, docs: list[Document], keys: list[Question], max_tokens: int) -> dict:
    """Each distinct question once, one at a time, under a fresh cache_salt (nothing reused): key -> Answer."""
    sdk = client(fleet_url)
    return {q.key: ask(sdk, model, docs, q, max_tokens, cache_salt=f"bench-fleet-cold-{uuid.uuid4().hex}")
            for q in keys}


def _guarded(run: FleetRun, body: Callable[[], None], progress: Callable[[str], None]) -> None:
    """Run one fleet's part; a fleet that fails to start or breaks is recorded in the run (a failed
    bench, named in the report) and the next fleet still runs."""
    try:
        body()
    except Exception as exc:  # noqa: BLE001 - recorded in the result, and failed() makes the exit non-zero
        run.error = f"{type(exc).__name__}: {exc}"
        progress(f"{run.name}: failed: {run.error[:300]}")


def run_bench_fleet(settings: Settings, *, documents_count: int = 6, questions_per_document: int = 4,
                    max_tokens: int = 12, policies: tuple[str, ...] = POLICIES, workers: int = 3, think_s: float = 0.0,
                    shared_modes: tuple[bool, ...] = (False, True), pd: bool = True, quick: bool = False,
                    exact: bool = False, progress: Callable[[str], None] = lambda line: None) -> dict:
    """Every fleet in turn; the whole result as plain data (kvbridge.bench.fleet_report prints it)."""
    require_openai_sdk()
    from kvbridge.fleet.router import router_binary

    router_binary()   # said before anything starts
    docs = documents(documents_count, QUICK_DOCUMENT_CHARS if quick else DOCUMENT_CHARS)
    order = interleaved(documents_count, questions_per_document, SEED)
    pd_keys = [Question(0, n) for n in range(min(1 + PD_QUESTIONS, len(QUESTIONS)))] if pd else []
    cold_keys = list(dict.fromkeys(sorted(order, key=lambda q: (q.doc, q.number)) + pd_keys))
    size = sizing(settings, docs, max_tokens, workers, questions_per_document)
    model = settings.resolved_model_path().stem
    runs: dict[str, FleetRun] = {}
    cold: dict[str, Answer] = {}
    with tempfile.TemporaryDirectory(prefix="kvb-bench-fleet-") as temp:
        def folder(name: str) -> Path:
            return Path(temp) / name.replace("/", "-")

        if exact:   # the workers' thread count is seldom the one setup.sh proved: prove it, once per machine
            from kvbridge.fleet.fleet import prove_cut

            proved = prove_cut(fleet_settings(settings, size, folder("probe"), exact=True))
            progress(f"exact mode's cut for the workers' settings: {proved}")

        single = runs["single"] = FleetRun("single", "round_robin", 1, False, cells=size.worker_cells * SINGLE_SCALE)

        def single_body() -> None:
            progress(f"single instance ({single.cells} cells): starting")
            with started(single, fleet_settings(settings, size, folder("single"), scale=SINGLE_SCALE,
                                                exact=True if exact else None), policy="round_robin") as fleet:
                progress(f"single: {len(cold_keys)} cold runs, one at a time, each under a fresh cache_salt")
                cold.update(cold_runs(fleet.url, model, docs, cold_keys, max_tokens))
                progress(f"single: the workload, {len(order)} questions, {CLIENT_THREADS} client threads")
                single.answers, single.wall_s = workload(fleet.url, model, docs, order, max_tokens, think_s)

        _guarded(single, single_body, progress)
        for policy in policies:
            for shared, mode in ((s, m) for s in shared_modes for m in ((True, False) if exact else (None,))):
                name = run_name(policy, shared) + (OFF_SUFFIX if mode is False else "")
                run = runs[name] = FleetRun(name, policy, workers, shared, cells=size.worker_cells, exact=mode)

                def body(run=run, policy=policy, shared=shared, mode=mode) -> None:
                    progress(f"{run.name}: starting {workers} workers ({run.cells} cells each)")
                    pooled = fleet_settings(settings, size, folder(run.name), scale=workers if shared else 1,
                                            pool=shared, exact=mode)
                    with started(run, pooled, policy=policy) as fleet:
                        progress(f"{run.name}: the workload, {len(order)} questions")
                        run.answers, run.wall_s = workload(fleet.url, model, docs, order, max_tokens, think_s)

                _guarded(run, body, progress)
        if pd:
            pd_pair(settings, size, folder, docs, pd_keys, max_tokens, model, runs, progress, exact or None)
    result = {"command": "bench-fleet", "quick": quick, "exact": exact, "documents": documents_count,
              "questions_per_document": questions_per_document, "max_tokens": max_tokens,
              "policies": list(policies), "shared_modes": list(shared_modes), "seed": SEED, "think_s": think_s,
              "setup": setup(settings, size, docs, workers, think_s, exact), "order": [q.key for q in order],
              "cold": cold, "runs": runs}
    result["figures"] = {name: figures(run, cold) for name, run in runs.items()}
    result["ratios"] = ratios(result["figures"])
    return result


def pd_pair(settings: Settings, size: Sizing, folder: Callable[[str], Path], docs: list[Document],
            pd_keys: list[Question], max_tokens: int, model: str, runs: dict, progress, exact: bool | None = None) -> None:
    """PD (1 prefill + 1 decode) and one colocated instance, both up, alternating new questions on a warm prefix."""
    pd_run = runs["pd"] = FleetRun("pd", "round_robin", 2, True, pd=True, cells=size.worker_cells)
    colocated = runs["colocated"] = FleetRun("colocated", "round_robin", 1, True, cells=size.worker_cells)

    def body() -> None:
        progress("PD: starting a prefill/decode pair and one colocated instance")
        with started(colocated, fleet_settings(settings, size, folder("colocated"), exact=exact),
                     policy="round_robin") as colo_fleet, \
                started(pd_run, fleet_settings(settings, size, folder("pd"), scale=2, exact=exact),
                        policy="round_robin") as pd_fleet:
            clients = [(colocated, client(colo_fleet.url)), (pd_run, client(pd_fleet.url))]
            for run, sdk in clients:
                run.warmup = ask(sdk, model, docs, pd_keys[0], max_tokens)
            progress(f"PD: {len(pd_keys) - 1} new questions on the warm document, alternating")
            for question in pd_keys[1:]:
                for run, sdk in clients:
                    began = time.perf_counter()
                    run.answers.append(ask(sdk, model, docs, question, max_tokens))
                    run.wall_s += time.perf_counter() - began

    _guarded(pd_run, body, progress)
    if pd_run.error and not colocated.error:
        colocated.error = "the PD pair's run failed (see pd)"


def setup(settings: Settings, size: Sizing, docs: list[Document], workers: int, think_s: float,
          exact: bool = False) -> dict:
    import openai

    return {"model": settings.resolved_model_path().name, "chunk_size": settings.chunk_size,
            "workers": workers, "threads_per_worker": size.threads, "worker_kv_cells": size.worker_cells,
            "single_kv_cells": size.worker_cells * SINGLE_SCALE, "ctx_size": size.ctx_size,
            "worker_l1_bytes": size.worker_l1_bytes, "single_l1_bytes": size.worker_l1_bytes * SINGLE_SCALE,
            "shared_pool_bytes": int(size.worker_l1_bytes * workers / (1 - settings.cache_server_soft_free)),
            "longest_prompt_tokens": size.prompt_tokens, "think_s": think_s,
            "kv_type": f"{settings.cache_type_k}/{settings.cache_type_v}" if exact else "f32",
            "max_running_per_worker": settings.sched_max_running if exact else 1, "cached_prefixes": 0, "l2": False,
            "exact": "exact mode; each policy's fleet again with the mode off, flash attention on" if exact
                     else "mode off, f32 K/V, one running sequence",
            "document_titles": [d.title for d in docs], "document_chars": [len(d.text) for d in docs],
            "client_threads": CLIENT_THREADS, "openai_sdk": openai.__version__,
            "cold_runs": "the single instance (Fleet(workers=1)), through its router, one at a time, "
                         "each under a fresh cache_salt"}


# -- the figures -----------------------------------------------------------------------------------------
def _divide(a, b):
    return a / b if a is not None and b else None


def figures(run: FleetRun, cold: dict[str, Answer]) -> dict:
    ok = [a for a in run.answers if not a.error]
    prompt, cached = sum(a.prompt_tokens for a in ok), sum(a.cached_tokens for a in ok)
    ttfts = [a.ttft_ms for a in ok]
    tpots = [a.time_per_output_token_ms for a in ok if a.time_per_output_token_ms is not None]
    per_doc: dict[int, set] = {}
    for a in ok:
        per_doc.setdefault(a.doc, set()).add(a.instance)
    checked = ok + ([run.warmup] if run.warmup is not None and not run.warmup.error else [])
    compared = [a for a in checked if a.key in cold and not cold[a.key].error]
    differ = [a.key for a in compared if a.text != cold[a.key].text]
    return {"requests": len(run.answers), "completed": len(ok), "error": run.error,
            "hit_rate": _divide(cached, prompt), "cached_tokens": cached, "prompt_tokens": prompt,
            "mean_ttft_ms": statistics.fmean(ttfts) if ttfts else None,
            "median_ttft_ms": statistics.median(ttfts) if ttfts else None,
            "median_time_per_output_token_ms": statistics.median(tpots) if tpots else None,
            "completion_tokens_per_s": _divide(sum(a.completion_tokens for a in ok), run.wall_s),
            "requests_per_s": _divide(len(ok), run.wall_s), "wall_s": run.wall_s, "start_s": run.start_s,
            "by_instance": dict(Counter(a.instance or "?" for a in ok)),
            "instances_per_document": _divide(sum(len(s) for s in per_doc.values()), len(per_doc)),
            "answers_compared": len(compared), "answers_differ": differ}


def ratios(fig: dict) -> dict:
    """The figures the issue's Targets name, each from this one run."""
    def get(name: str, key: str):
        return fig[name][key] if name in fig else None

    single_hit = get("single", "hit_rate")
    return {
        "kv_aware_hit_vs_single": {mode: _divide(get(f"kv_aware/{mode}", "hit_rate"), single_hit)
                                   for mode in ("shared", "no-shared")},
        "round_robin_no_shared_ttft_vs_kv_aware": {
            mode: _divide(get("round_robin/no-shared", "mean_ttft_ms"), get(f"kv_aware/{mode}", "mean_ttft_ms"))
            for mode in ("shared", "no-shared")},
        "round_robin_hit_rate": {mode: get(f"round_robin/{mode}", "hit_rate") for mode in ("shared", "no-shared")},
        "round_robin_ttft_shared_vs_no_shared": _divide(get("round_robin/shared", "mean_ttft_ms"),
                                                        get("round_robin/no-shared", "mean_ttft_ms")),
        "pd_ttft_vs_colocated": _divide(get("pd", "median_ttft_ms"), get("colocated", "median_ttft_ms")),
        "pd_time_per_output_token_vs_colocated": _divide(get("pd", "median_time_per_output_token_ms"),
                                                         get("colocated", "median_time_per_output_token_ms")),
        # --exact: each policy's exact fleet against its mode-off twin (flash attention on), side by side
        "exact_vs_off_tokens_per_s": {name: _divide(fig[name]["completion_tokens_per_s"],
                                                    fig[name + OFF_SUFFIX]["completion_tokens_per_s"])
                                      for name in fig if name + OFF_SUFFIX in fig},
    }


def failed(result: dict) -> list[str]:
    """What makes the bench fail: a fleet that broke, a request with an error, an answer unlike its cold run."""
    problems = [f"cold run {key}: {a.error}" for key, a in result["cold"].items() if a.error]
    for name, run in result["runs"].items():
        if run.error:
            problems.append(f"{name}: {run.error}")
        problems += [f"{name}, {a.key}: {a.error}" for a in run.answers + [run.warmup] if a is not None and a.error]
        if run.exact is not False:   # the mode off (--exact's twin) promises no answer equal to cold
            problems += [f"{name}, {key}: the answer differs from its cold run"
                         for key in result["figures"][name]["answers_differ"]]
    return problems

