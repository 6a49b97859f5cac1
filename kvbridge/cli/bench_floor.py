"""`kvbridge bench-floor`: warm restores against their floor (native + one copy) on every path and model."""
from __future__ import annotations

from kvbridge.bench.registry import bench_command
from kvbridge.cli.command import Command
from kvbridge.cli.common import settings_from


def add_arguments(p) -> None:
    p.add_argument("--paths", help="comma-separated: in-process, llama-server, cache-server, l3, long-context "
                                   "(default all)")
    p.add_argument("--models", help="comma-separated embedded models (default: every one; see KVB_MODEL)")
    p.add_argument("--runs", type=int, default=3, help="times the whole set runs; medians of the runs (default 3)")
    p.add_argument("--requests", type=int, default=None, help="doc-qa questions per path (default 12)")
    p.add_argument("--long-tokens", dest="long_tokens", type=int, default=7600,
                   help="long-context prompt length in tokens (default 7600)")
    p.add_argument("--sequential", action="store_true",
                   help="run all of native's questions, then lmcache's, on one engine (default: each mode on an "
                        "engine of its own, taking turns question by question)")
    p.add_argument("--profile", action="store_true",
                   help="also run one warm lmcache request per path under cProfile and print its top functions")


def run(args) -> int:
    from kvbridge.bench.common.report import write_result_json
    from kvbridge.bench.floor_bench import PATHS, format_floor, run_floor_bench

    settings = settings_from(args)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()] if args.paths else list(PATHS)
    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    result = run_floor_bench(settings, paths=paths, models=models, runs=args.runs, n_requests=args.requests,
                             long_tokens=args.long_tokens, profile=args.profile,
                             interleave=not args.sequential)
    print(format_floor(result))
    print(f"wrote {write_result_json(result, settings.output_dir, 'floor')}")
    return 1 if any(row["errors"] for row in result["table"]) else 0


COMMAND = Command("bench-floor", bench_command("bench-floor").measures, run, add_arguments)
