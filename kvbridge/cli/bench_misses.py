"""`kvbridge bench-misses`: every miss of five built scenarios attributed to its cause; explaining on and off."""
from __future__ import annotations

from kvbridge.bench.registry import bench_command
from kvbridge.cli.command import Command
from kvbridge.cli.common import add_engine_options, make_engine, progress, settings_from


def add_arguments(p) -> None:
    add_engine_options(p)
    p.add_argument("--scenarios", help="comma-separated: doc-qa, long-context, model-file, tenant-salt, redis-stop "
                                       "(default all)")
    p.add_argument("--requests", type=int, default=5, help="requests per scenario (default 5)")
    p.add_argument("--doc-chars", dest="doc_chars", type=int, default=2400,
                   help="characters of each doc-qa document (default 2400, ~600 tokens)")
    p.add_argument("--lengths", default="512,1024,2048", help="long-context prompt lengths in tokens")
    p.add_argument("--repeats", type=int, default=7, help="warm hits per setting, explaining on and off alternated")
    p.add_argument("--n-predict", dest="n_predict", type=int, default=4, help="tokens generated per request")


def run(args) -> int:
    from kvbridge.bench.long_context import parse_lengths
    from kvbridge.bench.misses_bench import SCENARIOS, format_bench_misses, run_bench_misses, write_outputs

    settings = settings_from(args)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()] if args.scenarios else list(SCENARIOS)
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown or not scenarios:
        raise SystemExit(f"Unknown scenario(s) {', '.join(unknown) or '(none given)'}; use any of {', '.join(SCENARIOS)}.")
    result = run_bench_misses(settings, make_engine, scenarios, n_requests=args.requests, doc_chars=args.doc_chars,
                              lengths=parse_lengths(args.lengths), repeats=args.repeats, n_predict=args.n_predict,
                              progress=progress)
    print(format_bench_misses(result))
    print(f"wrote {write_outputs(result, settings.output_dir)} (and .md beside it)")
    return 1 if result["summary"]["unexplained_misses"] else 0


COMMAND = Command("bench-misses", bench_command("bench-misses").measures, run, add_arguments)
