"""bench-floor: how far a warm restore is above its floor, on every path and model, in one run.

The floor of a warm lmcache request is the engine's own warm path (native: the engine's context
already holds the document, only the question is prefilled) plus one copy of the restored KV bytes
into memory already touched (`report.plain_copy_ms`). Per path, side by side in one run:

- in-process: CachedEngine on llama.cpp in this process, the embedded store (L1 hits);
- llama-server: the same through the llama-server KVBridge builds (slot files);
- cache-server: in-process, the store a private cache server process (`KVB_STORE_URL`);
- l3: in-process, every hit from a private loopback redis-server (L1 and L2 emptied before each
  lmcache request, `runner.empty_faster_tiers`);
- long-context: in-process, the ~7.6k-token ledger of the long-context scenario.

Document Q&A (~1.9k tokens) for the first four; the cold pass runs once per model (in-process) and
is the oracle every path's lmcache answers are compared with, token for token. Each path reports
the median warm TTFT of native and lmcache, their ratio against the issue's target, the floor
(native + one copy), the restore (lookup + fetch + assemble + handoff) against one copy, and the
median stage times, so the overhead above the floor has a name. `--runs N` repeats everything and
reports the median of the runs' ratios.

    python -m kvbridge bench-floor                                  # every path, both models, 3 runs
    python -m kvbridge bench-floor --paths in-process,llama-server --models smollm2-135m --runs 1
"""
from __future__ import annotations

import contextlib
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from kvbridge.bench.common.report import fmt, is_warm, median_or_none, plain_copy_ms, ratio
from kvbridge.bench.common.runner import empty_faster_tiers, run_interleaved, run_scenario
from kvbridge.engine.records import RequestRecord
from kvbridge.engine.stages import STAGES, stages_of
from kvbridge.errors import BadSettings
from kvbridge.settings import Settings
from kvbridge.settings.models import EMBEDDED_MODELS

PATHS = ("in-process", "llama-server", "cache-server", "l3", "long-context")
TARGETS = {"in-process": 1.2, "llama-server": 1.2, "cache-server": 1.25, "l3": 1.5, "long-context": 1.2}
COPY_TARGET = 1.3          # a restore against one plain copy of the same bytes, from 2k tokens up
LONG_CONTEXT_TOKENS = 7600
Say = Callable[[str], None]


@dataclass
class PathResult:
    path: str
    model: str
    run: int
    native_ms: float | None = None       # median warm TTFT, native
    lmcache_ms: float | None = None      # median warm TTFT, lmcache (hits only)
    restore_ms: float | None = None      # median lookup + fetch + assemble + handoff of the hits
    copy_ms: float | None = None         # one copy of the median restored bytes into touched memory
    restored_bytes: int = 0
    hits: int = 0
    requests: int = 0
    answers_equal: int = 0
    answers_compared: int = 0
    stages: dict = field(default_factory=dict)   # {"native": {stage: ms}, "lmcache": {stage: ms}}
    profile: str = ""                    # one more warm lmcache request under cProfile (--profile)
    error: str = ""

    @property
    def ratio(self) -> float | None:
        return ratio(self.lmcache_ms, self.native_ms)

    @property
    def floor_ms(self) -> float | None:
        return None if self.native_ms is None or self.copy_ms is None else self.native_ms + self.copy_ms

    @property
    def restore_vs_copy(self) -> float | None:
        return ratio(self.restore_ms, self.copy_ms)

    def to_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "floor_ms": self.floor_ms, "restore_vs_copy": self.restore_vs_copy}


def summarise_records(result: PathResult, records: Sequence[RequestRecord], geometry,
                      cold_texts: dict[int, str]) -> PathResult:
    """Fill `result` from one path's records: warm medians, restore, the copy it is held to, stages, oracle."""
    from kvbridge.formats.llama_chunks import assembled_size

    done = [r for r in records if not r.error]
    native = [r for r in done if r.mode == "native" and is_warm(r)]
    hits = [r for r in done if r.mode == "lmcache" and r.matched_tokens and r.restore_ok]
    result.requests = sum(1 for r in records if r.mode == "lmcache")
    result.hits = len(hits)
    result.native_ms = median_or_none([r.ttft_ms for r in native])
    result.lmcache_ms = median_or_none([r.ttft_ms for r in hits])
    result.restore_ms = median_or_none([r.lookup_ms + r.fetch_ms + r.assemble_ms + r.handoff_ms for r in hits])
    if hits and geometry is not None:
        result.restored_bytes = int(statistics.median(assembled_size(geometry, r.matched_tokens) for r in hits))
        result.copy_ms = plain_copy_ms(np.ones(result.restored_bytes, dtype=np.uint8))
    for mode, chosen in (("native", native), ("lmcache", hits)):
        if chosen:
            result.stages[mode] = {stage: statistics.median(stages_of(r)[stage] for r in chosen) for stage in STAGES}
    compared = [r for r in done if r.mode == "lmcache" and r.request_index in cold_texts]
    result.answers_compared = len(compared)
    result.answers_equal = sum(1 for r in compared if r.text == cold_texts[r.request_index])
    errors = [r.error for r in records if r.error]
    result.error = "; ".join(errors[:3])
    return result


# -- the paths -------------------------------------------------------------------------------------
@contextlib.contextmanager
def _engine(settings: Settings, engine_kind: str, store=None) -> Iterator:
    from kvbridge.backends import make_backend
    from kvbridge.engine.cached_engine import CachedEngine

    with CachedEngine(settings, make_backend(engine_kind, settings), store) as engine:
        yield engine


@contextlib.contextmanager
def path_engine(path: str, settings: Settings, workdir: Path) -> Iterator:
    """(engine, before_request) for a path: its backend and store, private servers started and stopped."""
    settings = settings.replace(l2_dir=str(workdir / f"l2-{path}"))
    if path in ("in-process", "long-context"):
        with _engine(settings, "llama.cpp") as engine:
            yield engine, None
    elif path == "llama-server":
        with _engine(settings, "llama-server") as engine:
            yield engine, None
    elif path == "cache-server":
        from kvbridge.bench.common.private_server import private_cache_server

        with private_cache_server(settings.replace(l2_dir=str(workdir / "cs-l2"))) as server, \
                _engine(server.engine_settings.replace(l2_dir=settings.l2_dir), "llama.cpp") as engine:
            yield engine, None
    elif path == "l3":
        from kvbridge.bench.common.private_redis import private_redis
        from kvbridge.store import TieredStore

        with private_redis() as redis:
            l3 = settings.replace(l3_url=redis.url, l3_prefix="kvb-bench-floor")
            with _engine(l3, "llama.cpp", TieredStore.from_settings(l3)) as engine:
                yield engine, empty_faster_tiers(engine.store, "L3")
    else:
        raise BadSettings(f"unknown path {path!r}; paths are {', '.join(PATHS)}")


def profile_request(engine, messages, before=None, top: int = 14, sort: str = "tottime") -> str:
    """One warm lmcache request under the standard profiler: the functions that took the most time
    of their own, with the record's stages above them."""
    import cProfile
    import io
    import pstats

    if before is not None:
        before("lmcache")
    profiler = cProfile.Profile()
    profiler.enable()
    record = engine.infer(list(messages), mode="lmcache", n_predict=1)   # the way to the first token, and the store
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats(sort).print_stats(top)
    stages = ", ".join(f"{stage} {ms:.1f}" for stage, ms in stages_of(record).items() if ms >= 0.05)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return (f"TTFT {record.ttft_ms:.1f} ms, restored {record.matched_tokens} tokens from {record.tier}: {stages}\n"
            + "\n".join(lines[start:]))


def run_path(path: str, settings: Settings, model: str, run: int, workdir: Path, cold_texts: dict[int, str],
             n_requests: int | None, long_tokens: int, say: Say, document: str | None = None,
             profile: bool = False, interleave: bool = True) -> PathResult:
    """One path on one model; fills cold_texts (the oracle) when it is empty and the path is doc-qa.

    interleave: native and lmcache each on an engine of their own, taking turns question by question
    (runner.run_interleaved); False: one engine, all of native's questions and then lmcache's."""
    from kvbridge.bench.long_context import (DEFAULT_WARM_REPEATS, build_prompts, length_rows, run_long_context,
                                             settings_for)

    result = PathResult(path, model, run)
    if path == "long-context":
        settings = settings_for(settings, [long_tokens])
    with path_engine(path, settings, workdir) as (engine, before):
        if path == "long-context":
            records = list(run_long_context(engine, ["native", "lmcache", "cold"], lengths=[long_tokens],
                                            progress=_progress(say, path)))
            summarise_records(result, [r for r in records if r.phase != "fill"], engine.geometry, {})
            matches = length_rows(records)[0].lmcache_matches_cold   # lmcache's answer to question 1 = cold's
            result.answers_compared, result.answers_equal = int(matches is not None), int(bool(matches))
            if profile:   # question 1 of the run's own prompts
                prompts = build_prompts(engine, [long_tokens], DEFAULT_WARM_REPEATS + 1, engine.settings.n_predict)
                result.profile = profile_request(engine, next(iter(prompts.values()))[1])
            return result
        if not cold_texts:   # the oracle, once per model: its timings are not compared
            cold = list(run_scenario(engine, "doc-qa", ["cold"], n_requests=n_requests, document=document,
                                     progress=_progress(say, path)))
            cold_texts.update({r.request_index: r.text for r in cold if not r.error})
        if interleave:
            with path_engine(path, settings, workdir / "native") as (native_engine, _):
                records = list(run_interleaved({"native": native_engine, "lmcache": engine}, "doc-qa",
                                               n_requests=n_requests, document=document,
                                               progress=_progress(say, path), before_request={"lmcache": before}))
        else:
            records = list(run_scenario(engine, "doc-qa", ["native", "lmcache"], n_requests=n_requests,
                                        document=document, progress=_progress(say, path), before_request=before))
        summarise_records(result, records, engine.geometry, cold_texts)
        if profile:
            from kvbridge.bench.common.scenarios import build_requests

            last = [r for r in build_requests("doc-qa", n_requests, document) if r.action != "restart"][-1]
            result.profile = profile_request(engine, last.messages, before)
        return result


def _progress(say: Say, path: str):
    def progress(done: int, total: int, what: str) -> None:
        if done == total or done % 6 == 0:
            say(f"  {path}: {done}/{total} {what}")
    return progress


def run_floor_bench(settings: Settings, paths: Sequence[str] = PATHS, models: Sequence[str] | None = None,
                    runs: int = 3, n_requests: int | None = None, long_tokens: int = LONG_CONTEXT_TOKENS,
                    document: str | None = None, profile: bool = False, say: Say = print,
                    interleave: bool = True) -> dict:
    """Every path on every model, `runs` times; {"results": [PathResult dicts], "table": [median rows]}."""
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise BadSettings(f"unknown path(s) {', '.join(unknown)} (--paths); paths are {', '.join(PATHS)}")
    models = list(models or EMBEDDED_MODELS)
    bad = [m for m in models if m not in EMBEDDED_MODELS]
    if bad:
        raise BadSettings(f"unknown model(s) {', '.join(bad)} (--models); models are {', '.join(EMBEDDED_MODELS)}")
    results: list[PathResult] = []
    with tempfile.TemporaryDirectory(prefix="kvb-bench-floor-") as tmp:
        for model in models:
            model_settings = settings.replace(model=model, model_path="")
            cold_texts: dict[int, str] = {}
            for run in range(1, runs + 1):
                for path in paths:
                    say(f"{model}, run {run}/{runs}: {path}")
                    workdir = Path(tmp) / f"{model}-{run}-{path}"
                    workdir.mkdir(parents=True)
                    try:
                        results.append(run_path(path, model_settings, model, run, workdir, cold_texts, n_requests,
                                                long_tokens, say, document, profile and run == 1, interleave))
                    except Exception as exc:   # one path's failure is a row, not the end of the run
                        results.append(PathResult(path, model, run, error=f"{type(exc).__name__}: {exc}"))
    return {"results": [r.to_dict() for r in results], "table": median_rows(results)}


def median_rows(results: Sequence[PathResult]) -> list[dict]:
    """Per (model, path): the median over runs of each figure (the ratios are medians of the runs' ratios)."""
    rows = []
    keys = list(dict.fromkeys((r.model, r.path) for r in results))
    for model, path in keys:
        mine = [r for r in results if (r.model, r.path) == (model, path)]
        ok = [r for r in mine if not r.error and r.hits]
        stages = {}
        for mode in ("native", "lmcache"):
            per_run = [r.stages[mode] for r in ok if mode in r.stages]
            if per_run:
                stages[mode] = {stage: statistics.median(s[stage] for s in per_run) for stage in STAGES}
        rows.append({
            "model": model, "path": path, "runs": len(mine), "ok_runs": len(ok),
            "native_ms": median_or_none([r.native_ms for r in ok]), "lmcache_ms": median_or_none([r.lmcache_ms for r in ok]),
            "ratio": median_or_none([r.ratio for r in ok]), "target": TARGETS[path],
            "floor_ms": median_or_none([r.floor_ms for r in ok]), "restore_ms": median_or_none([r.restore_ms for r in ok]),
            "copy_ms": median_or_none([r.copy_ms for r in ok]), "restore_vs_copy": median_or_none([r.restore_vs_copy for r in ok]),
            "restored_bytes": int(median_or_none([r.restored_bytes for r in ok]) or 0),
            "answers_equal": sum(r.answers_equal for r in ok), "answers_compared": sum(r.answers_compared for r in ok),
            "stages": stages, "errors": [r.error for r in mine if r.error],
            "profile": next((r.profile for r in mine if r.profile), ""),
        })
    return rows


def format_floor(result: dict) -> str:
    head = (f"{'model':14} {'path':13} {'native':>8} {'lmcache':>8} {'÷native':>8} {'target':>6} {'floor':>8} "
            f"{'÷floor':>7} {'restore':>8} {'copy':>7} {'÷copy':>6} {'MB':>6} {'answers':>8}")
    lines = ["warm TTFT medians (ms); floor = native + one copy of the restored bytes into touched memory", head,
             "-" * len(head)]
    for row in result["table"]:
        met = "" if row["ratio"] is None else (" ok" if row["ratio"] <= row["target"] else " NO")
        lines.append(f"{row['model']:14} {row['path']:13} {fmt(row['native_ms']):>8} {fmt(row['lmcache_ms']):>8} "
                     f"{fmt(row['ratio'], '.2f'):>8} {row['target']:>6.2f}{met:3} {fmt(row['floor_ms']):>5} "
                     f"{fmt(ratio(row['lmcache_ms'], row['floor_ms']), '.2f'):>7} {fmt(row['restore_ms']):>8} "
                     f"{fmt(row['copy_ms']):>7} {fmt(row['restore_vs_copy'], '.2f'):>6} "
                     f"{row['restored_bytes'] / 1e6:>6.1f} {row['answers_equal']:>4}/{row['answers_compared']:<3}")
        for error in row["errors"][:2]:
            lines.append(f"    error: {error[:150]}")
    lines += ["", "median ms per stage of the warm requests (lmcache; native in brackets):"]
    for row in result["table"]:
        lm, nat = row["stages"].get("lmcache"), row["stages"].get("native", {})
        if lm:
            parts = [f"{stage} {lm[stage]:.1f}" + (f" [{nat[stage]:.1f}]" if nat.get(stage) else "")
                     for stage in STAGES if lm[stage] >= 0.05 or nat.get(stage, 0) >= 0.05]
            lines.append(f"  {row['model']:14} {row['path']:13} " + ", ".join(parts))
    for row in result["table"]:
        if row.get("profile"):
            lines += ["", f"profile of one warm lmcache request, {row['model']} {row['path']} (cProfile, by own time):",
                      *("  " + line for line in row["profile"].splitlines())]
    return "\n".join(lines)
