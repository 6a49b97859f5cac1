"""Exact mode's reuse with the cut probe's verdict against its grid of 32, side by side (issue 47 §1).

`python -m kvbridge.bench.probes.exact_cut_probe [--requests 8] [--n-predict 16]`

Two schedulers in exact mode on the configured model, one store each (memory): one whose cut is the verdict
for this model, build and CPU (kvbridge.engine.cut_verdicts: what serve runs), one held to ALIGN_RULE (the grid
of 32 leaving 32, what it ran before). Document Q&A on the built-in handbook: the first question fills each
store, then each question goes to both schedulers in turn (which first alternates). Per warm request: the
prompt tokens each reused and computed, TTFT, and whether the two greedy answers are equal (both are exact, so
they must be). Prints medians and the ratio. The machine's load is printed: measure on a quiet one.
"""
from __future__ import annotations

import os
import statistics
import time

from kvbridge.bench.common.scenarios import build_requests
from kvbridge.scheduler import Scheduler, exact
from kvbridge.settings import Settings
from kvbridge.settings.cmdline import Parser
from kvbridge.store import TieredStore
from kvbridge.store.tiers import MemoryTier


def scheduler(settings: Settings, align_only: bool) -> Scheduler:
    real = exact.cut_rule
    if align_only:   # this scheduler only: the rule it took before verdicts reached exact mode
        exact.cut_rule = lambda verdict: exact.ALIGN_RULE
    try:
        return Scheduler(settings, store=TieredStore([MemoryTier(512 << 20)]))
    finally:
        exact.cut_rule = real


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m kvbridge.bench.probes.exact_cut_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--n-predict", type=int, default=16)
    args = parser.parse_args(argv)
    settings = Settings.from_env().replace(sched_exact=True, flash_attn=False, sched_cached_prefixes=0)
    requests = build_requests("doc-qa", args.requests + 1)
    verdict, align = scheduler(settings, False), scheduler(settings, True)
    print(f"load {os.getloadavg()[0]:.1f}; verdict: {verdict.cut_rule.describe()}; other: {align.cut_rule.describe()}")
    rows = {"verdict": [], "grid of 32": []}
    try:
        for i, request in enumerate(requests):
            pair = [("verdict", verdict), ("grid of 32", align)]
            answers = {}
            for name, sched in (pair if i % 2 else pair[::-1]):
                record = sched.submit(list(request.messages), n_predict=args.n_predict).result(timeout=600)
                assert sched.drain(120)
                assert not record.error, record.error
                answers[name] = record.text
                if i:
                    rows[name].append((record.ttft_ms, record.prompt_tokens - record.prefill_tokens,
                                       record.prompt_tokens))
            if i:
                same = len(set(answers.values())) == 1
                print(f"q{i}: " + "  ".join(f"{n} reused {rows[n][-1][1]} of {rows[n][-1][2]}, TTFT {rows[n][-1][0]:.0f} ms"
                                            for n in rows) + f"  answers equal: {same}")
        med = {n: statistics.median(r[0] for r in rows[n]) for n in rows}
        computed = {n: statistics.median(r[2] - r[1] for r in rows[n]) for n in rows}
        print(f"median TTFT: verdict {med['verdict']:.1f} ms, grid of 32 {med['grid of 32']:.1f} ms, "
              f"ratio {med['verdict'] / med['grid of 32']:.2f}; median tokens computed {computed['verdict']:.0f} "
              f"against {computed['grid of 32']:.0f}; load {os.getloadavg()[0]:.1f} at {time.strftime('%H:%M')}")
    finally:
        verdict.close()
        align.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
