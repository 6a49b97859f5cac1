"""`kvbridge bench-fleet`: a fleet behind vllm-router per policy, with and without the shared cache server, and PD."""
from __future__ import annotations

import sys

from kvbridge.bench.registry import bench_command
from kvbridge.cli.command import Command
from kvbridge.cli.common import settings_from
from kvbridge.settings.cmdline import Parser

POLICIES = ("round_robin", "cache_aware", "kv_aware")   # kvbridge.bench.fleet_bench.POLICIES, without its imports


# option: (full run, --quick)
DEFAULTS = {"documents": (6, 2), "questions_per_document": (4, 2), "max_tokens": (12, 8),
            "policies": (",".join(POLICIES), "kv_aware"), "workers": (3, 2)}


def add_arguments(p) -> None:
    p.add_argument("--documents", type=int,
                   help="long documents (~600 tokens each) the users ask about; a worker's cells hold ~2 (default 6)")
    p.add_argument("--questions-per-document", dest="questions_per_document", type=int,
                   help="questions about each document, interleaved across documents (1-8, default 4)")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, help="max_tokens of every request (default 12)")
    p.add_argument("--policies",
                   help=f"the router's policies to run, comma-separated (default {','.join(POLICIES)})")
    p.add_argument("--workers", type=int, help="serve workers per fleet (default 3)")
    p.add_argument("--think-s", dest="think_s", type=float, default=2.0,
                   help="seconds a user reads an answer before asking the next question (default 2)")
    p.add_argument("--no-pd", dest="no_pd", action="store_true",
                   help="leave out the prefill/decode pair against one colocated instance")
    p.add_argument("--exact", action="store_true",
                   help="the answers' defaults: f16 K/V, KVB_SCHED_MAX_RUNNING sequences at once, exact mode; each "
                        "policy's fleet runs again with the mode off (flash attention on), side by side")
    p.add_argument("--quick", action="store_true",
                   help="a small run: kv_aware with the shared cache server only, 2 workers, 2 shorter documents "
                        "x 2 questions, max_tokens 8, no PD (options given still apply)")


def options(args) -> dict:
    """The run's options from the command line (--quick's defaults under it); SystemExit naming a wrong option."""
    value = {name: getattr(args, name) if getattr(args, name) is not None else pair[1 if args.quick else 0]
             for name, pair in DEFAULTS.items()}
    policies = tuple(p.strip() for p in value["policies"].split(",") if p.strip())
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise SystemExit(f"--policies: {', '.join(unknown) or 'none given'}; use some of {', '.join(POLICIES)}")
    for option, name, least, most in (("--documents", "documents", 1, 16),
                                      ("--questions-per-document", "questions_per_document", 1, 8),
                                      ("--max-tokens", "max_tokens", 1, 256), ("--workers", "workers", 2, 8)):
        if not least <= value[name] <= most:
            raise SystemExit(f"{option} must be from {least} to {most}, got {value[name]}.")
    return {"documents_count": value["documents"], "questions_per_document": value["questions_per_document"],
            "max_tokens": value["max_tokens"], "policies": policies, "workers": value["workers"],
            "pd": not (args.no_pd or args.quick), "quick": args.quick, "think_s": max(0.0, args.think_s),
            "shared_modes": (True,) if args.quick else (False, True), "exact": args.exact}


def run(args) -> int:
    from kvbridge.bench.fleet_bench import failed, run_bench_fleet
    from kvbridge.bench.fleet_report import format_bench_fleet, write_outputs

    settings = settings_from(args)
    chosen = options(args)
    result = run_bench_fleet(settings, **chosen, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_bench_fleet(result))
    json_path, md_path = write_outputs(result, settings.output_dir)
    print(f"wrote {json_path} and {md_path}")
    problems = failed(result)
    for problem in problems:
        print(f"bench-fleet failed: {problem}", file=sys.stderr)
    return 1 if problems else 0


COMMAND = Command("bench-fleet", bench_command("bench-fleet").measures, run, add_arguments)


def main(argv: list[str] | None = None) -> int:
    """`python -m kvbridge.cli.bench_fleet [options]`, until the command table lists bench-fleet."""
    parser = Parser(prog="kvbridge bench-fleet", description=COMMAND.help)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
