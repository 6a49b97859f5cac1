"""A follow-up sent the instant an answer arrives, with and without in-flight reads (issue 47 §7).

`python -m kvbridge.bench.probes.inflight_probe [--reps 3] [--doc-chars 3600] [--wait-ms 250] [--l1-mb 8] [--threads 1]`

The setup where the gap showed: a document whose KV is larger than L1, L2 off, a shared L3 (a private
redis-server, started and stopped here). The answer's objects then reach L3 only through the write-behind
queue, and CachedEngine keeps that queue quiet while the next request runs. Each repeat asks a question
about a document (its own first line, so no repeat restores another's), then at once a second question
about it, on two engines side by side in one run: KVB_INFLIGHT_WAIT_MS=0 (the old behaviour) and
--wait-ms. It prints the follow-up's TTFT, the tokens it restored and whether its greedy answer equals
the cold answer (the oracle), per repeat, and the medians with their ratio. `--miss-cost` instead times what
the checks add to a lookup that misses (no model).
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from kvbridge.backends import make_backend
from kvbridge.bench.common.private_redis import private_redis
from kvbridge.bench.common.scenarios import builtin_document
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.settings import Settings
from kvbridge.settings.cmdline import Parser
from kvbridge.store import TieredStore
from kvbridge.store.redis_tier import RedisTier
from kvbridge.store.tiers import MemoryTier

QUESTION_1 = "\n\nQuestion: Who is this handbook written for? Answer in one sentence."
QUESTION_2 = "\n\nQuestion: What does the handbook say about meetings? Answer briefly."


def engine_for(settings: Settings, url: str, wait_ms: int, l1_bytes: int, prefix: str) -> CachedEngine:
    store = TieredStore([MemoryTier(l1_bytes), RedisTier(url, prefix=prefix)], write_queue=settings.l3_write_queue,
                        inflight_wait_ms=wait_ms)
    return CachedEngine(settings, make_backend("llamacpp", settings), store=store).start()


def miss_cost(rounds: int = 20, per_round: int = 200) -> None:
    """What the in-flight checks add to a lookup that misses (L1 + a real L2 directory of 512 objects, 30
    hashes, none stored, no writer), the setting off and on side by side."""
    import os
    import time

    from kvbridge.store import ObjectMeta
    from kvbridge.store.disk import DiskTier

    with tempfile.TemporaryDirectory(prefix="kvb-inflight-miss-") as directory:
        stores = {ms: TieredStore([MemoryTier(1 << 30), DiskTier(directory, 1 << 30)], namespace="ns",
                                  inflight_wait_ms=ms) for ms in (0, 250)}
        for _ in range(512):
            stores[0].put(os.urandom(16), b"x" * 1024, ObjectMeta("ns", 4, bytes(16)))
        missing = [os.urandom(16) for _ in range(30)]
        times: dict[int, list[float]] = {ms: [] for ms in stores}
        for _ in range(rounds):
            for ms, store in stores.items():
                started = time.perf_counter()
                for _ in range(per_round):
                    store.lookup(missing)
                times[ms].append((time.perf_counter() - started) / per_round * 1e6)
        for store in stores.values():
            store.close()
    for ms, found in times.items():
        print(f"KVB_INFLIGHT_WAIT_MS={ms}: a lookup of 30 hashes that misses: {statistics.median(found):.1f} us "
              f"(median of {rounds} x {per_round})")
    print(f"on / off: {statistics.median(times[250]) / statistics.median(times[0]):.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m kvbridge.bench.probes.inflight_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--doc-chars", type=int, default=3600, help="characters of the built-in handbook (~4 a token)")
    parser.add_argument("--wait-ms", type=int, default=250, help="KVB_INFLIGHT_WAIT_MS of the 'on' engine")
    parser.add_argument("--l1-mb", type=int, default=8, help="L1 of both engines, below the document's KV")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads (default 1)")
    parser.add_argument("--miss-cost", action="store_true", help="only time what the checks add to a lookup that misses")
    args = parser.parse_args(argv)
    if args.miss_cost:
        miss_cost()
        return
    # one llama.cpp thread: on a machine whose cores are shared, two spin-wait for each other at every step
    settings = Settings.from_env().replace(l2_enabled=False, n_predict=16, threads=args.threads)
    rows: dict[str, list[tuple[float, int, bool]]] = {"off (0 ms)": [], f"on ({args.wait_ms} ms)": []}
    cold_ttft: list[float] = []
    with tempfile.TemporaryDirectory(prefix="kvb-inflight-") as tmp, private_redis() as redis:
        del tmp
        engines = {"off (0 ms)": engine_for(settings, redis.url, 0, args.l1_mb << 20, "kvb-off"),
                   f"on ({args.wait_ms} ms)": engine_for(settings, redis.url, args.wait_ms, args.l1_mb << 20, "kvb-on")}
        try:
            for rep in range(args.reps):
                doc = f"Copy {rep} of the handbook.\n" + builtin_document()[:args.doc_chars]
                first_engine = next(iter(engines.values()))
                cold = first_engine.infer(doc + QUESTION_2, mode="cold")
                cold_ttft.append(cold.ttft_ms)
                order = list(engines) if rep % 2 == 0 else list(reversed(engines))   # neither always goes first
                for name in order:
                    engine = engines[name]
                    engine.infer(doc + QUESTION_1, mode="lmcache")
                    follow = engine.infer(doc + QUESTION_2, mode="lmcache")   # the instant the answer returned
                    rows[name].append((follow.ttft_ms, follow.matched_tokens or 0, follow.text == cold.text))
                    engine.store.flush()   # the queue drains before the other engine runs (no shared core)
                    print(f"rep {rep} {name:>12}: follow-up TTFT {follow.ttft_ms:8.1f} ms, restored "
                          f"{follow.matched_tokens or 0:5d} of {follow.prompt_tokens} tokens, "
                          f"answer {'equals' if follow.text == cold.text else 'DIFFERS from'} cold "
                          f"(cold TTFT {cold.ttft_ms:.1f} ms)", flush=True)
            counts = {name: engine.metrics.count("inflight_reads") for name, engine in engines.items()}
        finally:
            for engine in engines.values():
                engine.close()
    print(f"\nmedians over {args.reps} repeats (doc {args.doc_chars} chars, L1 {args.l1_mb} MB, L2 off, L3 redis):")
    print(f"  cold TTFT {statistics.median(cold_ttft):.1f} ms")
    medians = {}
    for name, found in rows.items():
        medians[name] = statistics.median(t for t, _, _ in found)
        print(f"  {name:>12}: follow-up TTFT {medians[name]:8.1f} ms, restored {statistics.median(m for _, m, _ in found):.0f}"
              f" tokens, {sum(eq for _, _, eq in found)}/{len(found)} answers equal cold, "
              f"{counts[name]} objects read in flight")
    off, on = medians.values()
    print(f"  follow-up TTFT off / on: {off / on:.2f}x")


if __name__ == "__main__":
    main()
