"""What a preemption costs: swapping a sequence out to the store and back in, against recomputing it.

`python -m kvbridge bench-scheduler` prefills a ~2k-token sequence on the scheduler's own context
(kvbridge.backends.llama_context) and, per repeat, times interleaved in one run:

- swap: save the sequence's KV (llama_state_seq_get_data), store it as chunk and tail objects
  (SequenceStore.swap_out, the path a preemption takes), free its cells, restore it into an empty
  sequence (SequenceStore.restore + load), as a resumed request does;
- recompute: free the cells and prefill the same tokens again (what a scheduler that cannot swap,
  or llama-server after a slot is taken, pays).

Medians are reported with their ratio; no threshold is judged here (Docs/Research.md does). The
priority-burst and shared-system-prompt comparisons with llama-server, in the same command, are in
kvbridge.bench.scheduler_compare.
"""
from __future__ import annotations

import time

import numpy as np

from kvbridge.bench.common.scenarios import builtin_document
from kvbridge.settings import Settings


def bench_swap_vs_recompute(settings: Settings, prompt_tokens: int = 2048, repeats: int = 5) -> dict:
    from kvbridge.scheduler import Scheduler
    from kvbridge.backends.llama_context import BATCH_TOKENS

    # the mode off: a preemption swaps through the store there (exact mode keeps a preempted sequence in RAM)
    settings = settings.replace(sched_kv_cells=max(settings.sched_kv_cells, 2 * prompt_tokens + 256),
                                ctx_size=max(settings.ctx_size, prompt_tokens + 64), sched_exact=False)
    with Scheduler(settings) as scheduler:
        ctx, swap = scheduler._ctx, scheduler.swap
        document = builtin_document()
        tokens = ctx.tokenize(document + "\n\n" + document)[:prompt_tokens]   # the handbook is ~1.7k tokens
        seq = scheduler.seqs.free[0]

        def prefill() -> None:
            for start in range(0, len(tokens), BATCH_TOKENS):
                feed = tokens[start:start + BATCH_TOKENS]
                if ctx.decode([(t, start + i, seq, False) for i, t in enumerate(feed)]) != 0:
                    raise RuntimeError("the benchmark's prefill found no room in the KV cache")

        times: dict[str, list[float]] = {"swap_out": [], "swap_in": [], "recompute": []}
        stored_bytes = 0
        prefill()
        for repeat in range(-1, repeats):
            start = time.perf_counter()
            data = ctx.save_seq(seq)
            ticket = swap.swap_out(data, tokens)
            ctx.seq_rm(seq)
            out_ms = (time.perf_counter() - start) * 1e3
            start = time.perf_counter()
            plan = swap.restore(tokens + [tokens[-1]], ticket)   # the restore takes all but the last token given
            ctx.load_seq(seq, plan.state.data)
            in_ms = (time.perf_counter() - start) * 1e3
            ticket.release()
            if not ticket.complete or plan.matched_tokens != len(tokens):
                raise RuntimeError(f"the store did not give back the whole sequence ({plan.matched_tokens} of {len(tokens)})")
            stored_bytes = len(data)
            ctx.seq_rm(seq)
            start = time.perf_counter()
            prefill()
            recompute_ms = (time.perf_counter() - start) * 1e3
            if repeat >= 0:
                times["swap_out"].append(out_ms)
                times["swap_in"].append(in_ms)
                times["recompute"].append(recompute_ms)
        ctx.seq_rm(seq)
    ms = {name: float(np.median(values)) for name, values in times.items()}
    swap_ms = ms["swap_out"] + ms["swap_in"]
    return {"tokens": len(tokens), "bytes": stored_bytes, "repeats": repeats, **{f"{k}_ms": v for k, v in ms.items()},
            "swap_ms": swap_ms, "recompute_vs_swap": ms["recompute"] / swap_ms if swap_ms else float("inf"),
            "tiers": scheduler.store.tier_names if hasattr(scheduler.store, "tier_names") else []}


def format_swap_vs_recompute(result: dict) -> str:
    return "\n".join([
        f"swap vs recompute, a {result['tokens']}-token sequence ({result['bytes'] / 1e6:.1f} MB of KV), "
        f"medians of {result['repeats']}, interleaved:",
        f"  swap-out (save + store as chunks and tail) {result['swap_out_ms']:8.1f} ms",
        f"  swap-in  (restore + load into a sequence)  {result['swap_in_ms']:8.1f} ms",
        f"  swap total                                 {result['swap_ms']:8.1f} ms",
        f"  recompute (prefill the tokens again)       {result['recompute_ms']:8.1f} ms",
        f"  recompute / swap: {result['recompute_vs_swap']:.1f}x",
    ])
