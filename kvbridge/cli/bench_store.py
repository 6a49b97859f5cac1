"""`kvbridge bench-store`: hashing and the L1/L2 tiers against plain memory and file copies."""
from __future__ import annotations

from kvbridge.bench.registry import bench_command
from kvbridge.cli.command import Command
from kvbridge.settings import Settings


def add_arguments(p) -> None:
    p.add_argument("--object-mb", type=float, default=40.0, help="object size in MB (default 40)")
    p.add_argument("--repeats", type=int, default=5, help="runs per measurement (median is shown)")


def run(args) -> int:
    from kvbridge.bench.store_bench import format_report, run_bench_store

    settings = Settings.from_env()
    print(format_report(run_bench_store(settings, object_mb=args.object_mb, repeats=args.repeats)))
    return 0


COMMAND = Command("bench-store", bench_command("bench-store").measures, run, add_arguments)
