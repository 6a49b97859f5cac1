"""`kvbridge bench-s3`: what the S3 tier costs and saves (doc Q&A from S3, restores, lookups, S3 down, clients)."""
from __future__ import annotations

from kvbridge.bench.registry import bench_command
from kvbridge.cli.command import Command
from kvbridge.cli.common import add_engine_options, make_engine, progress, settings_from


def add_arguments(p) -> None:
    add_engine_options(p)
    p.add_argument("--parts", help="comma-separated: doc-qa, restore, lookup, down, clients (default all)")
    p.add_argument("--requests", type=int, default=None, help="doc-qa questions (default 12)")
    p.add_argument("--repeats", type=int, default=7, help="restores and GETs, alternated (medians)")
    p.add_argument("--tokens", default="2048,7600",
                   help="comma-separated prefix lengths of the restore rows (default 2048,7600)")
    p.add_argument("--lookup-tokens", dest="lookup_tokens", type=int, default=2048,
                   help="prompt length of the lookup row (default 2048)")


def run(args) -> int:
    from kvbridge.bench.s3_bench import PARTS, format_bench_s3, run_bench_s3, write_json

    settings = settings_from(args)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()] if args.parts else list(PARTS)
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise SystemExit(f"Unknown part(s) {', '.join(unknown) or '(none given)'}; use any of {', '.join(PARTS)}.")
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--tokens takes comma-separated token counts, not {args.tokens!r}.") from None
    if not tokens or min(tokens) < 1 or args.lookup_tokens < 1:
        raise SystemExit("--tokens and --lookup-tokens take positive token counts.")
    result = run_bench_s3(settings, make_engine, parts=parts, repeats=args.repeats, n_requests=args.requests,
                          restore_tokens=tokens, lookup_tokens=args.lookup_tokens, progress=progress)
    print(format_bench_s3(result))
    print(f"wrote {write_json(result, settings.output_dir)}")
    return 1 if result.get("doc_qa", {}).get("errors") else 0


COMMAND = Command("bench-s3", bench_command("bench-s3").measures, run, add_arguments)
