"""`kvbridge` (the same as `python -m kvbridge`): the command line (setup, gui, demo, bench, bench-store, bench-l3, bench-scheduler, bench-serve, cache-server, serve, namespace, engines, scenarios)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import signal
import sys
import tempfile

from kvbridge.settings import Settings
from kvbridge.settings.checks import SERVE_ENGINES
from kvbridge.errors import KVBridgeError

COMMANDS = {
    "setup": "fetch the embedded models (SmolLM2, KVB_MODEL's, --model) into the models folder and say what "
             "else this installation needs (in a source checkout ./scripts/setup.sh does all of it)",
    "gui": "serve the Gradio testbed on KVB_HOST:KVB_PORT (what ./scripts/start.sh runs)",
    "demo": "run a short Document Q&A in cold and lmcache modes and print what happened",
    "bench": "run a scenario headless in several modes; print a table and summary; write CSV/JSON/HTML to output/",
    "bench-store": "hashing and L1/L2 throughput against plain memory and file copies",
    "bench-restore": "restore of a 2k-token prefix (lookup+fetch+assemble+set) against a plain memory copy, "
                     "and through a private cache server",
    "bench-cache-server": "a private cache server: a store call against a memory copy, memory above the pool, idle CPU",
    "bench-l3": "L3 on Redis (KVB_L3_URL, else a private redis-server): doc Q&A served from L3, a restore against "
                "plain GETs, lookup round trips, L3 stopped, and the KV codecs",
    "bench-floor": "warm restores against their floor (native + one copy) on every path (in-process, llama-server, "
                   "cache server, L3 on a private Redis, a 7.6k-token context) and both embedded models, with the "
                   "time of each stage; JSON to output/",
    "bench-scheduler": "the scheduler against llama-server (same cells, -np, --kv-unified) on a priority burst and "
                       "a shared system prompt, and swapping a ~2k-token sequence out and back in against "
                       "recomputing it; JSON to output/",
    "bench-serve": "Document Q&A through the openai SDK: serve against llama-server's own endpoint, warm and after "
                   "both are restarted (one server up at a time, ours with a private L2); JSON to output/",
    "cache-server": "run the cache server (ZMQ + shared memory) that engines share when KVB_STORE_URL points at it",
    "serve": "an OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions) with KVBridge's cache behind it",
    "namespace": "start the configured engine and print its namespace (what its stored KV is keyed under)",
    "engines": "list the engines in the registry",
    "scenarios": "list the demo scenarios",
}


def _settings(args) -> Settings:
    settings = Settings.from_env()
    overrides = {}
    for name in ("engine", "chunk_size", "n_predict"):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    if overrides:
        settings = dataclasses.replace(settings, **overrides)
    problems = settings.validate()
    if problems:
        raise SystemExit("Settings need attention:\n  - " + "\n  - ".join(problems))
    return settings


def _make_engine(settings: Settings, l2_dir: str | None = None):
    from kvbridge.backends import make_backend
    from kvbridge.engine.cached_engine import CachedEngine

    if l2_dir is not None:
        settings = dataclasses.replace(settings, l2_dir=l2_dir)
    return CachedEngine(settings, make_backend(settings.engine, settings))


def cmd_gui(args) -> int:
    from kvbridge.gui.app import main as app_main

    return app_main(serve=args.serve) or 0


def cmd_cache_server(args) -> int:
    from kvbridge.cache_server.cli import run

    settings = Settings.from_env()
    problems = settings.validate()
    if problems:
        raise SystemExit("Settings need attention:\n  - " + "\n  - ".join(problems))
    return run(settings, args.url, args.server_module or [], args.metrics_port)


def cmd_serve(args) -> int:
    from kvbridge.serve.server import run

    settings = Settings.from_env()
    problems = settings.validate()
    if problems:
        raise SystemExit("Settings need attention:\n  - " + "\n  - ".join(problems))
    return run(settings, args.host, args.port, args.engine)


def cmd_engines(args) -> int:
    from kvbridge.backends import engine_specs

    for spec in engine_specs():
        aliases = f" (aliases: {', '.join(spec.aliases)})" if spec.aliases else ""
        print(f"{spec.key:13} {spec.cls.kv_mode.upper():6} {spec.label}{aliases}\n{'':20} {spec.blurb}")
    return 0


def cmd_setup(args) -> int:
    import importlib.util

    from kvbridge.settings import DATA_HOME, SOURCE_CHECKOUT, WORK_DIR
    from kvbridge.settings.model_fetch import FetchError, fetch_models
    from kvbridge.settings.models import DEFAULT_MODEL, EMBEDDED_MODELS

    settings = Settings.from_env()
    names = [DEFAULT_MODEL]
    for name in [settings.model, *(args.model or [])]:
        for wanted in (EMBEDDED_MODELS if name == "all" else [name]):
            if wanted not in names:
                names.append(wanted)
    print(f"models folder: {DATA_HOME / 'models'}; settings: {WORK_DIR / '.env'} and KVB_ variables")
    try:
        fetch_models(names, say=print)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("llama_cpp") is None:
        where = ("./scripts/setup.sh builds it down the instruction-set ladder" if SOURCE_CHECKOUT else
                 "pip install 'kvbridge[llama]' builds it from source (about 5 minutes on 2 cores; "
                 "set CMAKE_ARGS for your CPU's instruction set if the first decode crashes)")
        print(f"llama-cpp-python is not installed, so the in-process engine cannot run yet: {where}.")
    else:
        start = "./scripts/start.sh" if SOURCE_CHECKOUT else "kvbridge gui"
        print(f"llama-cpp-python is installed: {start} starts the testbed on the embedded model.")
    return 0


def cmd_scenarios(args) -> int:
    from kvbridge.bench.scenarios import scenario_specs

    for sc in scenario_specs():
        print(f"{sc.key:15} {sc.title}: {sc.description}")
    return 0


def cmd_namespace(args) -> int:
    settings = _settings(args)
    with _make_engine(settings) as engine:
        status = engine.status()
        print(f"engine:    {status['label']} ({status['location']}), {status['kv_mode'].upper()}")
        print(f"namespace: {status['namespace']}")
        print(f"short:     {status['namespace_short']}")
        print(f"KV layout: {status['kv_layout']}")
        if status.get("model"):
            print(f"model:     {status['model']}")
        if status.get("kv_refusal"):
            print(f"refused:   {status['kv_refusal']}")
    return 0


def cmd_bench_store(args) -> int:
    from kvbridge.bench.store_bench import format_report, run_bench_store

    settings = Settings.from_env()
    print(format_report(run_bench_store(settings, object_mb=args.object_mb, repeats=args.repeats)))
    return 0


def cmd_bench_restore(args) -> int:
    from kvbridge.bench.report import bench_restore

    settings = _settings(args)
    if not args.no_cache_server:
        return _bench_restore_with_server(settings, args)
    with tempfile.TemporaryDirectory(prefix="kvb-bench-l2-") as l2:
        with _make_engine(settings, l2) as engine:
            _check_restore_engine(engine)
            r = bench_restore(engine, prompt_tokens=args.tokens, repeats=args.repeats)
    print(f"restore of {r['restored_tokens']} tokens ({r['state_bytes'] / 1e6:.1f} MB): "
          f"{r['restore_ms']:.1f} ms (lookup+fetch+assemble+set), plain memory copy {r['memcpy_ms']:.1f} ms, "
          f"ratio {r['ratio']:.2f}x (target <= 3x)")
    return 0


def _check_restore_engine(engine) -> None:
    if engine.backend.kv_mode != "full" or engine.geometry is None:
        raise KVBridgeError("bench-restore needs a full-KV engine with a chunked layout (llamacpp, llama-server).")


def _bench_restore_with_server(settings: Settings, args) -> int:
    """The embedded restore, the same restore through a private cache server's shared memory, and its
    objects as inline bytes over loopback TCP, all in one run on one loaded model."""
    from contextlib import closing

    from kvbridge.bench.cache_server_bench import bench_inline_vs_socket, bench_restore_through_server
    from kvbridge.bench.private_server import bench_client, private_cache_server
    from kvbridge.cache_server.remote_store import RemoteStore

    with tempfile.TemporaryDirectory(prefix="kvb-bench-l2-") as l2, private_cache_server(settings) as server:
        with _make_engine(settings, l2) as engine:
            _check_restore_engine(engine)
            with closing(RemoteStore.from_settings(server.engine_settings)) as remote:
                r = bench_restore_through_server(engine, remote, prompt_tokens=args.tokens, repeats=args.repeats)
            with bench_client(server, use_shm=False) as inline_client:
                i = bench_inline_vs_socket(inline_client, r["keys"], engine.namespace, repeats=args.repeats)
    print(f"restore of {r['restored_tokens']} tokens ({r['state_bytes'] / 1e6:.1f} MB, {r['objects']} objects), "
          f"medians of {args.repeats}, interleaved:")
    print(f"  embedded store        {r['embedded_ms']:7.1f} ms (lookup+fetch+assemble+set), plain memory copy "
          f"{r['memcpy_ms']:.1f} ms, ratio {r['embedded_vs_copy']:.2f}x (target <= 3x)")
    print(f"  cache server, shm     {r['server_shm_ms']:7.1f} ms ({r['server_restored_tokens']} tokens from "
          f"{r['server_tier']}), {r['server_vs_embedded']:.2f}x the embedded restore (target <= 1.5x)")
    print(f"  inline over TCP       {i['inline_ms']:7.1f} ms to retrieve the {i['objects']} objects "
          f"({i['bytes'] / 1e6:.1f} MB), plain loopback socket {i['socket_ms']:.1f} ms, ratio "
          f"{i['inline_vs_socket']:.2f}x (target <= 3x)")
    return 0


def cmd_bench_cache_server(args) -> int:
    from kvbridge.bench.cache_server_bench import format_bench_cache_server, run_bench_cache_server

    settings = _settings(args)
    print(format_bench_cache_server(run_bench_cache_server(
        settings, object_mb=args.object_mb, repeats=args.repeats, fill=args.fill, idle_s=args.idle_s)))
    return 0


def cmd_bench_scheduler(args) -> int:
    from kvbridge.bench.scheduler_compare import PARTS, run_bench_scheduler
    from kvbridge.bench.scheduler_report import format_bench_scheduler, write_json

    settings = _settings(args)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise SystemExit(f"Unknown part(s) {', '.join(unknown) or '(none given)'}; use any of {', '.join(PARTS)}.")
    burst = dict(document_tokens=args.document_tokens, n_low=args.low, n_urgent=args.urgent,
                 low_predict=args.low_predict, urgent_predict=args.urgent_predict, urgent_at_s=args.urgent_at)
    shared = dict(n_users=args.users, n_predict=args.user_predict)
    with tempfile.TemporaryDirectory(prefix="kvb-bench-sched-") as l2_dir:   # a fresh store, not the user's
        result = run_bench_scheduler(settings.replace(l2_dir=l2_dir), parts,
                                     swap=dict(prompt_tokens=args.tokens, repeats=args.repeats),
                                     burst=burst, shared=shared)
    print(format_bench_scheduler(result))
    print(f"wrote {write_json(result, settings.output_dir)}")
    failed = [r for part in ("burst", "shared") if part in result for r in result[part]["runs"]["ours"]["requests"]
              if r["error"]]
    return 1 if failed else 0


def cmd_bench_serve(args) -> int:
    from kvbridge.bench.serve_bench import failed, format_bench_serve, run_bench_serve, write_json

    settings = _settings(args)
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


def cmd_bench_l3(args) -> int:
    from kvbridge.bench.l3_bench import PARTS, format_bench_l3, run_bench_l3, write_json

    settings = _settings(args)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()] if args.parts else list(PARTS)
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise SystemExit(f"Unknown part(s) {', '.join(unknown) or '(none given)'}; use any of {', '.join(PARTS)}.")
    result = run_bench_l3(settings, _make_engine, parts=parts, repeats=args.repeats, n_requests=args.requests,
                          quality_questions=args.quality_questions, prompt_tokens=args.tokens, progress=_progress)
    print(format_bench_l3(result))
    print(f"wrote {write_json(result, settings.output_dir)}")
    return 1 if result.get("doc_qa", {}).get("errors") else 0


def cmd_bench_floor(args) -> int:
    from kvbridge.bench.floor_bench import PATHS, format_floor, run_floor_bench
    from kvbridge.bench.report import write_result_json

    settings = _settings(args)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()] if args.paths else list(PATHS)
    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    result = run_floor_bench(settings, paths=paths, models=models, runs=args.runs, n_requests=args.requests,
                             long_tokens=args.long_tokens, profile=args.profile)
    print(format_floor(result))
    print(f"wrote {write_result_json(result, settings.output_dir, 'floor')}")
    return 1 if any(row["errors"] for row in result["table"]) else 0


def _progress(done: int, total: int, what: str) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what[:60]:60}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def cmd_bench(args) -> int:
    from kvbridge.bench.long_context import parse_lengths
    from kvbridge.bench.runner import parse_modes
    from kvbridge.bench.scenarios import ScenarioOptions, get_scenario

    settings = _settings(args)
    modes = parse_modes(args.modes)
    scenario = get_scenario(args.scenario)
    lengths = parse_lengths(args.lengths) if args.lengths else None
    if scenario.context_needed is not None:
        # the run raises the context it needs itself (up to what the model supports): no KVB_CTX_SIZE to set
        needed = scenario.context_needed(ScenarioOptions(lengths=lengths), settings.n_predict)
        if needed > settings.ctx_size:
            print(f"context raised from {settings.ctx_size} to {needed} tokens for this run")
            settings = settings.replace(ctx_size=needed)
    with contextlib.ExitStack() as stack:
        if args.from_tier and args.cache_server:
            raise KVBridgeError("--from-tier empties the embedded store's tiers; a cache server's tiers are its own "
                                "(leave out --cache-server).")
        if args.from_tier == "L3" and not settings.l3_url:
            from kvbridge.bench.private_redis import private_redis

            redis_server = stack.enter_context(private_redis())
            settings = settings.replace(l3_url=redis_server.url)
            print(f"L3 on a private redis-server on {redis_server.url} (pid {redis_server.pid}; KVB_L3_URL is not "
                  "set), stopped after the run")
        if args.cache_server:
            from kvbridge.bench.private_server import private_cache_server

            server = stack.enter_context(private_cache_server(settings))
            settings = server.engine_settings
            print(f"through a private cache server on {server.url} (pid {server.pid}, L1 "
                  f"{server.pool_bytes / 2**20:.0f} MiB, L2 in a temp dir; stopped after the run)")
        return _bench_run(args, settings, modes, lengths)


def _bench_run(args, settings: Settings, modes: list[str], lengths) -> int:
    from kvbridge.bench.long_context import format_rows, length_rows
    from kvbridge.bench.report import format_stages, format_summary, format_table, summarize
    from kvbridge.bench.runner import empty_faster_tiers, run_scenario
    from kvbridge.gui.charts import run_figures
    from kvbridge.gui.export import export_run

    with tempfile.TemporaryDirectory(prefix="kvb-bench-l2-") as fresh_l2:
        # A fresh store by default: the first lmcache request is a real miss, and nothing of the user's is touched.
        engine = _make_engine(settings, None if args.keep_store else fresh_l2)
        records = []
        with engine:
            status = engine.status()
            print(f"engine {status['label']} ({status['location']}), {status['kv_mode'].upper()}, "
                  f"namespace {status['namespace_short']}, chunk {settings.chunk_size}, context {settings.ctx_size}")
            document = _read_document(args.document)
            before = empty_faster_tiers(engine.store, args.from_tier) if args.from_tier else None
            for record in run_scenario(engine, args.scenario, modes, n_requests=args.requests, document=document,
                                       progress=_progress, n_predict=args.n_predict, lengths=lengths,
                                       before_request=before):
                records.append(record)
            stats = engine.store.stats()
        print(format_table(records))
        summary = summarize(records)
        print(format_summary(summary))
        print(format_stages(summary))
        rows = length_rows(records)
        if rows:
            print(format_rows(rows))
        paths = export_run(records, settings.output_dir, figures=run_figures(records, stats), meta={
            "command": "bench", "scenario": args.scenario, "modes": modes, "engine": status["engine"],
            "namespace": status["namespace"], "chunk_size": settings.chunk_size, "ctx_size": settings.ctx_size,
            "n_predict": settings.n_predict, "summary": summary, "store": stats,
            "cache_server": settings.store_url or None, "from_tier": args.from_tier})
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 1 if any(r.error for r in records) else 0


def _read_document(path: str | None) -> str | None:
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise KVBridgeError(f"Cannot read the document {path}: {exc.strerror}") from exc


def cmd_demo(args) -> int:
    from kvbridge.bench.runner import run_scenario

    settings = _settings(args)
    with tempfile.TemporaryDirectory(prefix="kvb-demo-l2-") as l2:
        with _make_engine(settings, l2) as engine:
            print(f"Demo: Document Q&A on {engine.status()['label']}, 3 questions, cold then lmcache.")
            for r in run_scenario(engine, "doc-qa", ["cold", "lmcache"], n_requests=3, n_predict=24):
                print(f"  {r.mode:8} {r.label[:40]:40} TTFT {r.ttft_ms:8.1f} ms  reused {r.matched_tokens:5}/"
                      f"{r.prompt_tokens} tokens from {r.tier:4}  {r.text.strip()[:50]!r}")
    return 0


def serve_engine_choice(value: str) -> str:
    """--engine of serve: one it can run, else argparse's error (exit 2) saying why and what to use."""
    if value in SERVE_ENGINES:
        return value
    from kvbridge.backends import engine_specs

    use = " or ".join(f"--engine {key}" for key in SERVE_ENGINES)
    shadow = {name for spec in engine_specs() if spec.cls.kv_mode == "shadow" for name in (spec.key, *spec.aliases)}
    if value in shadow:
        raise argparse.ArgumentTypeError(f"{value!r} is a shadow engine: it holds no KV of KVBridge's to serve from; "
                                         f"use {use}")
    raise argparse.ArgumentTypeError(f"{value!r} is not an engine serve can run; use {use}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbridge" if sys.argv and sys.argv[0].endswith("/kvbridge") else "python -m kvbridge",
        description="KVBridge: an LMCache-style KV-cache layer for llama.cpp, llama-server, Ollama and "
                    "OpenAI-compatible engines. Settings come from KVB_ variables and .env (see .env.example).",
        epilog="commands:\n" + "\n".join(f"  {k:12} {v}" for k, v in COMMANDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in ("bench", "demo", "namespace", "bench-restore", "bench-l3"):
            p.add_argument("--engine", help="engine key or alias (default: KVB_ENGINE)")
            p.add_argument("--chunk-size", dest="chunk_size", type=int, help="tokens per chunk (default: KVB_CHUNK_SIZE)")
        if name == "bench":
            p.add_argument("--scenario", default="doc-qa", help="scenario key (see `scenarios`); default doc-qa")
            p.add_argument("--modes", default="cold,native,lmcache", help="comma-separated modes (cold, native, lmcache, blend); default the first three")
            p.add_argument("--requests", type=int, default=None, help="number of requests (default: the scenario's)")
            p.add_argument("--repeats", dest="requests", type=int,
                           help="long-context: warm requests per length and mode (the same as --requests; default 3)")
            p.add_argument("--lengths", help="long-context: prompt lengths in tokens, comma-separated "
                                             "(default 512,1024,2048,4096,8192)")
            p.add_argument("--n-predict", dest="n_predict", type=int, default=None, help="tokens to generate")
            p.add_argument("--document", help="a text file to use as the document")
            p.add_argument("--keep-store", action="store_true",
                           help="use the configured L2 (KVB_L2_DIR) instead of a fresh temporary store")
            p.add_argument("--cache-server", action="store_true",
                           help="run through a private cache server (a child process on a free loopback port, "
                                "L1 = KVB_L1_BYTES, L2 in a temp dir), stopped after the run")
            p.add_argument("--from-tier", dest="from_tier", choices=("L2", "L3"),
                           help="serve every lmcache hit from this tier: before each lmcache request the writes "
                                "queued behind the last one finish and every faster tier is emptied; L3 without "
                                "KVB_L3_URL starts a private redis-server")
        if name == "bench-restore":
            p.add_argument("--tokens", type=int, default=2048, help="prefix length to restore (default 2048)")
            p.add_argument("--repeats", type=int, default=7, help="runs (median is shown)")
            p.add_argument("--no-cache-server", action="store_true",
                           help="the embedded store only (no private cache server, no server rows)")
        if name == "bench-cache-server":
            p.add_argument("--object-mb", type=float, default=6.0,
                           help="object size in MB for the store call (default 6: one 256-token chunk of SmolLM2)")
            p.add_argument("--repeats", type=int, default=15, help="store calls and copies, alternated (medians)")
            p.add_argument("--fill", type=float, default=0.7,
                           help="fill the pool to this fraction before reading the memory (default 0.7, below eviction)")
            p.add_argument("--idle-s", dest="idle_s", type=float, default=20.0,
                           help="seconds the server is watched idle with 2 clients (default 20)")
        if name == "bench-l3":
            p.add_argument("--parts", help="comma-separated: doc-qa, restore, lookup, down, codecs (default all)")
            p.add_argument("--requests", type=int, default=None, help="doc-qa questions (default 12)")
            p.add_argument("--repeats", type=int, default=7,
                           help="restores and GETs, alternated (medians); the codec rows use repeats // 2 + 1")
            p.add_argument("--tokens", type=int, default=2048, help="prefix length of the restore row (default 2048)")
            p.add_argument("--quality-questions", dest="quality_questions", type=int, default=12,
                           help="doc-qa questions for int8's quality (each one cold prefill; 0: skip)")
        if name == "bench-floor":
            p.add_argument("--paths", help="comma-separated: in-process, llama-server, cache-server, l3, long-context "
                                           "(default all)")
            p.add_argument("--models", help="comma-separated embedded models (default: every one; see KVB_MODEL)")
            p.add_argument("--runs", type=int, default=3, help="times the whole set runs; medians of the runs (default 3)")
            p.add_argument("--requests", type=int, default=None, help="doc-qa questions per path (default 12)")
            p.add_argument("--long-tokens", dest="long_tokens", type=int, default=7600,
                           help="long-context prompt length in tokens (default 7600)")
            p.add_argument("--profile", action="store_true",
                           help="also run one warm lmcache request per path under cProfile and print its top functions")
        if name == "bench-scheduler":
            p.add_argument("--parts", default="swap,burst,shared",
                           help="comma-separated: swap, burst, shared (default all three); burst and shared start "
                                "a private llama-server on a free loopback port, stopped after the run")
            p.add_argument("--tokens", type=int, default=2048, help="swap: sequence length (default 2048)")
            p.add_argument("--repeats", type=int, default=5, help="swap: swaps and recomputes, alternated (medians)")
            p.add_argument("--document-tokens", dest="document_tokens", type=int, default=600,
                           help="burst: at least this many tokens of manual per low chat (whole sections; default 600)")
            p.add_argument("--low", type=int, default=3, help="burst: low-priority document chats (default 3)")
            p.add_argument("--urgent", type=int, default=2, help="burst: urgent short requests (default 2)")
            p.add_argument("--low-predict", dest="low_predict", type=int, default=200,
                           help="burst: tokens each low chat generates (default 200)")
            p.add_argument("--urgent-predict", dest="urgent_predict", type=int, default=24,
                           help="burst: tokens each urgent request generates (default 24)")
            p.add_argument("--urgent-at", dest="urgent_at", type=float, default=2.0,
                           help="burst: seconds after the start the first urgent request arrives (default 2)")
            p.add_argument("--users", type=int, default=8, help="shared: users behind one system prompt (default 8)")
            p.add_argument("--user-predict", dest="user_predict", type=int, default=24,
                           help="shared: tokens each user's answer generates (default 24)")
        if name == "bench-serve":
            p.add_argument("--questions", type=int, default=12, help="Document Q&A questions asked warm (default 12)")
            p.add_argument("--repeats", type=int, default=3,
                           help="restarts of both servers, question 1 timed after each (medians; default 3)")
            p.add_argument("--max-tokens", dest="max_tokens", type=int, default=16,
                           help="max_tokens of every request (default 16)")
            p.add_argument("--document-chars", dest="document_chars", type=int, default=None,
                           help="only the start of the built-in handbook, up to this many characters (cut at a "
                                "space; default: all of it, ~1.7k tokens)")
        if name == "cache-server":
            p.add_argument("--url", help="where to listen: tcp://HOST:PORT or ipc:///path "
                                         "(default: KVB_CACHE_SERVER_URL, else tcp://127.0.0.1:5555)")
            p.add_argument("--server-module", action="append", metavar="JSON",
                           help='a module to load: {"module_path": "pkg.mod", "config": {...}} or a JSON list of them; '
                                "repeatable; after those in KVB_CACHE_SERVER_MODULES")
            p.add_argument("--metrics-port", type=int, default=None,
                           help="serve Prometheus text on 127.0.0.1:PORT/metrics (default: KVB_CACHE_SERVER_METRICS_PORT)")
        if name == "setup":
            p.add_argument("--model", action="append", metavar="NAME",
                           help="also fetch this embedded model, or 'all' (repeatable); SmolLM2 and KVB_MODEL's "
                                "are always fetched")
        if name == "gui":
            p.add_argument("--serve", action="store_true",
                           help="also run the OpenAI-compatible endpoint on KVB_SERVE_PORT; the lab tab shows its requests")
        if name == "serve":
            p.add_argument("--host", help="address to listen on (default: KVB_SERVE_HOST, else 127.0.0.1)")
            p.add_argument("--port", type=int, help="port (default: KVB_SERVE_PORT, else 8000)")
            # only what serve can run: a shadow engine holds no KV of ours to serve from, and is told so
            p.add_argument("--engine", type=serve_engine_choice, metavar="{" + ",".join(SERVE_ENGINES) + "}",
                           help="scheduler: in-process, many requests at once (default: KVB_SERVE_ENGINE); "
                                "llama-server: CachedEngine in lmcache mode, requests queued")
        if name == "bench-store":
            p.add_argument("--object-mb", type=float, default=40.0, help="object size in MB (default 40)")
            p.add_argument("--repeats", type=int, default=5, help="runs per measurement (median is shown)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.command:
        parser.print_help()
        return 0
    handler = globals()["cmd_" + args.command.replace("-", "_")]
    if args.command not in ("gui", "cache-server", "serve"):   # those install their own; elsewhere SIGTERM must still run cleanup
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return handler(args)
    except KVBridgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
