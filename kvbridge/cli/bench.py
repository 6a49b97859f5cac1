"""`kvbridge bench`: a scenario headless in several modes; the table, the summary and the exports.

Place in the flow: settings (+ a private Redis or cache server when asked) -> a CachedEngine on a
fresh L2 -> kvbridge.bench.common.runner.run_scenario per mode -> the report's tables -> CSV/JSON/HTML
in output/ (kvbridge.gui.export, the same files the GUI writes).
"""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from kvbridge.bench.registry import bench_command
from kvbridge.cli.command import Command
from kvbridge.cli.common import add_model_options, make_engine, progress, settings_for_model
from kvbridge.errors import KVBridgeError
from kvbridge.settings import Settings


def add_arguments(p) -> None:
    add_model_options(p, "bench")
    p.add_argument("--scenario", default="doc-qa", help="scenario key (see `scenarios`); default doc-qa")
    p.add_argument("--modes", default="cold,native,lmcache", help="comma-separated modes (cold, native, lmcache, blend); default the first three")
    p.add_argument("--requests", type=int, default=None, help="number of requests (default: the scenario's)")
    p.add_argument("--repeats", dest="requests", type=int,
                   help="long-context: warm requests per length and mode (the same as --requests; default 3)")
    p.add_argument("--lengths", help="long-context: prompt lengths in tokens, comma-separated "
                                     "(default 512,1024,2048,4096,8192)")
    p.add_argument("--n-predict", dest="n_predict", type=int, default=None, help="tokens to generate")
    p.add_argument("--document", help="a text file to use as the document")
    p.add_argument("--corpus", help="rag: the passages and questions, railway (the default: a mountain railway's "
                                    "handbook) or clinic (a small-town clinic's), or the path to a corpus JSON file")
    p.add_argument("--interleave", action="store_true",
                   help="each mode on an engine of its own, the modes taking turns request by request (a change "
                        "in the machine's speed then falls on every mode alike; default: mode after mode)")
    p.add_argument("--keep-store", action="store_true",
                   help="use the configured L2 (KVB_L2_DIR) instead of a fresh temporary store")
    p.add_argument("--cache-server", action="store_true",
                   help="run through a private cache server (a child process on a free loopback port, "
                        "L1 = KVB_L1_BYTES, L2 in a temp dir), stopped after the run")
    p.add_argument("--from-tier", dest="from_tier", choices=("L2", "L3"),
                   help="serve every lmcache hit from this tier: before each lmcache request the writes "
                        "queued behind the last one finish and every faster tier is emptied; L3 without "
                        "KVB_L3_URL starts a private redis-server")


def run(args) -> int:
    from kvbridge.bench.common.runner import parse_modes
    from kvbridge.bench.common.scenarios import ScenarioOptions, get_scenario
    from kvbridge.bench.long_context import parse_lengths

    settings = settings_for_model("bench", args)
    modes = parse_modes(args.modes)
    scenario = get_scenario(args.scenario)
    lengths = parse_lengths(args.lengths) if args.lengths else None
    if args.corpus is not None:
        if scenario.key != "rag":
            raise KVBridgeError(f"--corpus picks the rag scenario's passages; the {scenario.key!r} scenario has "
                                "none (use --document for a document).")
        from kvbridge.bench.rag import load_corpus

        load_corpus(args.corpus)   # an unknown name or a broken file is refused before any engine starts
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
            from kvbridge.bench.common.private_redis import private_redis

            redis_server = stack.enter_context(private_redis())
            settings = settings.replace(l3_url=redis_server.url)
            print(f"L3 on a private redis-server on {redis_server.url} (pid {redis_server.pid}; KVB_L3_URL is not "
                  "set), stopped after the run")
        if args.cache_server:
            from kvbridge.bench.common.private_server import private_cache_server

            server = stack.enter_context(private_cache_server(settings))
            settings = server.engine_settings
            print(f"through a private cache server on {server.url} (pid {server.pid}, L1 "
                  f"{server.pool_bytes / 2**20:.0f} MiB, L2 in a temp dir; stopped after the run)")
        return _bench_run(args, settings, modes, lengths)


def _bench_run(args, settings: Settings, modes: list[str], lengths) -> int:
    from kvbridge.bench.common.report import format_stages, format_summary, format_table, summarize
    from kvbridge.bench.common.runner import empty_faster_tiers, run_interleaved, run_scenario
    from kvbridge.bench.long_context import format_rows, length_rows
    from kvbridge.bench.rag import DEFAULT_CORPUS
    from kvbridge.gui.charts import run_figures
    from kvbridge.gui.export import export_run

    with tempfile.TemporaryDirectory(prefix="kvb-bench-l2-") as fresh_l2, contextlib.ExitStack() as engines:
        # A fresh store by default: the first lmcache request is a real miss, and nothing of the user's is touched.
        # --interleave: one engine per mode (each its own fresh L2), the modes taking turns request by request
        per_mode = modes if args.interleave else modes[:1]
        made = {mode: engines.enter_context(make_engine(settings, None if args.keep_store else
                                                        str(Path(fresh_l2) / mode) if args.interleave else fresh_l2))
                for mode in per_mode}
        engine = made.get("lmcache", next(iter(made.values())))
        records = []
        status = engine.status()
        print(f"engine {status['label']} ({status['location']}), {status['kv_mode'].upper()}, "
              f"namespace {status['namespace_short']}, chunk {settings.chunk_size}, context {settings.ctx_size}"
              + (f"; {len(made)} engines, the modes taking turns" if args.interleave else ""))
        document = _read_document(args.document)
        if args.interleave:
            before = {mode: empty_faster_tiers(e.store, args.from_tier) for mode, e in made.items()} \
                if args.from_tier else None
            records += run_interleaved(made, args.scenario, n_requests=args.requests, document=document,
                                       progress=progress, n_predict=args.n_predict, before_request=before)
        else:
            before = empty_faster_tiers(engine.store, args.from_tier) if args.from_tier else None
            records += run_scenario(engine, args.scenario, modes, n_requests=args.requests, document=document,
                                    progress=progress, n_predict=args.n_predict, lengths=lengths,
                                    before_request=before, corpus=args.corpus)
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
            "cache_server": settings.store_url or None, "from_tier": args.from_tier,
            **({"corpus": args.corpus or DEFAULT_CORPUS} if args.scenario == "rag" else {})})
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


COMMAND = Command("bench", bench_command("bench").measures, run, add_arguments)
