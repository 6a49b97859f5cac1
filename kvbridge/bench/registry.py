"""The benchmarks a user runs: one row per `kvbridge bench*` command, what it measures and against what.

Place in the flow: the command line's bench commands (kvbridge.cli) take their help text from here,
and a reader finds here which module does each one. Every figure a command prints is set beside a
baseline measured in the same run, on the same machine, because the machine is shared: `baseline`
says what that is. One-off research probes (python -m kvbridge.bench.probes.<name>) are not commands
and are not listed; kvbridge/bench/probes/__init__.py lists them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchCommand:
    name: str        # the command: `kvbridge <name>`
    measures: str    # what it measures (the command's help and description)
    baseline: str    # what each of its figures is set against, in the same run
    module: str      # where its measurement lives


BENCH_COMMANDS: tuple[BenchCommand, ...] = (
    BenchCommand(
        "bench",
        "run a scenario headless in several modes; print a table and summary; write CSV/JSON/HTML to output/",
        "cold mode on the same requests: speedups against cold's TTFT, answers compared with cold's",
        "kvbridge.bench.common.runner"),
    BenchCommand(
        "bench-store",
        "hashing and L1/L2 throughput against plain memory and file copies",
        "one in-memory copy of the object (L1), a plain file write + fsync and read (L2); hashing >= 20 M tokens/s",
        "kvbridge.bench.store_bench"),
    BenchCommand(
        "bench-restore",
        "restore of a 2k-token prefix (lookup+fetch+assemble+set) against a plain memory copy, "
        "and through a private cache server",
        "a plain memory copy of the restored bytes (<= 3x); through the server, the embedded restore (<= 1.5x); "
        "inline over TCP, a plain loopback socket (<= 3x)",
        "kvbridge.bench.cache_server_bench"),
    BenchCommand(
        "bench-cache-server",
        "a private cache server: a store call against a memory copy, memory above the pool, idle CPU",
        "a plain memory copy of the object; the server's pool size; an idle process",
        "kvbridge.bench.cache_server_bench"),
    BenchCommand(
        "bench-l3",
        "L3 on Redis (KVB_L3_URL, else a private redis-server): doc Q&A served from L3, a restore against "
        "plain GETs, lookup round trips, L3 stopped, and the KV codecs",
        "cold answers (the oracle), plain redis-py GETs of the same values, the raw codec",
        "kvbridge.bench.l3_bench"),
    BenchCommand(
        "bench-s3",
        "the S3 tier (KVB_S3_URL, else a private weed mini): doc Q&A served from S3, 2k and 7.6k restores "
        "against plain GETs, a lookup's round trips, S3 down, and boto3 against obstore and awscrt",
        "cold answers (the oracle), plain boto3 GETs of the same objects, a store without S3",
        "kvbridge.bench.s3_bench"),
    BenchCommand(
        "bench-floor",
        "warm restores against their floor (native + one copy) on every path (in-process, llama-server, "
        "cache server, L3 on a private Redis, a 7.6k-token context) and both embedded models, with the "
        "time of each stage; JSON to output/",
        "the floor: the engine's own warm path (native) plus one copy of the restored KV bytes",
        "kvbridge.bench.floor_bench"),
    BenchCommand(
        "bench-scheduler",
        "the scheduler against llama-server (same cells, -np, --kv-unified) on a priority burst and "
        "a shared system prompt, and swapping a ~2k-token sequence out and back in against "
        "recomputing it; JSON to output/",
        "llama-server on the same workload and cells; recomputing the swapped sequence",
        "kvbridge.bench.scheduler_compare"),
    BenchCommand(
        "bench-serve",
        "Document Q&A through the openai SDK: serve against llama-server's own endpoint, warm and after "
        "both are restarted (one server up at a time, ours with a private L2); JSON to output/",
        "llama-server's own OpenAI endpoint, same GGUF and questions",
        "kvbridge.bench.serve_bench"),
    BenchCommand(
        "bench-fleet",
        "a fleet of serve workers behind vllm-router, per routing policy, with and without the shared cache "
        "server: fleet hit rate, TTFT, throughput, answers against cold; prefill/decode against colocated; "
        "JSON and a markdown table to output/",
        "one instance with all the memory (the fleet's cells in one), round_robin without a shared cache, "
        "one colocated instance for PD, and each question's cold answer under a fresh cache_salt",
        "kvbridge.bench.fleet_bench"),
    BenchCommand(
        "bench-misses",
        "every miss of five built scenarios (doc-qa with a small L1, long context, a changed model file, a "
        "tenant's salt, Redis stopped) against the cause each was built to have; warm-hit TTFT with "
        "KVB_EXPLAIN_MISSES on and off; JSON and a markdown table to output/",
        "the cause each scenario built (unexplained misses: 0); the same warm hits with KVB_EXPLAIN_MISSES=false",
        "kvbridge.bench.misses_bench"),
)


def bench_command(name: str) -> BenchCommand:
    """The registry's row for `name`; a KeyError names the commands there are."""
    for command in BENCH_COMMANDS:
        if command.name == name:
            return command
    raise KeyError(f"no bench command {name!r}; there are {', '.join(c.name for c in BENCH_COMMANDS)}")
