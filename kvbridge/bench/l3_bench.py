"""bench-l3: what L3 on Redis costs and saves, each figure next to its baseline from the same run.

Place in the flow: prompt -> chunk hashes -> **lookup -> get_many -> assemble** -> restore, with the
objects in L3 (kvbridge.store.redis_tier.RedisTier) and L1 and L2 emptied first, so every hit
crosses the network. The server is KVB_L3_URL, or a private redis-server (private_redis) when that
is not set; the bench writes under its own key prefix and removes what it wrote.

- doc_qa_from_l3 (a): the doc-qa scenario, cold vs lmcache, every warm hit served by L3
  (runner.empty_faster_tiers, the same hook as `bench --from-tier L3`); the oracle: lmcache = cold;
- bench_restore_from_l3 (b): a 2k-token restore from L3 against plain redis-py GETs of the same values;
- lookup_round_trips (c) and lookups_with_l3_down (d): kvbridge.bench.l3_wire;
- codecs: kvbridge.bench.codec_bench (e).

Deliberately left out: a Redis Cluster, a server on another host (loopback only) and any timing
threshold; the command prints the targets next to the figures and Docs/Research.md judges.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

from kvbridge.bench.cache_server_bench import restored_keys
from kvbridge.bench.l3_wire import l3_down_both_ways, l3_tier, lookup_round_trips
from kvbridge.bench.common.report import format_table, is_warm, stored_prefix, summarize, write_result_json
from kvbridge.bench.common.runner import ProgressFn, empty_faster_tiers, run_scenario
from kvbridge.errors import KVBridgeError
from kvbridge.settings import Settings
from kvbridge.store import TieredStore

MEAN_TARGET = 8.0             # doc-qa from L3: mean TTFT speedup over cold
WARM_TARGET = 25.0            # doc-qa from L3: median warm-hit speedup over cold
RESTORE_VS_GET_TARGET = 3.0   # a 2k-token restore from L3 against plain GETs of its values
ROUND_TRIPS_TARGET = 1        # a 12-hash lookup of hashes this process does not know yet


# -- (a) Document Q&A, every warm hit from L3 ------------------------------------------------------
def doc_qa_from_l3(engine, n_requests: int | None = None, document: str | None = None,
                   n_predict: int | None = None, progress: ProgressFn | None = None, tier: str = "L3") -> dict:
    """doc-qa cold then lmcache; before each lmcache request the remote writes are drained and every tier
    faster than `tier` (L3; bench-s3 passes S3) emptied."""
    records = list(run_scenario(engine, "doc-qa", ["cold", "lmcache"], n_requests=n_requests, document=document,
                                progress=progress, n_predict=n_predict,
                                before_request=empty_faster_tiers(engine.store, tier)))
    summary = summarize(records)
    cold = {r.request_index: r for r in records if r.mode == "cold"}
    lmcache = [r for r in records if r.mode == "lmcache"]
    # the oracle: greedy answers after a restore equal the cold ones (same text, same number of tokens)
    equal = [r.request_index for r in lmcache if not r.error and r.request_index in cold
             and (r.text, r.gen_tokens) == (cold[r.request_index].text, cold[r.request_index].gen_tokens)]
    warm = [r for r in lmcache if is_warm(r)]
    lm = summary.get("lmcache", {})
    return {"records": records, "summary": summary, "requests": len(lmcache), "answers_equal": len(equal),
            "warm_requests": len(warm), "warm_tiers": dict(Counter(r.tier for r in warm)),
            "warm_restored_tokens": sorted({r.matched_tokens for r in warm}),
            "warm_lookup_ms": [r.lookup_ms for r in warm], "warm_fetch_ms": [r.fetch_ms for r in warm],
            "warm_restore_ms": [r.restore_ms for r in warm],
            "cold_mean_ttft_ms": summary.get("cold", {}).get("mean_ttft_ms"),
            "lmcache_mean_ttft_ms": lm.get("mean_ttft_ms"), "lmcache_warm_median_ttft_ms": lm.get("median_warm_ttft_ms"),
            "mean_speedup": lm.get("mean_speedup_vs_cold"), "warm_median_speedup": lm.get("median_warm_speedup_vs_cold"),
            "errors": [r.error for r in records if r.error], "store": engine.store.stats()}


# -- (b) a 2k-token restore from L3 against plain GETs ---------------------------------------------
def bench_restore_from_l3(engine, url: str, prompt_tokens: int = 2048, repeats: int = 7) -> dict:
    """Restore (lookup + get_many + assemble) from L3 against redis-py GETs of the same values.

    Three actions per repeat, their order rotating: the restore; the L3 tier's own read of the same
    objects (RedisTier.get_many: one pipelined GET, each value's header and blake3 checked, no
    promotion into L1/L2 and no assembly), which says how much of the restore is the tier; and the
    plain GETs. Before each the write-behind is drained and L1, L2 emptied (untimed). The engine's
    set call is timed on its own and is not part of the ratio (a GET has no engine to load). This
    process wrote the objects, so its lookup knows them from its own index: another host's first
    lookup adds the one round trip measured in (c). One untimed round first; medians.
    """
    import redis

    store, backend, kv = engine.store, engine.backend, engine._kv
    kv.hot_restores = False   # every restore reads its objects from L3 (a hot restore reads the tail only)
    record, tokens, hashes = stored_prefix(engine, prompt_tokens)
    empty = empty_faster_tiers(store, "L3")
    empty("lmcache")
    plan = kv.plan_restore(tokens, hashes, buffer_for=backend.state_buffer)    # untimed: which objects
    tier = l3_tier(store)
    keys = restored_keys(plan, hashes, kv.seed)
    names = [tier.redis_key(key) for key in keys]
    client = redis.Redis.from_url(url, socket_timeout=30)
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
                        raise KVBridgeError(f"L3 did not return every object of the restore: {found!r:.200}")
                else:
                    got_bytes = sum(len(client.get(n) or b"") for n in names)
                    elapsed = (time.perf_counter() - start) * 1e3
                if i >= 0:
                    times[name].append(elapsed)
                    if name == "restore":
                        times["set"].append(set_ms)
                        tiers_seen[plan.tier] += 1
    finally:
        client.close()
        kv.hot_restores = True
    ms = {name: statistics.median(values) for name, values in times.items()}
    return {"restored_tokens": plan.matched_tokens, "state_bytes": len(plan.state.data), "objects": len(names),
            "value_bytes": got_bytes, "restore_ms": ms["restore"], "set_ms": ms["set"], "get_ms": ms["get"],
            "tier_read_ms": ms["tier_read"], "tier_read_vs_get": ms["tier_read"] / ms["get"],
            "restore_vs_get": ms["restore"] / ms["get"], "tiers": dict(tiers_seen), "repeats": repeats,
            "first_record_error": record.error}


# -- the command -----------------------------------------------------------------------------------
PARTS = ("doc-qa", "restore", "lookup", "down", "codecs")


def run_bench_l3(settings: Settings, make_engine: Callable, parts: Sequence[str] = PARTS, repeats: int = 7,
                 n_requests: int | None = None, quality_questions: int = 12, prompt_tokens: int = 2048,
                 document: str | None = None, progress: ProgressFn | None = None,
                 say: Callable[[str], None] = print) -> dict:
    """Every part asked for, on one L3 server (KVB_L3_URL, else a private redis-server) and one engine.

    make_engine(settings, l2_dir) -> a CachedEngine (the CLI's, kvbridge.cli.common.make_engine). The engine's
    store is L1 + a fresh L2 + L3 under a bench prefix (KVB_L3_PREFIX + "-bench-<pid>"), removed afterwards.
    """
    from kvbridge.bench.common.private_redis import private_redis

    result: dict = {"parts": list(parts)}
    with contextlib.ExitStack() as stack:
        url = settings.l3_url
        if not url:
            server = stack.enter_context(private_redis())
            url = server.url
            result["server"] = f"a private redis-server on {url} (pid {server.pid}), stopped after the run"
        else:
            from kvbridge.store.redis_link import redact

            result["server"] = f"KVB_L3_URL {redact(url)}"
        prefix = f"{settings.l3_prefix}-bench-{os.getpid()}"
        bench = settings.replace(l3_url=url, l3_prefix=prefix)
        result["prefix"] = prefix
        say(f"L3: {result['server']}; keys under {prefix}:")
        seconds = result["seconds"] = {}

        @contextlib.contextmanager
        def part(name: str):
            start = time.perf_counter()
            yield
            seconds[name] = round(time.perf_counter() - start, 1)

        if "lookup" in parts:
            with part("lookup"):
                result["lookup"] = lookup_round_trips(url, f"{prefix}-lookup", timeout=bench.l3_timeout)
        needs_engine = [p for p in parts if p != "lookup"]
        if needs_engine:
            l2 = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvb-bench-l3-l2-"))
            engine = stack.enter_context(make_engine(bench, l2))
            stack.callback(_remove_bench_objects, engine.store)
            if engine.backend.kv_mode != "full" or engine.geometry is None:
                raise KVBridgeError("bench-l3 restores KV: it needs a full-KV engine with a chunked layout "
                                    "(llamacpp, llama-server).")
            status = engine.status()
            result["engine"] = {"label": status["label"], "namespace": status["namespace_short"],
                                "chunk_size": bench.chunk_size, "n_predict": bench.n_predict}
            if "doc-qa" in parts:
                with part("doc-qa"):
                    result["doc_qa"] = doc_qa_from_l3(engine, n_requests, document, progress=progress)
            if "restore" in parts:
                with part("restore"):
                    result["restore"] = bench_restore_from_l3(engine, url, prompt_tokens, repeats)
            if "codecs" in parts:
                from kvbridge.bench.codec_bench import bench_codecs

                cold_texts = None
                if "doc_qa" in result:
                    cold_texts = [r.text for r in result["doc_qa"]["records"] if r.mode == "cold"]
                with part("codecs"):
                    result["codecs"] = bench_codecs(engine, bench, url, repeats=repeats // 2 + 1,
                                                    quality_questions=quality_questions, document=document,
                                                    cold_texts=cold_texts)
            if "down" in parts:
                with part("down"):
                    result["down"] = l3_down_both_ways(engine, bench)
    return result


def write_json(result: dict, output_dir) -> Path:
    """The whole result (every request record, every per-question row) as JSON in output_dir."""
    return write_result_json(result, output_dir, "bench-l3")


def _remove_bench_objects(store: TieredStore) -> None:
    """What the bench wrote under its prefix goes (on the user's server it must not stay behind)."""
    from kvbridge.store.objects import StoreFault

    store.drain()
    try:
        l3_tier(store).clear()
    except StoreFault:
        pass    # the server went away: nothing left to remove


def _ratio(value, target, below: bool) -> str:
    if value is None:
        return "-"
    met = value <= target if below else value >= target
    return f"{value:.2f}x (target {'<=' if below else '>='} {target:g}x: {'met' if met else 'NOT met'})"


def format_bench_l3(result: dict) -> str:
    from kvbridge.bench.codec_bench import format_codecs

    lines = [f"KVBridge bench-l3: {result['server']}"]
    if "engine" in result:
        e = result["engine"]
        lines.append(f"engine {e['label']}, namespace {e['namespace']}, chunk {e['chunk_size']}, "
                     f"{e['n_predict']} generated tokens")
    if "doc_qa" in result:
        d = result["doc_qa"]
        lines += ["", "(a) Document Q&A, every warm hit from L3 (L1 and L2 emptied before each lmcache request):",
                  format_table(d["records"]),
                  f"  cold mean TTFT {d['cold_mean_ttft_ms']:.1f} ms; lmcache mean {d['lmcache_mean_ttft_ms']:.1f} ms, "
                  f"warm median {_ms(d['lmcache_warm_median_ttft_ms'])}",
                  f"  mean speedup vs cold   {_ratio(d['mean_speedup'], MEAN_TARGET, below=False)}",
                  f"  warm median speedup    {_ratio(d['warm_median_speedup'], WARM_TARGET, below=False)}",
                  f"  warm hits {d['warm_requests']}/{d['requests']} from tiers {d['warm_tiers']}, restored tokens "
                  f"{d['warm_restored_tokens']}; lookup {_span(d['warm_lookup_ms'])} ms, fetch "
                  f"{_span(d['warm_fetch_ms'])} ms, restore "
                  f"{_span(d['warm_restore_ms'])} ms",
                  f"  oracle: {d['answers_equal']}/{d['requests']} lmcache answers equal the cold answers token "
                  f"for token{'' if not d['errors'] else '; errors: ' + '; '.join(d['errors'])}",
                  f"  store: behind_dropped {d['store']['behind_dropped']}, remote_errors {d['store']['remote_errors']}"]
    if "restore" in result:
        r = result["restore"]
        lines += ["", f"(b) {r['restored_tokens']}-token restore from L3 ({r['state_bytes'] / 1e6:.1f} MB, "
                      f"{r['objects']} objects), medians of {r['repeats']}, interleaved:",
                  f"  restore (lookup + get_many + assemble) {r['restore_ms']:.1f} ms from {r['tiers']}; "
                  f"the engine's set call after it {r['set_ms']:.1f} ms (not in the ratio)",
                  f"  plain redis-py GET of the same {r['objects']} values ({r['value_bytes'] / 1e6:.1f} MB) "
                  f"{r['get_ms']:.1f} ms",
                  f"  the L3 tier's read alone (pipelined GET + header and blake3 checks; no promotion, no "
                  f"assembly) {r['tier_read_ms']:.1f} ms = {r['tier_read_vs_get']:.2f}x the plain GETs",
                  f"  ratio {_ratio(r['restore_vs_get'], RESTORE_VS_GET_TARGET, below=True)}"]
    if "lookup" in result:
        c = result["lookup"]
        lines += ["", f"(c) lookup of {c['hashes']} hashes on a standalone server (round trips = redis-py sends "
                      f"by this thread):"]
        n = c["hashes"]
        for what, label in (("unknown_held", "lookup: held by L3, new to this store"),
                            ("known", "lookup: the same again (in the index)"),
                            ("not_held", "lookup: hashes L3 does not hold"),
                            ("restore_reads", f"then get_many of the {n} + 1 tail key"),
                            ("get_many_unknown", f"get_many of {n}, no lookup before")):
            row = c[what]
            lines.append(f"  {label:40} {row['round_trips']:>2} round trip(s), {row['replies']:>2} replies, "
                         f"{row['n_hit']:>2} hit {row['tiers']}, {row['ms']:.2f} ms")
        met = c["unknown_held"]["round_trips"] <= ROUND_TRIPS_TARGET
        lines.append(f"  target: one round trip: {'met' if met else 'NOT met'}; opening the connection took "
                     f"{c['connect_round_trips']} round trip(s) once (handshake + PING)")
    if "codecs" in result:
        lines += ["", format_codecs(result["codecs"])]
    if "down" in result:
        lines += ["", "(d) L3 stopped: a request's store lookup (lookup + the tail's get), L1 and L2 empty:"]
        for what, label in (("killed", "server killed (port refuses)"), ("silent", "silent port (never answers)")):
            row = result["down"][what]
            if "skipped" in row:
                lines.append(f"  {label}: skipped: {row['skipped']}")
                continue
            healthy = f"healthy {row['healthy_ms']:.1f} ms, then " if "healthy_ms" in row else ""
            lines.append(f"  {label}: {healthy}first {row['first_ms']:.1f} ms (KVB_L3_TIMEOUT {row['timeout_s']:g} s, "
                         f"L3 then {row['state_after_first']}); next {row['later']}: median {row['later_ms']:.2f} ms, "
                         f"max {row['later_max_ms']:.2f} ms, against {row['baseline_ms']:.2f} ms (max {row['baseline_max_ms']:.2f}) "
                         f"with no L3 at all "
                         f"(skipped while down: {row['skipped_down']})")
            if "probe_ms" in row:
                lines.append(f"    a request after the first back-off (the background prober pings, not it): {row['probe_ms']:.1f} ms; "
                             f"next retry in {row['next_retry_s']} s ({row['reason']})")
    if result.get("seconds"):
        lines += ["", "wall time per part: " + ", ".join(f"{k} {v:g} s" for k, v in result["seconds"].items())]
    return "\n".join(lines)


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _span(values: Sequence[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}" if values else "-"
