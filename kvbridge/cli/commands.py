"""The command table: every command of `kvbridge`, in the order `--help` lists them, and the parser built from it."""
from __future__ import annotations

import argparse
import sys

from kvbridge.cli import (bench, bench_cache_server, bench_floor, bench_fleet, bench_l3, bench_misses, bench_s3,
                          bench_restore, bench_scheduler, bench_serve, bench_store, cache_server, demo, fleet, gui, info,
                          serve, setup)
from kvbridge.cli import cut_probe, explain
from kvbridge.cli.command import Command
from kvbridge.settings.cmdline import Parser

COMMANDS: tuple[Command, ...] = (
    setup.COMMAND, gui.COMMAND, demo.COMMAND, bench.COMMAND, bench_store.COMMAND, bench_restore.COMMAND,
    bench_cache_server.COMMAND, bench_l3.COMMAND, bench_s3.COMMAND, bench_floor.COMMAND, bench_scheduler.COMMAND,
    bench_serve.COMMAND, bench_fleet.COMMAND, bench_misses.COMMAND, cache_server.COMMAND, serve.COMMAND, fleet.COMMAND, info.NAMESPACE,
    info.ENGINES, info.SCENARIOS,
    explain.COMMAND, cut_probe.COMMAND,
)
BY_NAME = {command.name: command for command in COMMANDS}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kvbridge" if sys.argv and sys.argv[0].endswith("/kvbridge") else "python -m kvbridge",
        description="KVBridge: an LMCache-style KV-cache layer for llama.cpp, llama-server, Ollama and "
                    "OpenAI-compatible engines. Settings come from KVB_ variables and .env (see .env.example).",
        epilog="commands:\n" + "\n".join(f"  {c.name:12} {c.help}" for c in COMMANDS),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_arguments(sub.add_parser(command.name, help=command.help, description=command.help))
    return parser
