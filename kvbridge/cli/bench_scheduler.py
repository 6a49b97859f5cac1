"""`kvbridge bench-scheduler`: the scheduler against llama-server on a priority burst and a shared system
prompt, and a swap out and back in against recomputing."""
from __future__ import annotations

import tempfile

from kvbridge.bench.registry import bench_command
from kvbridge.cli.command import Command
from kvbridge.cli.common import settings_from


def add_arguments(p) -> None:
    p.add_argument("--parts", default="swap,burst,shared",
                   help="comma-separated: swap, burst, shared (default all three); burst and shared start "
                        "a private llama-server on a free loopback port, stopped after the run")
    p.add_argument("--tokens", type=int, default=2048, help="swap: sequence length (default 2048)")
    p.add_argument("--repeats", type=int, default=5, help="swap: swaps and recomputes, alternated (medians)")
    p.add_argument("--document-tokens", dest="document_tokens", type=int, default=600,
                   help="burst: at least this many tokens of manual per low chat (whole sections; default 600)")
    p.add_argument("--low", type=int, default=3, help="burst: low-priority document chats (default 3)")
    p.add_argument("--urgent", type=int, default=2, help="burst: urgent short requests (default 2)")
    p.add_argument("--low-predict", dest="low_predict", type=int, default=200,
                   help="burst: tokens each low chat generates (default 200)")
    p.add_argument("--urgent-predict", dest="urgent_predict", type=int, default=24,
                   help="burst: tokens each urgent request generates (default 24)")
    p.add_argument("--urgent-at", dest="urgent_at", type=float, default=2.0,
                   help="burst: seconds after the start the first urgent request arrives (default 2)")
    p.add_argument("--exact", action="store_true",
                   help="burst and shared: run the scheduler again with KVB_SCHED_EXACT=1 (flash attention off) and "
                        "check every answer of both modes against the same request run alone")
    p.add_argument("--users", type=int, default=8, help="shared: users behind one system prompt (default 8)")
    p.add_argument("--user-predict", dest="user_predict", type=int, default=24,
                   help="shared: tokens each user's answer generates (default 24)")


def run(args) -> int:
    from kvbridge.bench.scheduler_compare import PARTS, run_bench_scheduler
    from kvbridge.bench.scheduler_report import format_bench_scheduler, write_json

    settings = settings_from(args)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise SystemExit(f"Unknown part(s) {', '.join(unknown) or '(none given)'}; use any of {', '.join(PARTS)}.")
    burst = dict(document_tokens=args.document_tokens, n_low=args.low, n_urgent=args.urgent,
                 low_predict=args.low_predict, urgent_predict=args.urgent_predict, urgent_at_s=args.urgent_at)
    shared = dict(n_users=args.users, n_predict=args.user_predict)
    with tempfile.TemporaryDirectory(prefix="kvb-bench-sched-") as l2_dir:   # a fresh store, not the user's
        result = run_bench_scheduler(settings.replace(l2_dir=l2_dir), parts,
                                     swap=dict(prompt_tokens=args.tokens, repeats=args.repeats),
                                     burst=burst, shared=shared, exact=args.exact)
    print(format_bench_scheduler(result))
    print(f"wrote {write_json(result, settings.output_dir)}")
    failed = [r for part in ("burst", "shared") if part in result for name, run in result[part]["runs"].items()
              if name != "llama-server" for r in run["requests"] if r["error"]]
    return 1 if failed else 0


COMMAND = Command("bench-scheduler", bench_command("bench-scheduler").measures, run, add_arguments)
