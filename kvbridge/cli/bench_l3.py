"""`kvbridge bench-l3`: what L3 on Redis costs and saves (doc Q&A from L3, a restore, lookups, L3 down, codecs)."""
from __future__ import annotations

from kvbridge.bench.registry import bench_command
from kvbridge.cli.command import Command
from kvbridge.cli.common import add_engine_options, make_engine, progress, settings_from


def add_arguments(p) -> None:
    add_engine_options(p)
    p.add_argument("--parts", help="comma-separated: doc-qa, restore, lookup, down, codecs (default all)")
    p.add_argument("--requests", type=int, default=None, help="doc-qa questions (default 12)")
    p.add_argument("--repeats", type=int, default=7,
                   help="restores and GETs, alternated (medians); the codec rows use repeats // 2 + 1")
    p.add_argument("--tokens", type=int, default=2048, help="prefix length of the restore row (default 2048)")
    p.add_argument("--quality-questions", dest="quality_questions", type=int, default=12,
                   help="doc-qa questions for int8's quality (each one cold prefill; 0: skip)")


def run(args) -> int:
    from kvbridge.bench.l3_bench import PARTS, format_bench_l3, run_bench_l3, write_json

    settings = settings_from(args)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()] if args.parts else list(PARTS)
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise SystemExit(f"Unknown part(s) {', '.join(unknown) or '(none given)'}; use any of {', '.join(PARTS)}.")
    result = run_bench_l3(settings, make_engine, parts=parts, repeats=args.repeats, n_requests=args.requests,
                          quality_questions=args.quality_questions, prompt_tokens=args.tokens, progress=progress)
    print(format_bench_l3(result))
    print(f"wrote {write_json(result, settings.output_dir)}")
    return 1 if result.get("doc_qa", {}).get("errors") else 0


COMMAND = Command("bench-l3", bench_command("bench-l3").measures, run, add_arguments)
