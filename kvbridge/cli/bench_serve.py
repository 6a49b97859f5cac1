"""`kvbridge bench-serve`: KVBridge's OpenAI endpoint against llama-server's own, through the openai SDK."""
from __future__ import annotations

import sys

from kvbridge.bench.registry import bench_command
from kvbridge.cli.command import Command
from kvbridge.cli.common import settings_from


def add_arguments(p) -> None:
    p.add_argument("--questions", type=int, default=12, help="Document Q&A questions asked warm (default 12)")
    p.add_argument("--repeats", type=int, default=3,
                   help="restarts of both servers, question 1 timed after each (medians; default 3)")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=16,
                   help="max_tokens of every request (default 16)")
    p.add_argument("--document-chars", dest="document_chars", type=int, default=None,
                   help="only the start of the built-in handbook, up to this many characters (cut at a "
                        "space; default: all of it, ~1.7k tokens)")


def run(args) -> int:
    from kvbridge.bench.serve_bench import failed, format_bench_serve, run_bench_serve, write_json

    settings = settings_from(args)
    for option, value, least in (("--questions", args.questions, 1), ("--repeats", args.repeats, 0),
                                 ("--max-tokens", args.max_tokens, 1), ("--document-chars", args.document_chars, 1)):
        if value is not None and value < least:
            raise SystemExit(f"{option} must be at least {least}, got {value}.")
    result = run_bench_serve(settings, questions=args.questions, repeats=args.repeats, max_tokens=args.max_tokens,
                             document_chars=args.document_chars,
                             progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_bench_serve(result))
    print(f"wrote {write_json(result, settings.output_dir)}")
    return 1 if failed(result) else 0


COMMAND = Command("bench-serve", bench_command("bench-serve").measures, run, add_arguments)
