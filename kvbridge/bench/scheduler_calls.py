"""Where exact mode's throughput goes: llama_decode calls, their rows and their time, per mode, on one workload.

`python -m kvbridge.bench.scheduler_calls [shared|burst]` runs bench-scheduler's workload (kvbridge.bench.common.
scheduler_workloads) on our scheduler three times, one after another: exact mode, the mode off on exact mode's
kernels (flash attention off) and the mode off on its default kernels (flash attention on), and prints per run
its wall time and its llama_decode calls split into decode-only calls (every row one sequence's next token) and
calls with prefill rows, with the rows and seconds of each. No target is judged (Docs/Research.md §29 reads it);
the machine is shared, so compare the runs of one invocation only.
"""
from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter

from kvbridge.backends import llama_context
from kvbridge.bench.common.scheduler_workloads import priority_burst, shared_system_prompt
from kvbridge.bench.scheduler_compare import run_scheduler
from kvbridge.settings import Settings

RUNS = (("exact", dict(exact=True)), ("mode off, flash attention off", dict(flash_attn=False)),
        ("mode off, flash attention on", {}))


def count_calls(settings: Settings, workload) -> list[dict]:
    """Each of RUNS on `workload`: wall seconds, and calls / rows / seconds of decode-only and prefill calls."""
    calls, rows, spent = Counter(), Counter(), Counter()
    original = llama_context.LlamaContext.decode

    def timed(self, entries):
        began = time.perf_counter()
        rc = original(self, entries)
        kind = "decode" if all(e[3] for e in entries) and len({e[2] for e in entries}) == len(entries) else "prefill"
        calls[kind] += 1
        rows[kind] += len(entries)
        spent[kind] += time.perf_counter() - began
        return rc

    out = []
    llama_context.LlamaContext.decode = timed
    try:
        for name, options in RUNS:
            calls.clear(), rows.clear(), spent.clear()
            began = time.perf_counter()
            run = run_scheduler(workload, settings, **options)
            out.append({"run": name, "wall_s": time.perf_counter() - began,
                        "gen_tokens": sum(r.gen_tokens for r in run.requests),
                        **{f"{kind}_{what}": value for kind in ("decode", "prefill")
                           for what, value in (("calls", calls[kind]), ("rows", rows[kind]),
                                               ("s", round(spent[kind], 2)))}})
    finally:
        llama_context.LlamaContext.decode = original
    return out


def main(argv: list[str] | None = None) -> int:
    which = (argv if argv is not None else sys.argv[1:]) or ["shared"]
    workload = {"shared": shared_system_prompt, "burst": priority_burst}[which[0]]()
    with tempfile.TemporaryDirectory(prefix="kvb-scheduler-calls-") as l2:   # nothing from an earlier run is found
        rows = count_calls(Settings.from_env().replace(l2_dir=l2), workload)
    for row in rows:
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
