"""`kvbridge bench-cache-server`: a private cache server's store call, memory and idle CPU."""
from __future__ import annotations

from kvbridge.bench.registry import bench_command
from kvbridge.cli.command import Command
from kvbridge.cli.common import settings_from


def add_arguments(p) -> None:
    p.add_argument("--object-mb", type=float, default=6.0,
                   help="object size in MB for the store call (default 6: one 256-token chunk of SmolLM2)")
    p.add_argument("--repeats", type=int, default=15, help="store calls and copies, alternated (medians)")
    p.add_argument("--fill", type=float, default=0.7,
                   help="fill the pool to this fraction before reading the memory (default 0.7, below eviction)")
    p.add_argument("--idle-s", dest="idle_s", type=float, default=20.0,
                   help="seconds the server is watched idle with 2 clients (default 20)")


def run(args) -> int:
    from kvbridge.bench.cache_server_bench import format_bench_cache_server, run_bench_cache_server

    settings = settings_from(args)
    print(format_bench_cache_server(run_bench_cache_server(
        settings, object_mb=args.object_mb, repeats=args.repeats, fill=args.fill, idle_s=args.idle_s)))
    return 0


COMMAND = Command("bench-cache-server", bench_command("bench-cache-server").measures, run, add_arguments)
