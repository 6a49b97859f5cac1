"""Text tables and the summary the bench prints: mean/median TTFT per mode, speedups against cold, hits, tiers."""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Sequence

from kvbridge.engine.modes import mode_names
from kvbridge.engine.records import RequestRecord
from kvbridge.engine.stages import STAGE_LABELS, STAGES, stages_gap_ms, stages_of


def engine_warm(r: RequestRecord) -> bool:
    """The engine itself reports a real reuse (a few template tokens do not count)."""
    return (r.engine_cached_tokens or 0) >= max(1, r.prompt_tokens // 10)


def holds_fact(text: str, expected: str) -> bool:
    """Whether an answer states the expected fact: the expected text appears in it, case and spacing ignored
    ("The longest tunnel is the Kessel Tunnel." holds "the Kessel Tunnel"; "23%" does not hold "23 percent")."""
    def norm(value: str) -> str:
        return " ".join(value.lower().split())

    return bool(expected.strip()) and norm(expected) in norm(text)


def is_warm(r: RequestRecord) -> bool:
    return r.matched_tokens > 0 or (r.mode == "native" and engine_warm(r))


def summarize(records: Sequence[RequestRecord]) -> dict:
    """Per mode: mean and median TTFT, speedups against cold, warm-hit medians and hit rates (plain numbers)."""
    out: dict = {}
    ok = [r for r in records if not r.error]
    by_mode = {m: [r for r in ok if r.mode == m] for m in mode_names() if any(r.mode == m for r in ok)}
    for mode, rs in by_mode.items():
        ttfts = [r.ttft_ms for r in rs]
        warm = [r for r in rs if is_warm(r)]
        out[mode] = {
            "requests": len(rs),
            "mean_ttft_ms": statistics.fmean(ttfts),
            "median_ttft_ms": statistics.median(ttfts),
            "warm_requests": len(warm),
            "median_warm_ttft_ms": statistics.median([r.ttft_ms for r in warm]) if warm else None,
            "tiers": dict(Counter(r.tier for r in rs)),
            "reused_tokens": sum(r.matched_tokens for r in rs),
            "prompt_tokens": sum(r.prompt_tokens for r in rs),
            "engine_cached_tokens": sum(r.engine_cached_tokens or 0 for r in rs),
        }
    cold = out.get("cold")
    if cold:
        for mode, s in out.items():
            s["mean_speedup_vs_cold"] = cold["mean_ttft_ms"] / s["mean_ttft_ms"] if s["mean_ttft_ms"] else None
            # warm hits against cold on the same requests (request_index pairs them)
            cold_by_index = {r.request_index: r.ttft_ms for r in by_mode["cold"]}
            pairs = [cold_by_index[r.request_index] / r.ttft_ms for r in by_mode[mode]
                     if r.request_index in cold_by_index and r.ttft_ms > 0 and is_warm(r)]
            s["median_warm_speedup_vs_cold"] = statistics.median(pairs) if pairs else None
        # the oracle: the same answer as cold to the same request (blend is approximate by design)
        cold_text = {r.request_index: r.text for r in by_mode["cold"]}
        for mode, rs in by_mode.items():
            compared = [r.text == cold_text[r.request_index] for r in rs if r.request_index in cold_text]
            if mode != "cold" and compared:
                out[mode]["answers_equal_cold"] = {"equal": sum(compared), "compared": len(compared)}
    for mode, rs in by_mode.items():   # task quality where the scenario knows the answer (rag)
        judged = [holds_fact(r.text, r.expected) for r in rs if r.expected]
        if judged:
            out[mode]["answers_with_fact"] = {"holding": sum(judged), "judged": len(judged)}
    shadow = [r for r in by_mode.get("lmcache", []) if r.predicted_reuse_tokens is not None
              and r.engine_cached_tokens is not None]
    if shadow and "lmcache" in out:
        # shadow engines: how well our prediction matches the engine's own count (within 5% of the prompt)
        agree = [abs(r.predicted_reuse_tokens - r.engine_cached_tokens) <= max(1, r.prompt_tokens // 20) for r in shadow]
        out["lmcache"]["prediction_agreement"] = {
            "requests": len(shadow), "agreeing": sum(agree),
            "mean_abs_diff_tokens": statistics.fmean(abs(r.predicted_reuse_tokens - r.engine_cached_tokens) for r in shadow)}
    for mode, rs in by_mode.items():   # where each mode's time to the first token goes, warm requests if any
        chosen = [r for r in rs if is_warm(r)] or rs
        out[mode]["median_stages_ms"] = {stage: statistics.median(stages_of(r)[stage] for r in chosen)
                                         for stage in STAGES}
        out[mode]["median_unstaged_ms"] = statistics.median(stages_gap_ms(r) for r in chosen)
    native, lm = out.get("native"), out.get("lmcache")
    if native and lm and native.get("median_warm_ttft_ms") and lm.get("median_warm_ttft_ms"):
        lm["warm_vs_native"] = lm["median_warm_ttft_ms"] / native["median_warm_ttft_ms"]
    return out


def fmt(value, spec: str = ".1f", suffix: str = "") -> str:
    """A figure for a text table; "-" where there is none."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def median_or_none(values) -> float | None:
    """The median of the values that are there (None left out); None when there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def format_table(records: Sequence[RequestRecord]) -> str:
    head = f"{'mode':8} {'#':>3} {'prompt':>6} {'reused':>6} {'tier':4} {'prefill':>7} {'lookup':>7} {'restore':>8} " \
           f"{'TTFT ms':>9} {'eng.cached':>10} {'store ms':>8}  notes / answer"
    lines = [head, "-" * len(head)]
    for r in records:
        tail = r.error or r.notes or r.text.strip().replace("\n", " ")
        lines.append(f"{r.mode:8} {r.request_index:>3} {r.prompt_tokens:>6} {r.matched_tokens:>6} {r.tier:4} "
                     f"{r.prefill_tokens:>7} {r.lookup_ms:>7.1f} {r.restore_ms:>8.1f} {r.ttft_ms:>9.1f} "
                     f"{fmt(r.engine_cached_tokens, 'd'):>10} {r.store_ms:>8.1f}  {tail[:60]}")
    return "\n".join(lines)


def format_summary(summary: dict) -> str:
    lines = ["", "summary (TTFT):"]
    for mode, s in summary.items():
        line = (f"  {mode:8} mean {s['mean_ttft_ms']:9.1f} ms  median {s['median_ttft_ms']:9.1f} ms  "
                f"warm median {fmt(s['median_warm_ttft_ms'], '.1f', ' ms'):>10}  "
                f"hits {s['warm_requests']}/{s['requests']}  tiers {s['tiers']}")
        if "mean_speedup_vs_cold" in s and mode != "cold":
            line += (f"\n           speedup vs cold: mean {fmt(s['mean_speedup_vs_cold'], '.1f', 'x')}, "
                     f"warm median {fmt(s['median_warm_speedup_vs_cold'], '.1f', 'x')}")
        if "answers_equal_cold" in s:
            a = s["answers_equal_cold"]
            line += f"\n           answers = cold: {a['equal']}/{a['compared']}"
        if "answers_with_fact" in s:
            a = s["answers_with_fact"]
            line += f"\n           answers stating the expected fact: {a['holding']}/{a['judged']}"
        if "warm_vs_native" in s:
            line += f"; warm median vs native {s['warm_vs_native']:.2f}x"
        if "prediction_agreement" in s:
            a = s["prediction_agreement"]
            line += (f"\n           shadow: predicted reuse agrees with the engine's cached-token count on "
                     f"{a['agreeing']}/{a['requests']} requests (mean |difference| {a['mean_abs_diff_tokens']:.0f} tokens)")
        lines.append(line)
    return "\n".join(lines)


def plain_copy_ms(source, repeats: int = 5) -> float:
    """ms of the fastest of `repeats` copies of `source` (a uint8 numpy array) into one buffer already
    touched: the floor a restore is held to. The engine's KV buffer and our assembly buffer are both
    resident, so a copy into fresh memory (which pays a page fault per 4 KiB: 392 ms where this takes
    30 ms for 175 MB) would flatter every restore measured against it.
    """
    import numpy as np

    target = np.empty_like(source)
    target.fill(1)   # every page touched before the timing
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, (time.perf_counter() - start) * 1000)
    return best


def stored_prefix(engine, prompt_tokens: int = 2048):
    """Store a prompt of the built-in document whose restore gives `prompt_tokens` tokens (a multiple of 8: a
    restore leaves the engine its cut rule's last min_rows tokens, kvbridge.engine.cold_cut); (record, tokens, hashes) of it.

    The engine still holds the prompt afterwards, so a caller can save its state again (bench-restore
    stores the same cells through a cache server as well).
    """
    from kvbridge.bench.common.scenarios import builtin_document

    backend = engine.backend
    tokens = backend.tokenize(builtin_document())
    left = engine.cut_rule.min_rows   # what the engine's restores leave it to compute (its cut rule)
    while len(tokens) < prompt_tokens + left:
        tokens = tokens + tokens
    tokens = tokens[: prompt_tokens + left]
    record = engine.infer(backend.detokenize(tokens), mode="lmcache", n_predict=1)  # stores the prefix
    prompt = engine.prepare(backend.detokenize(tokens))
    tokens = list(prompt.tokens)
    return record, tokens, engine.hasher.chunk_hashes(tokens)


def bench_restore(engine, prompt_tokens: int = 2048, repeats: int = 7) -> dict:
    """Restore of a stored prefix (lookup + fetch + assemble + set) against a plain copy of the same bytes.

    Both are timed alternately in one run so machine noise hits them alike; medians are reported.
    """
    import time

    import numpy as np

    backend = engine.backend
    record, tokens, hashes = stored_prefix(engine, prompt_tokens)
    restore_ms, copy_ms, state_bytes = [], [], 0
    engine._kv.hot_restores = False   # every repeat reads and assembles (a hot restore is bench-floor's)
    for _ in range(repeats):
        t = time.perf_counter()
        plan = engine._kv.plan_restore(tokens, hashes, buffer_for=backend.state_buffer)  # always rebuilt here
        backend.restore_state(plan.state, plan.tokens)
        restore_ms.append((time.perf_counter() - t) * 1000)
        state_bytes = len(plan.state.data)
        copy_ms.append(plain_copy_ms(np.frombuffer(bytes(plan.state.data), dtype=np.uint8)))
        backend.reset_native_cache()
    engine._kv.hot_restores = True
    restore = statistics.median(restore_ms)
    copy = statistics.median(copy_ms)
    return {"restored_tokens": plan.matched_tokens, "state_bytes": state_bytes, "restore_ms": restore,
            "memcpy_ms": copy, "ratio": restore / copy if copy else None, "first_record_error": record.error}


def write_result_json(result: dict, output_dir, name: str) -> Path:
    """A bench's whole result as JSON in output_dir: kvbridge-<name>-<time>.json (dataclasses, sets
    and numpy scalars made plain)."""
    def plain(value):
        if dataclasses.is_dataclass(value):
            return dataclasses.asdict(value)
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        if hasattr(value, "item"):    # numpy scalars
            return value.item()
        raise TypeError(f"{type(value).__name__} is not JSON")

    folder = Path(output_dir).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"kvbridge-{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, default=plain, indent=1), encoding="utf-8")
    return path


def format_stages(summary: dict) -> str:
    """Median ms per stage and mode (warm requests where there are any): native's row is the floor a
    warm restore is measured against, and the last line says which stages make up the difference."""
    rows = {mode: s for mode, s in summary.items() if isinstance(s, dict) and "median_stages_ms" in s}
    if not rows:
        return ""
    used = [stage for stage in STAGES if any(s["median_stages_ms"][stage] >= 0.05 for s in rows.values())]
    width = {stage: max(7, len(STAGE_LABELS[stage])) for stage in used}
    head = f"  {'mode':8}" + "".join(f" {STAGE_LABELS[stage]:>{width[stage]}}" for stage in used) + f" {'other':>7} {'TTFT':>8}"
    lines = ["", "where the time to the first token goes (median ms, warm requests; native is the floor):", head]
    for mode, s in rows.items():
        stages = s["median_stages_ms"]
        ttft = s["median_warm_ttft_ms"] or s["median_ttft_ms"]
        lines.append(f"  {mode:8}" + "".join(f" {stages[stage]:>{width[stage]}.1f}" for stage in used)
                     + f" {s['median_unstaged_ms']:>7.1f} {ttft:>8.1f}")
    native, lm = rows.get("native"), rows.get("lmcache")
    if native and lm:
        over = {stage: lm["median_stages_ms"][stage] - native["median_stages_ms"][stage] for stage in used}
        biggest = sorted(over.items(), key=lambda item: -item[1])[:4]
        lines.append("  lmcache over native: " + ", ".join(f"{STAGE_LABELS[stage]} {ms:+.1f} ms" for stage, ms in biggest))
    return "\n".join(lines)
