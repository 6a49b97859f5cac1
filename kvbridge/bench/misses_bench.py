"""bench-misses: five scenarios built so the cause of every miss is known, and each miss checked against it.

Place in the flow: prompt -> chunk hashes -> lookup -> fetch + confirm -> **the explainer names the first token not
restored** (kvbridge.engine.misses; the scheduler's in kvbridge.scheduler.misses) -> the record. This bench builds
the misses on purpose and counts the ones the record attributes to another cause, or to none: "unexplained misses",
which must be 0 (issue 35). A miss is a request that restored fewer than all but its last prompt token.

- doc-qa: two documents, questions alternating between them, L1 sized to hold one document (no L2): a document's
  first question is none_stored, a second question right after the first diverged, a question after the other
  document was stored evicted (the detail names L1, the policy, what it made room for);
- long-context: the long-context bench's document at a few lengths (kvbridge.bench.long_context), two questions
  each: the first request none_stored, every later one diverged (the stored prompt goes on with its question);
- model-file: a zoo model file stores its prompts, the file is rewritten with other weights, a fresh engine asks
  them again: other_namespace naming model_sha256;
- tenant-salt: the scheduler stores prompts without a cache salt, a tenant asks them with its own: other_namespace
  naming cache_salt in the operator's view (the probe under other salts, run after the answer as serve runs it),
  none_stored in the tenant's record and in what the client sees;
- redis-stop: L3 on a private redis-server (no L2), L1 emptied, the server killed: tier_down naming L3.

Beside them: warm-hit TTFT with KVB_EXPLAIN_MISSES on and off (alternated, medians), and what explaining cost on
the misses (explain_ms, store round trips). Deliberately left out: a cache server (tests/test_miss_reasons.py
covers lease_busy and the round trip there) and any timing threshold; Docs/Research.md §24 reads the figures.
"""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from kvbridge.bench.common.report import write_result_json
from kvbridge.bench.common.runner import ProgressFn
from kvbridge.bench.common.scenarios import builtin_document
from kvbridge.engine.cold_cut import DEFAULT_RULE, CutRule
from kvbridge.errors import KVBridgeError
from kvbridge.settings import Settings

SCENARIOS = ("doc-qa", "long-context", "model-file", "tenant-salt", "redis-stop")
# what the detail of each built cause must say (beside the code itself)
MUST_SAY = {"none_stored": "nothing", "diverged": "diverges", "evicted": "evicted from L1",
            "other_namespace": "", "tier_down": "L3"}
QUESTIONS = ("Who leads the operations team?", "Where is Well One?", "How often are the filters changed?",
             "Who sends the monthly report to the board?", "What is the cooperative's phone number?",
             "When was the cooperative founded?")


@dataclass
class Attributed:
    """One request of a scenario: the cause it was built to have and the one its record names."""

    scenario: str
    label: str
    expected: str
    must_say: str
    reason: str
    detail: str
    prompt_tokens: int
    matched_tokens: int
    explain_ms: float
    store_calls: int = 0
    client_reason: str = ""     # tenant-salt: what serve shows the tenant
    rule: CutRule = DEFAULT_RULE   # where the engine that answered lets a restore end (CachedEngine.cut_rule)

    @property
    def missed(self) -> bool:
        """Fewer tokens restored than the engine's cut rule lets a restore give (the scheduler's rows are misses)."""
        return self.matched_tokens < self.rule.restorable(self.prompt_tokens)

    @property
    def explained(self) -> bool:
        return not self.missed or (self.reason == self.expected and self.must_say in self.detail)


def _row(scenario: str, label: str, expected: str, record, must_say: str | None = None, **extra) -> Attributed:
    return Attributed(scenario, label, expected, MUST_SAY.get(expected, "") if must_say is None else must_say,
                      record.miss_reason, record.miss_detail, record.prompt_tokens, record.matched_tokens or 0,
                      record.explain_ms, record.store_calls, **extra)


def _lmcache(engine, prompt, n_predict: int):
    record = engine.infer(prompt, mode="lmcache", n_predict=n_predict)
    if record.error:
        raise KVBridgeError(f"bench-misses: a request failed: {record.error}")
    return record


def _documents(chars: int) -> tuple[str, str]:
    text = builtin_document()
    if 2 * chars > len(text):
        raise KVBridgeError(f"bench-misses: --doc-chars {chars} is over half the built-in document ({len(text)} chars)")
    return text[:chars], text[chars:2 * chars]


def _ask(document: str, question: str) -> str:
    # plain text, not chat messages: a chat template's fixed opening (SmolLM2's default system line, 24 tokens)
    # is a prefix every prompt shares, and a stored prompt continuing it otherwise makes the next one `diverged`
    return f"{document}\n\nQuestion: {question}"


def _pieces(n: int, chars: int) -> list[str]:
    """n questions, each on a piece of the built-in document of its own: no two prompts share a first token."""
    text = builtin_document()
    step = len(text) // n
    return [_ask(text[i * step:i * step + min(chars, step)], QUESTIONS[i % len(QUESTIONS)]) for i in range(n)]


# -- the scenarios --------------------------------------------------------------------------------------
def doc_qa_small_l1(settings: Settings, make_engine: Callable, n_requests: int, doc_chars: int, n_predict: int,
                    count_tokens: Callable, per_token_bytes: int) -> list[Attributed]:
    """Questions on two documents, A B A A B A B ..., with an L1 of ~1.5 documents and no L2."""
    docs = dict(zip("AB", _documents(doc_chars)))
    order = ["A", "B", "A", "A"] + ["B", "A"] * n_requests
    prompts = [_ask(docs[d], QUESTIONS[i % len(QUESTIONS)]) for i, d in enumerate(order[:n_requests])]
    rows, seen, last = [], set(), None
    # a document's chunks and a question's tails: 1.5 of that holds one document, not two
    l1 = int(1.5 * (max(count_tokens(p) for p in prompts) + 2 * settings.chunk_size) * per_token_bytes)
    with tempfile.TemporaryDirectory(prefix="kvb-bench-misses-") as l2:
        small = settings.replace(l1_bytes=l1, l2_enabled=False)
        with make_engine(small, l2) as engine:
            for i, (doc, prompt) in enumerate(zip(order, prompts)):
                expected = "none_stored" if doc not in seen else "diverged" if last == doc else "evicted"
                rows.append(_row("doc-qa", f"{doc}{i}", expected, _lmcache(engine, prompt, n_predict),
                                 rule=engine.cut_rule))
                seen.add(doc)
                last = doc
    return rows


def long_context(settings: Settings, engine, lengths: Sequence[int], n_predict: int) -> list[Attributed]:
    """Two questions at each length: the first request of all none_stored, every later one diverged."""
    from kvbridge.bench.long_context import build_prompts

    rows = []
    for length, questions in build_prompts(engine, lengths, 2, n_predict).items():
        for q, prompt in enumerate(questions):
            expected = "diverged" if rows else "none_stored"
            rows.append(_row("long-context", f"{length}/q{q}", expected, _lmcache(engine, prompt, n_predict),
                             rule=engine.cut_rule))
    return rows


def model_file(settings: Settings, make_engine: Callable, n_requests: int, n_predict: int) -> list[Attributed]:
    """A zoo model file (a real GGUF) stores; the same file name with other weights asks the same prompts."""
    from kvbridge.models import zoo_model

    prompts = _pieces(n_requests, 400)
    with tempfile.TemporaryDirectory(prefix="kvb-bench-misses-model-") as folder:
        path = Path(folder) / "model.gguf"
        ours = settings.replace(model_path=str(path), l2_dir=str(Path(folder) / "l2"), ctx_size=1024)
        rows = []
        for seed in (0, 1):
            shutil.copyfile(zoo_model("llama", seed=seed), path)   # the file replaced by one with other weights
            with make_engine(ours, ours.l2_dir) as engine:
                for i, prompt in enumerate(prompts):
                    record = _lmcache(engine, prompt, n_predict)
                    if seed:
                        rows.append(_row("model-file", f"q{i}", "other_namespace", record, "model_sha256",
                                         rule=engine.cut_rule))
    return rows


def tenant_salt(settings: Settings, n_requests: int, doc_chars: int, n_predict: int) -> list[Attributed]:
    """The scheduler stores prompts unsalted; a tenant asks them under its cache salt."""
    from kvbridge.scheduler import Scheduler
    from kvbridge.serve.misses import client_view

    prompts = _pieces(n_requests, doc_chars)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvb-bench-misses-salt-") as l2:
        with Scheduler(settings.replace(l2_dir=l2, sched_cached_prefixes=0)) as scheduler:
            for salt in ("", "tenant-b"):
                for i, prompt in enumerate(prompts):
                    record = scheduler.submit(prompt, n_predict=n_predict, cache_salt=salt).result(timeout=300)
                    scheduler.drain(60)   # its prompt is in the store before the next request looks
                    if record.error:
                        raise KVBridgeError(f"bench-misses: a scheduler request failed: {record.error}")
                    if salt:
                        # the tenant's record holds its own salt's cause; the operator's is the probe under the
                        # other salts that serve runs once the answer has left (kvbridge.engine.misses)
                        shown = client_view(record, full=False).reason
                        later = getattr(record, "operator_probe", None)
                        cause = later() if later is not None else None
                        if cause is not None:
                            record = dataclasses.replace(record, miss_reason=cause[0], miss_detail=cause[1])
                        rows.append(_row("tenant-salt", f"q{i}", "other_namespace", record, "cache_salt",
                                         client_reason=shown))
    return rows


def redis_stop(settings: Settings, make_engine: Callable, n_requests: int, doc_chars: int,
               n_predict: int) -> list[Attributed]:
    """Prompts stored in L3 (a private redis-server), L1 emptied, no L2, the server killed, the prompts asked again."""
    from kvbridge.bench.common.private_redis import private_redis

    prompts = _pieces(n_requests, doc_chars)
    rows = []
    with private_redis() as server, tempfile.TemporaryDirectory(prefix="kvb-bench-misses-l3-") as l2:
        ours = settings.replace(l3_url=server.url, l3_timeout=0.5, l2_enabled=False, l3_prefix="kvb-bench-misses")
        with make_engine(ours, l2) as engine:
            for prompt in prompts:
                _lmcache(engine, prompt, n_predict)
            engine.store.drain()
            engine.store.clear("L1")
            server.kill()
            for i, prompt in enumerate(prompts):
                rows.append(_row("redis-stop", f"q{i}", "tier_down", _lmcache(engine, prompt, n_predict),
                                 rule=engine.cut_rule))
    return rows


# -- explaining on and off ------------------------------------------------------------------------------
def warm_ttft_on_off(engine, settings: Settings, prompt, repeats: int, n_predict: int) -> dict:
    """Warm hits of one stored prompt, KVB_EXPLAIN_MISSES on and off alternated (the order flips each round)."""
    _lmcache(engine, prompt, n_predict)
    times: dict[bool, list[float]] = {True: [], False: []}
    calls: dict[bool, set[int]] = {True: set(), False: set()}
    explain_ms = []
    try:
        for i in range(-1, repeats):    # one untimed round first
            for flag in ((True, False) if i % 2 else (False, True)):
                engine.settings = settings.replace(explain_misses=flag)
                record = _lmcache(engine, prompt, n_predict)
                if record.miss_reason:
                    raise KVBridgeError(f"bench-misses: the warm prompt missed: {record.miss_detail}")
                if i >= 0:
                    times[flag].append(record.ttft_ms)
                    calls[flag].add(record.store_calls)
                    explain_ms.append(record.explain_ms)
    finally:
        engine.settings = settings
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return {"prompt_tokens": record.prompt_tokens, "repeats": repeats, "on_ms": on, "off_ms": off,
            "delta_ms": on - off, "off_spread_ms": max(times[False]) - min(times[False]), "on_all": times[True],
            "off_all": times[False], "store_calls_on": sorted(calls[True]), "store_calls_off": sorted(calls[False]),
            "explain_ms_max": max(explain_ms)}


# -- the command ----------------------------------------------------------------------------------------
def run_bench_misses(settings: Settings, make_engine: Callable, scenarios: Sequence[str] = SCENARIOS, *,
                     n_requests: int = 5, doc_chars: int = 2400, lengths: Sequence[int] = (512, 1024, 2048),
                     repeats: int = 7, n_predict: int = 4, progress: ProgressFn | None = None,
                     say: Callable[[str], None] = print) -> dict:
    """Every scenario asked for; make_engine(settings, l2_dir) -> a CachedEngine (kvbridge.cli.common.make_engine)."""
    from kvbridge.bench.long_context import settings_for
    from kvbridge.formats.llama_chunks import assembled_size

    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown or not scenarios:
        raise KVBridgeError(f"bench-misses: unknown scenario(s) {', '.join(unknown) or '(none given)'}; "
                            f"use any of {', '.join(SCENARIOS)}")
    result: dict = {"scenarios": list(scenarios), "seconds": {}, "settings": {"chunk_size": settings.chunk_size,
                    "n_predict": n_predict, "n_requests": n_requests, "doc_chars": doc_chars, "lengths": list(lengths)}}
    rows: list[Attributed] = []
    main = settings_for(settings, lengths, n_predict)
    with contextlib.ExitStack() as stack:
        l2 = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvb-bench-misses-main-"))
        engine = stack.enter_context(make_engine(main, l2))
        if engine.backend.kv_mode != "full" or engine.geometry is None:
            raise KVBridgeError("bench-misses restores KV: it needs a full-KV engine with a chunked layout "
                                "(llamacpp, llama-server).")
        result["engine"] = {"label": engine.status()["label"], "namespace": engine.status()["namespace_short"]}
        per_token = -(-assembled_size(engine.geometry, 1024) // 1024)

        def part(name: str, run: Callable[[], list[Attributed]]) -> None:
            if name not in scenarios:
                return
            say(f"bench-misses: {name} ...")
            start = time.perf_counter()
            found = run()
            result["seconds"][name] = round(time.perf_counter() - start, 1)
            rows.extend(found)
            if progress is not None:
                progress(len(result["seconds"]), len(scenarios), name)

        part("long-context", lambda: long_context(main, engine, lengths, n_predict))
        part("doc-qa", lambda: doc_qa_small_l1(settings, make_engine, n_requests, doc_chars, n_predict,
                                               lambda p: len(engine.prepare(p).tokens), per_token))
        part("model-file", lambda: model_file(settings, make_engine, n_requests, n_predict))
        part("tenant-salt", lambda: tenant_salt(settings, n_requests, doc_chars, n_predict))
        part("redis-stop", lambda: redis_stop(settings, make_engine, n_requests, doc_chars, n_predict))
        warm = build_warm_prompt(engine, lengths, n_predict)
        result["ttft"] = warm_ttft_on_off(engine, main, warm, repeats, n_predict)
    result["rows"] = [dict(asdict(r), missed=r.missed, explained=r.explained) for r in rows]
    result["summary"] = summarize(rows)
    return result


def build_warm_prompt(engine, lengths: Sequence[int], n_predict: int):
    from kvbridge.bench.long_context import build_prompts

    return next(iter(build_prompts(engine, [max(lengths)], 1, n_predict).values()))[0]


def summarize(rows: Sequence[Attributed]) -> dict:
    misses = [r for r in rows if r.missed]
    unexplained = [f"{r.scenario} {r.label}: expected {r.expected}, got {r.reason or 'no cause'} ({r.detail})"
                   for r in misses if not r.explained]
    by_scenario: dict[str, dict] = {}
    for r in rows:
        s = by_scenario.setdefault(r.scenario, {"requests": 0, "misses": 0, "unexplained": 0, "causes": {}})
        s["requests"] += 1
        s["misses"] += r.missed
        s["unexplained"] += r.missed and not r.explained
        if r.missed:
            s["causes"][r.reason or "no cause"] = s["causes"].get(r.reason or "no cause", 0) + 1
    explain = [r.explain_ms for r in misses]
    return {"requests": len(rows), "misses": len(misses), "unexplained_misses": len(unexplained),
            "unexplained": unexplained, "unexpected_hits": [f"{r.scenario} {r.label}" for r in rows if not r.missed],
            "by_scenario": by_scenario,
            "explain_ms_on_a_miss": {"median": statistics.median(explain) if explain else None,
                                     "max": max(explain) if explain else None},
            "client_views": sorted({r.client_reason for r in rows if r.client_reason})}


# -- the report -----------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    s, t = result["summary"], result.get("ttft", {})
    lines = ["| scenario | requests | misses | causes found | unexplained | explain s |",
             "|---|---:|---:|---|---:|---:|"]
    for name, row in s["by_scenario"].items():
        causes = ", ".join(f"{k} {v}" for k, v in sorted(row["causes"].items()))
        lines.append(f"| {name} | {row['requests']} | {row['misses']} | {causes} | {row['unexplained']} | "
                     f"{result['seconds'].get(name, '-')} |")
    lines.append(f"| **all** | {s['requests']} | {s['misses']} | | **{s['unexplained_misses']}** | |")
    if t:
        lines += ["", "| warm hit, median of " + f"{t['repeats']} | KVB_EXPLAIN_MISSES=true | =false | on − off |",
                  "|---|---:|---:|---:|",
                  f"| TTFT, {t['prompt_tokens']}-token prompt | {t['on_ms']:.1f} ms | {t['off_ms']:.1f} ms | "
                  f"{t['delta_ms']:+.1f} ms (off's spread {t['off_spread_ms']:.1f} ms) |",
                  f"| store calls per hit | {t['store_calls_on']} | {t['store_calls_off']} | |"]
    cost = s["explain_ms_on_a_miss"]
    if cost["median"] is not None:
        lines += ["", f"Explaining a miss: median {cost['median']:.2f} ms, max {cost['max']:.2f} ms (explain_ms)."]
    return "\n".join(lines)


def format_bench_misses(result: dict) -> str:
    s = result["summary"]
    lines = [f"KVBridge bench-misses: {result['engine']['label']}, namespace {result['engine']['namespace']}, "
             f"chunk {result['settings']['chunk_size']}", ""]
    for row in result["rows"]:
        mark = "ok " if row["explained"] else "BAD"
        seen = f" (the client sees {row['client_reason']})" if row["client_reason"] else ""
        lines.append(f"  {mark} {row['scenario']:12} {row['label']:9} {row['matched_tokens']:>5}/{row['prompt_tokens']:<5} "
                     f"built {row['expected']:15} named {row['reason'] or '-':15}{seen} {row['detail'][:110]}")
    lines += ["", markdown(result), "",
              f"unexplained misses: {s['unexplained_misses']} of {s['misses']} (target 0)"]
    lines += [f"  {u}" for u in s["unexplained"]]
    if s["unexpected_hits"]:
        lines.append(f"built to miss but restored whole: {', '.join(s['unexpected_hits'])}")
    return "\n".join(lines)


def write_outputs(result: dict, output_dir) -> Path:
    """The JSON and, beside it with the same name, the markdown tables."""
    path = write_result_json(result, output_dir, "bench-misses")
    path.with_suffix(".md").write_text(markdown(result) + "\n", encoding="utf-8")
    return path
