"""bench-s3: what the S3 tier costs and saves, each figure next to its baseline from the same run.

Place in the flow: prompt -> chunk hashes -> **lookup -> get_many -> assemble** -> restore, with the
objects in S3 (kvbridge.store.s3_tier.S3Tier) and L1 and L2 emptied first, so every hit crosses the
network. The endpoint is KVB_S3_URL, or a private `weed mini` (private_s3) when that is not set; the
bench writes under its own prefix (KVB_S3_PREFIX + "-bench-<pid>") and removes what it wrote.

- doc-qa: the doc-qa scenario, cold vs lmcache, every warm hit from S3 (runner.empty_faster_tiers);
  the oracle: lmcache answers = cold answers;
- restore: a 2k- and a 7.6k-token restore from S3 against plain GETs of the same objects with the
  same boto3 client (in parallel on as many threads as the tier fetches with), interleaved, medians;
- lookup: the HTTP requests a lookup of a 2k-token prompt sends (s3_wire: boto3's before-send event);
- down: a killed endpoint (the port refuses) and a silent one (accepts, never answers): the first
  request's store lookup, then later ones (kvbridge.bench.s3_wire, as l3_wire for L3);
- clients: plain GETs of the 2k restore's objects with boto3, obstore and awscrt where installed
  (kvbridge.bench.s3_clients).

Deliberately left out: AWS itself (nothing here reaches the internet) and any timing threshold; the
command prints the targets next to the figures and Docs/Research.md judges.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Sequence

from kvbridge.bench.cache_server_bench import restored_keys
from kvbridge.bench.common.report import format_table, stored_prefix, write_result_json
from kvbridge.bench.common.runner import ProgressFn, empty_faster_tiers
from kvbridge.bench.l3_bench import doc_qa_from_l3
from kvbridge.bench.s3_wire import down_both_ways, lookup_round_trips, s3_tier
from kvbridge.errors import KVBridgeError
from kvbridge.settings import Settings
from kvbridge.store import TieredStore

MEAN_TARGET = 8.0             # doc-qa from S3: mean TTFT speedup over cold (L3's target)
WARM_TARGET = 25.0            # doc-qa from S3: median warm-hit speedup over cold
RESTORE_VS_GET_TARGET = 2.0   # a restore from S3 against plain GETs of its objects
ROUND_TRIPS_TARGET = 1        # a lookup of a 2k-token prompt this process does not know yet
LATER_MS_TARGET = 1.0         # store time of a request once S3 is marked down
PARTS = ("doc-qa", "restore", "lookup", "down", "clients")


# -- (b) restores from S3 against plain GETs -------------------------------------------------------
def bench_restore_from_s3(engine, prompt_tokens: int, repeats: int = 7) -> dict:
    """Restore (lookup + get_many + assemble) from S3 against plain boto3 GETs of the same objects.

    Three actions per repeat, their order rotating: the restore; the tier's own read (S3Tier.get_many:
    parallel GETs, each object's header and blake3 checked, no promotion and no assembly); the plain
    GETs with the tier's own boto3 client on a pool of the tier's size. Before each, the write-behind is
    drained and L1, L2 emptied (untimed). The engine's set call is timed apart, not in the ratio.
    """
    from kvbridge.store.s3_tier import FETCH_THREADS

    store, backend, kv = engine.store, engine.backend, engine._kv
    kv.hot_restores = False   # every restore reads its objects from S3 (a hot restore reads the tail only)
    record, tokens, hashes = stored_prefix(engine, prompt_tokens)
    empty = empty_faster_tiers(store, "S3")
    empty("lmcache")
    plan = kv.plan_restore(tokens, hashes, buffer_for=backend.state_buffer)
    tier = s3_tier(store)
    keys = restored_keys(plan, hashes, kv.seed)
    names = [tier.s3_key(key) for key in keys]
    pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="kvbridge-bench-get")

    def plain_get(name: str) -> int:
        return len(tier._client.get_object(Bucket=tier.bucket, Key=name)["Body"].read())

    actions = ("restore", "tier_read", "get")
    times: dict[str, list[float]] = {name: [] for name in (*actions, "set")}
    tiers_seen: Counter[str] = Counter()
    got_bytes = 0
    try:
        for i in range(-1, repeats):
            shift = i % len(actions)
            for name in actions[shift:] + actions[:shift]:
                empty("lmcache")
                start = time.perf_counter()
                if name == "restore":
                    plan = kv.plan_restore(tokens, hashes, buffer_for=backend.state_buffer)
                    restored = time.perf_counter()
                    backend.restore_state(plan.state, plan.tokens)
                    set_ms = (time.perf_counter() - restored) * 1e3
                    backend.reset_native_cache()
                    elapsed = (restored - start) * 1e3
                elif name == "tier_read":
                    found = tier.get_many(keys)
                    elapsed = (time.perf_counter() - start) * 1e3
                    if any(not isinstance(each, tuple) for each in found):
                        raise KVBridgeError(f"S3 did not return every object of the restore: {found!r:.200}")
                else:
                    got_bytes = sum(pool.map(plain_get, names))
                    elapsed = (time.perf_counter() - start) * 1e3
                if i >= 0:
                    times[name].append(elapsed)
                    if name == "restore":
                        times["set"].append(set_ms)
                        tiers_seen[plan.tier] += 1
    finally:
        pool.shutdown()
        kv.hot_restores = True
    ms = {name: statistics.median(values) for name, values in times.items()}
    return {"restored_tokens": plan.matched_tokens, "state_bytes": len(plan.state.data), "objects": len(names),
            "value_bytes": got_bytes, "restore_ms": ms["restore"], "set_ms": ms["set"], "get_ms": ms["get"],
            "tier_read_ms": ms["tier_read"], "tier_read_vs_get": ms["tier_read"] / ms["get"],
            "restore_vs_get": ms["restore"] / ms["get"], "tiers": dict(tiers_seen), "repeats": repeats,
            "threads": FETCH_THREADS, "names": names, "first_record_error": record.error}


# -- the command -----------------------------------------------------------------------------------
def run_bench_s3(settings: Settings, make_engine: Callable, parts: Sequence[str] = PARTS, repeats: int = 7,
                 n_requests: int | None = None, restore_tokens: Sequence[int] = (2048, 7600),
                 lookup_tokens: int = 2048, document: str | None = None, progress: ProgressFn | None = None,
                 say: Callable[[str], None] = print) -> dict:
    """Every part asked for, on one S3 endpoint (KVB_S3_URL, else a private weed mini) and one engine.

    make_engine(settings, l2_dir) -> a CachedEngine (the CLI's). The engine's store is L1 + a fresh L2 +
    S3 under a bench prefix (no L3: every remote hit is S3's), removed afterwards.
    """
    from kvbridge.bench.common.private_s3 import private_s3

    result: dict = {"parts": list(parts)}
    with contextlib.ExitStack() as stack:
        server = None
        bench = settings
        if not settings.s3_url:
            server = stack.enter_context(private_s3())
            env = server.env(prefix=settings.s3_prefix)
            for name in (env["KVB_S3_ACCESS_KEY_ENV"], env["KVB_S3_SECRET_KEY_ENV"]):
                stack.enter_context(_environ(name, env[name]))    # the keys, in the variables the settings name
            bench = settings.replace(s3_url=server.url, s3_bucket=server.bucket,
                                     s3_access_key_env=env["KVB_S3_ACCESS_KEY_ENV"],
                                     s3_secret_key_env=env["KVB_S3_SECRET_KEY_ENV"])
            result["server"] = f"a private weed mini on {server.url} (pid {server.pid}), stopped after the run"
        else:
            result["server"] = f"KVB_S3_URL {settings.s3_url}, bucket {settings.s3_bucket}"
        prefix = f"{settings.s3_prefix}-bench-{os.getpid()}"
        longest = max([*restore_tokens, lookup_tokens]) if {"restore", "lookup"} & set(parts) else 0
        bench = bench.replace(s3_prefix=prefix, l3_url="", ctx_size=max(bench.ctx_size, longest + 512))
        result["prefix"] = prefix
        say(f"S3: {result['server']}; objects under {prefix}/")
        seconds = result["seconds"] = {}

        @contextlib.contextmanager
        def part(name: str):
            start = time.perf_counter()
            yield
            seconds[name] = round(time.perf_counter() - start, 1)

        l2 = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvb-bench-s3-l2-"))
        engine = stack.enter_context(make_engine(bench, l2))
        stack.callback(_remove_bench_objects, engine.store)
        if engine.backend.kv_mode != "full" or engine.geometry is None:
            raise KVBridgeError("bench-s3 restores KV: it needs a full-KV engine with a chunked layout "
                                "(llamacpp, llama-server).")
        status = engine.status()
        result["engine"] = {"label": status["label"], "namespace": status["namespace_short"],
                            "chunk_size": bench.chunk_size, "n_predict": bench.n_predict}
        if "lookup" in parts:
            with part("lookup"):
                result["lookup"] = lookup_round_trips(engine, bench, lookup_tokens)
        if "doc-qa" in parts:
            with part("doc-qa"):
                result["doc_qa"] = doc_qa_from_l3(engine, n_requests, document, progress=progress, tier="S3")
        if "restore" in parts or "clients" in parts:
            result["restore"] = {}
            for tokens in restore_tokens if "restore" in parts else restore_tokens[:1]:
                with part(f"restore-{tokens}"):
                    result["restore"][tokens] = bench_restore_from_s3(engine, tokens, repeats)
        if "clients" in parts:
            from kvbridge.bench.s3_clients import compare_clients

            first = result["restore"][restore_tokens[0]]
            with part("clients"):
                result["clients"] = compare_clients(s3_tier(engine.store), first["names"],
                                                    os.environ[bench.s3_access_key_env],
                                                    os.environ[bench.s3_secret_key_env], repeats)
        if "down" in parts:
            engine.store.drain()
            with part("down"):
                result["down"] = down_both_ways(engine, bench, server)
    return result


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """The private server's key in the variable KVB_S3_*_KEY_ENV names, for this run only."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def write_json(result: dict, output_dir) -> Path:
    return write_result_json(result, output_dir, "bench-s3")


def _remove_bench_objects(store: TieredStore) -> None:
    """What the bench wrote under its prefix goes (on the user's endpoint it must not stay behind)."""
    from kvbridge.store.objects import StoreFault

    store.drain()
    tier = s3_tier(store)
    if not tier.available():
        return          # killed by the down part: a private server, removed with its folder
    try:
        tier.clear()
    except StoreFault:
        pass


def _ratio(value, target, below: bool) -> str:
    if value is None:
        return "-"
    met = value <= target if below else value >= target
    return f"{value:.2f}x (target {'<=' if below else '>='} {target:g}x: {'met' if met else 'NOT met'})"


def format_bench_s3(result: dict) -> str:
    lines = [f"KVBridge bench-s3: {result['server']}"]
    if "engine" in result:
        e = result["engine"]
        lines.append(f"engine {e['label']}, namespace {e['namespace']}, chunk {e['chunk_size']}, "
                     f"{e['n_predict']} generated tokens")
    if "doc_qa" in result:
        d = result["doc_qa"]
        lines += ["", "(a) Document Q&A, every warm hit from S3 (L1 and L2 emptied before each lmcache request):",
                  format_table(d["records"]),
                  f"  cold mean TTFT {d['cold_mean_ttft_ms']:.1f} ms; lmcache mean {d['lmcache_mean_ttft_ms']:.1f} ms",
                  f"  mean speedup vs cold   {_ratio(d['mean_speedup'], MEAN_TARGET, below=False)}",
                  f"  warm median speedup    {_ratio(d['warm_median_speedup'], WARM_TARGET, below=False)}",
                  f"  warm hits {d['warm_requests']}/{d['requests']} from tiers {d['warm_tiers']}; oracle: "
                  f"{d['answers_equal']}/{d['requests']} lmcache answers equal the cold answers token for token"
                  f"{'' if not d['errors'] else '; errors: ' + '; '.join(d['errors'])}"]
    for tokens, r in (result.get("restore") or {}).items():
        lines += ["", f"(b) {r['restored_tokens']}-token restore from S3 ({r['state_bytes'] / 1e6:.1f} MB, "
                      f"{r['objects']} objects), medians of {r['repeats']}, interleaved:",
                  f"  restore (lookup + get_many + assemble) {r['restore_ms']:.1f} ms from {r['tiers']}; "
                  f"set call after it {r['set_ms']:.1f} ms (not in the ratio)",
                  f"  plain boto3 GETs of the same {r['objects']} objects ({r['value_bytes'] / 1e6:.1f} MB, same "
                  f"client, {r['threads']} threads) {r['get_ms']:.1f} ms",
                  f"  the tier's read alone {r['tier_read_ms']:.1f} ms = {r['tier_read_vs_get']:.2f}x the plain GETs",
                  f"  ratio {_ratio(r['restore_vs_get'], RESTORE_VS_GET_TARGET, below=True)}"]
    if "clients" in result:
        from kvbridge.bench.s3_clients import format_clients

        lines += ["", format_clients(result["clients"])]
    if "lookup" in result:
        c = result["lookup"]
        lines += ["", f"(c) lookup of a {c['prompt_tokens']}-token prompt ({c['keys']} keys) by a fresh process "
                      f"(HTTP requests boto3 sent; its first listing at start: {c['first_listing']}):"]
        for what, label in (("unknown_held", "held by S3, new to this process"),
                            ("known", "the same again (in the index)"), ("not_held", "keys nobody stored"),
                            ("next_prompt", "another new prompt, namespace known")):
            row = c[what]
            lines.append(f"  {label:37} {row['round_trips']:>2} request(s) {row['requests']}, {row['n_hit']:>3} hit, "
                         f"{row['ms']:.1f} ms")
        met = c["next_prompt"]["round_trips"] <= ROUND_TRIPS_TARGET
        lines.append(f"  target: one round trip for a new prompt: {'met' if met else 'NOT met'} (a process's first "
                     f"prompt of a namespace adds one GET of the namespace's text: "
                     f"{c['unknown_held']['round_trips']} in all)")
    if "down" in result:
        lines += ["", "(d) S3 down: a request's store lookup (L1 and L2 empty):"]
        for what, label in (("killed", "weed killed (port refuses)"), ("silent", "silent port (never answers)")):
            row = result["down"][what]
            if "skipped" in row:
                lines.append(f"  {label}: skipped: {row['skipped']}")
                continue
            healthy = f"healthy {row['healthy_ms']:.1f} ms, then " if "healthy_ms" in row else ""
            over = row["first_ms"] - row["timeout_s"] * 1e3
            first_met = row["first_ms"] < row["timeout_s"] * 1.5e3    # one timeout (plus its overhead), not two
            later_met = row["later_max_ms"] <= LATER_MS_TARGET
            paid = f"KVB_S3_TIMEOUT {row['timeout_s']:g} s {over:+.1f} ms" if over > 0 else \
                f"under KVB_S3_TIMEOUT {row['timeout_s']:g} s"
            lines.append(f"  {label}: {healthy}first {row['first_ms']:.1f} ms ({paid}; at most one timeout: "
                         f"{'met' if first_met else 'NOT met'}; S3 then {row['state_after_first']}); next "
                         f"{row['later']}: median {row['later_ms']:.3f} ms, max {row['later_max_ms']:.3f} ms "
                         f"(target <= {LATER_MS_TARGET:g} ms: {'met' if later_met else 'NOT met'}) against "
                         f"{row['baseline_ms']:.3f} ms with no S3 (skipped while down: {row['skipped_down']})")
    if result.get("seconds"):
        lines += ["", "wall time per part: " + ", ".join(f"{k} {v:g} s" for k, v in result["seconds"].items())]
    return "\n".join(lines)
