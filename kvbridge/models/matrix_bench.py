"""What a zoo architecture's restore costs and saves, in-process: bytes per token, capture cost, TTFT.

Place in the flow: matrix.py -> **layout_facts** (every run: what the engine's layout probe found)
and, with --bench, **capture_cost** and **ttft_figures** on the same engine -> the JSON and the doc.

- bytes per token: the KV geometry's bytes_per_cell (K and V of every attention layer, per prompt
  token), plus for a recurrent or hybrid model its recurrent section (geometry.recurrent, kept once
  per chunk boundary) divided by the chunk size; both are written apart and summed.
- capture cost: a cold prefill of the same prompt with the engine's boundary captures (what lmcache
  mode adds for a recurrent model: the recurrent state copied at each chunk's end) against one without
  (the same chunk-aligned steps: every mode takes them), alternated in one run, medians of several repeats. A model without recurrent
  state captures nothing while it prefills (window rows are read after the answer).
- TTFT: cold prefill, warm restore from L1 and from L2 (after a restart that drops L1), each after
  the context was first filled with something else, and llama.cpp's own reuse (native) where it
  really reuses (under half the cold TTFT); every warm answer is checked against the cold one.
"""
from __future__ import annotations

import statistics
import time

from kvbridge.backends.base import EngineReport
from kvbridge.models.matrix_oracle import FILLER

# the stages of a warm request's TTFT (kvbridge.engine.stages), kept to tell a slow restore's cause
STAGES = ("lookup_ms", "fetch_ms", "assemble_ms", "handoff_ms", "prefill_ms", "first_token_ms")


def layout_facts(engine) -> dict:
    """The model's traits and the layout the engine decided on, with bytes per token."""
    traits, geometry, chunk = engine.traits, engine.geometry, engine.settings.chunk_size
    facts = {"model": traits.summary() if traits else "", "n_swa": traits.n_swa if traits else 0,
             "kv_layout": engine.status()["kv_layout"], "kv_refusal": engine.kv_refusal, "chunk_size": chunk}
    if geometry is not None:
        recurrent_per_token = geometry.recurrent / chunk if geometry.recurrent else 0.0
        facts["bytes_per_token"] = {
            "kv": geometry.bytes_per_cell,                       # K and V rows of one cell, every attention layer
            "recurrent_section": geometry.recurrent,             # the recurrent state kept at each chunk boundary
            "recurrent_per_token": round(recurrent_per_token, 1),   # that section over the chunk size
            "total": round(geometry.bytes_per_cell + recurrent_per_token, 1)}
    return facts


def _prefill_ms(engine, prompt, step: int) -> float:
    """One cold prefill (and the first token) with boundary captures every `step` tokens (0: none)."""
    backend = engine.backend
    backend.boundary_step = step
    report = EngineReport()
    started = time.perf_counter()
    try:
        for _ in backend.generate(prompt, n_predict=1, temperature=0.0, use_native_cache=False, report=report):
            pass
    finally:
        backend.boundary_step = 0
    return (time.perf_counter() - started) * 1000


def capture_cost(engine, prompt_text: str, repeats: int) -> dict:
    """Cold prefill with the boundary captures against without, alternated (ABBA), medians."""
    geometry = engine.geometry
    if geometry is None or not geometry.recurrent:
        return {"captures": False, "why": "no recurrent state: nothing is captured while the prompt is prefilled"}
    step = engine.settings.chunk_size
    prompt = engine.prepare(prompt_text)
    # no untimed round: ttft_figures ran before on this engine, with both kinds of prefill
    times: dict[int, list[float]] = {0: [], step: []}
    for i in range(repeats):
        for s in ((0, step) if i % 2 == 0 else (step, 0)):
            times[s].append(_prefill_ms(engine, prompt, s))
    without, with_ = statistics.median(times[0]), statistics.median(times[step])
    return {"captures": True, "prompt_tokens": len(prompt.tokens), "repeats": repeats,
            "without_ms": round(without, 1), "with_ms": round(with_, 1),
            "cost_pct": round((with_ / without - 1) * 100, 1),
            "boundaries": len(prompt.tokens) // step + 1}


def ttft_figures(engine, prompt: str, repeats: int) -> dict:
    """Median TTFTs of cold, warm (L1), warm (L2) and native, alternated in one run; checked against cold."""
    stored = engine.infer(prompt, mode="lmcache")
    if stored.error:
        return {"error": stored.error}
    runs: dict[str, list[float]] = {"cold": [], "warm_l1": [], "warm_l2": [], "native": []}
    stages: dict[str, dict[str, list[float]]] = {"warm_l1": {}, "warm_l2": {}}
    mismatches: list[str] = []
    native_reused, native_once = 0, 0.0
    cold_text = None
    prompt_tokens = stored.prompt_tokens
    for i in range(repeats):
        cold = engine.infer(prompt, mode="cold")
        cold_text = cold.text if cold_text is None else cold_text
        runs["cold"].append(cold.ttft_ms)
        if i == 0 or runs["native"]:   # a native answer that re-evaluates everything is measured once
            native = engine.infer(prompt, mode="native")   # the prompt's cells are still in the context
            native_reused = native.engine_cached_tokens or 0
            if native_reused and native.ttft_ms < cold.ttft_ms / 2:
                runs["native"].append(native.ttft_ms)
            elif i == 0:
                native_once = native.ttft_ms
        for tier, drop in (("warm_l1", False), ("warm_l2", True)):
            if drop:
                engine.restart_backend(drop_l1=True)
            engine.infer(FILLER, mode="cold")
            warm = engine.infer(prompt, mode="lmcache")
            runs[tier].append(warm.ttft_ms)
            for stage in STAGES:
                stages[tier].setdefault(stage, []).append(getattr(warm, stage))
            if warm.text != cold_text or not warm.matched_tokens:
                mismatches.append(f"{tier}: matched {warm.matched_tokens}, equal {warm.text == cold_text}")
    med = {name: round(statistics.median(v), 1) for name, v in runs.items() if v}
    out = {"prompt_tokens": prompt_tokens, "repeats": repeats, "ttft_ms": med, "native_reused_tokens": native_reused,
           "speedup_l1": round(med["cold"] / med["warm_l1"], 1), "speedup_l2": round(med["cold"] / med["warm_l2"], 1),
           "mismatches": mismatches}
    out["stages_ms"] = {tier: {stage: round(statistics.median(v), 1) for stage, v in by.items()}
                        for tier, by in stages.items()}
    # llama-cpp-python reports a matched prefix for a recurrent model too, then evaluates the whole prompt again
    # (a recurrent state cannot be cut back to re-evaluate the last token): that is no reuse to compare with
    if "native" in med:
        out["lmcache_over_native"] = round(med["warm_l1"] / med["native"], 2)
    else:
        out["native_reevaluates"] = True
        out["ttft_ms"]["native"] = round(native_once, 1)
    return out
