"""The S3 tier against plain GETs of the same objects, on a private SeaweedFS (weed mini): Research §36.

    .venv/bin/python -m kvbridge.bench.probes.s3_probe [--objects 8] [--mib 5.75] [--repeats 5]

What it measures, side by side in one run on one endpoint and one boto3 client: a fresh tier's lookup of
objects another tier wrote (its round trips and time), S3Tier.get_many (parallel GETs, header and blake3
checked) against the same objects read with plain GETs one after another and in parallel, and what a
silent endpoint (SIGSTOP) costs: the first read (one KVB_S3_TIMEOUT) and the next (skipped). The default
sizes are a 2k-token prefix of SmolLM2-135M at KVB_CHUNK_SIZE=256: eight objects of 5.75 MiB.
No model runs here; `bench-s3` (the Document Q&A bench with every warm hit from S3) is a separate command.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from blake3 import blake3

from kvbridge.bench.common.private_s3 import private_s3
from kvbridge.settings.cmdline import Parser
from kvbridge.store.objects import ObjectMeta
from kvbridge.store.s3_tier import S3Tier

NS = "s3-probe"


def _tier(s3, prefix: str, timeout: float = 5.0) -> S3Tier:
    tier = S3Tier(s3.url, s3.bucket, access_key=s3.access_key, secret_key=s3.secret_key, prefix=prefix,
                  timeout=timeout)
    tier.wait_ready()
    return tier


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 2)


def run(objects: int, mib: float, repeats: int) -> dict:
    size = int(mib * (1 << 20))
    keys = [blake3(f"probe-{i}".encode()).digest() for i in range(objects)]
    with private_s3() as s3:
        writer = _tier(s3, "probe")
        payload = os.urandom(size)
        for key in keys:
            assert writer.put(key, payload, ObjectMeta(NS, 256, bytes(16)))
        writer.close()
        reader = _tier(s3, "probe")                     # a fresh process's view: one full listing at start
        late = _tier(s3, "probe")
        extra = [blake3(f"probe-late-{i}".encode()).digest() for i in range(objects)]
        writer = _tier(s3, "probe")
        for key in extra:
            assert writer.put(key, b"x", ObjectMeta(NS, 256, bytes(16)))
        before, started = late.calls_on_this_thread(), time.perf_counter()
        found = late.discover_many(extra)                # objects written after it listed: one listing
        lookup = {"round_trips": late.calls_on_this_thread() - before,
                  "ms": round((time.perf_counter() - started) * 1000, 2), "found": sum(f is not None for f in found)}
        client, names = reader._client, [reader.s3_key(key) for key in keys]

        def plain(name):
            return client.get_object(Bucket=s3.bucket, Key=name)["Body"].read()

        results = {
            "objects": objects, "object_mib": mib, "repeats": repeats, "lookup_of_new_objects": lookup,
            "tier_get_many_ms": _median_ms(lambda: reader.get_many(keys), repeats),
            "plain_gets_sequential_ms": _median_ms(lambda: [plain(n) for n in names], repeats),
        }
        with ThreadPoolExecutor(16) as pool:
            results["plain_gets_parallel_ms"] = _median_ms(lambda: list(pool.map(plain, names)), repeats)
        results["tier_over_parallel_plain"] = round(results["tier_get_many_ms"] / results["plain_gets_parallel_ms"], 2)
        silent = _tier(s3, "probe", timeout=1.0)
        silent.get_many(keys[:1])
        os.kill(s3.pid, signal.SIGSTOP)
        try:
            started = time.perf_counter()
            silent.get_many(keys)
            first = time.perf_counter() - started
            started = time.perf_counter()
            silent.get_many(keys)
            second = time.perf_counter() - started
        finally:
            os.kill(s3.pid, signal.SIGCONT)
        results["silent_endpoint"] = {"timeout_s": 1.0, "first_read_ms": round(first * 1000, 1),
                                      "next_read_ms": round(second * 1000, 3)}
        for tier in (reader, late, writer, silent):
            tier.close()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m kvbridge.bench.probes.s3_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=8)
    parser.add_argument("--mib", type=float, default=5.75)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.objects, args.mib, args.repeats), indent=1))


if __name__ == "__main__":
    main()
