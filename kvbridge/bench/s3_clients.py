"""bench-s3 part (e): plain GETs of a real restore's objects with each S3 client library that is installed.

Place in the flow: the client under S3Tier (kvbridge.store.s3_link: boto3) is the restore's floor, so
the issue asks which of the well-kept clients is fastest here: boto3 (what the tier uses), obstore
(Rust object_store) and awscrt (the AWS Common Runtime's S3 client). Each GETs the same objects (the
2k-token restore's, written by the tier), all of them in parallel the way it does best: boto3 on a
pool of the tier's size, obstore on its own runtime (get_async under asyncio.gather), awscrt with one
meta request per object on its event loop. Rounds rotate the order; medians. A client that is not
installed is reported as such (obstore and awscrt are not requirements: they are measured only).
"""
from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence


def _boto3(tier) -> tuple[Callable[[Sequence[str]], int], Callable[[], None]]:
    from kvbridge.store.s3_tier import FETCH_THREADS

    pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="kvbridge-bench-boto3")

    def get(name: str) -> int:
        return len(tier._client.get_object(Bucket=tier.bucket, Key=name)["Body"].read())

    return (lambda names: sum(pool.map(get, names))), pool.shutdown


def _obstore(tier, access_key: str, secret_key: str):
    import asyncio

    import obstore
    from obstore.store import S3Store

    store = S3Store(tier.bucket, endpoint=tier.url, access_key_id=access_key, secret_access_key=secret_key,
                    region=tier.region, virtual_hosted_style_request=False, client_options={"allow_http": True})

    async def one(name: str) -> int:
        result = await obstore.get_async(store, name)
        return len(await result.bytes_async())

    async def all_of(names: Sequence[str]) -> int:
        return sum(await asyncio.gather(*(one(name) for name in names)))

    return (lambda names: asyncio.run(all_of(names))), (lambda: None)


def _awscrt(tier, access_key: str, secret_key: str):
    from urllib.parse import urlsplit

    from awscrt.auth import AwsCredentialsProvider
    from awscrt.http import HttpHeaders, HttpRequest
    from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
    from awscrt.s3 import S3Client, S3RequestTlsMode, S3RequestType

    host = urlsplit(tier.url).netloc
    loops = EventLoopGroup()
    client = S3Client(bootstrap=ClientBootstrap(loops, DefaultHostResolver(loops)), region=tier.region,
                      tls_mode=S3RequestTlsMode.DISABLED, throughput_target_gbps=10.0,
                      credential_provider=AwsCredentialsProvider.new_static(access_key, secret_key))

    def get_all(names: Sequence[str]) -> int:
        got = [0]
        lock = threading.Lock()
        done = []
        for name in names:
            def on_body(chunk, offset, **_):
                with lock:
                    got[0] += len(chunk)
            request = HttpRequest("GET", f"/{tier.bucket}/{name}", HttpHeaders([("Host", host)]))
            done.append(client.make_request(type=S3RequestType.GET_OBJECT, request=request, on_body=on_body))
        for each in done:
            each.finished_future.result(timeout=60)
        return got[0]

    return get_all, (lambda: None)


CLIENTS = {"boto3": _boto3, "obstore": _obstore, "awscrt": _awscrt}


def compare_clients(tier, names: Sequence[str], access_key: str, secret_key: str, repeats: int = 7) -> dict:
    """Median ms to GET all `names` with each installed client; the bytes each read (they must agree)."""
    made, rows = {}, {}
    for label, make in CLIENTS.items():
        try:
            made[label] = make(tier) if label == "boto3" else make(tier, access_key, secret_key)
        except ImportError as missing:
            rows[label] = {"missing": f"not installed ({missing.name}): pip install {label}"}
    times: dict[str, list[float]] = {label: [] for label in made}
    got: dict[str, int] = {}
    try:
        labels = list(made)
        for i in range(-1, repeats):               # one untimed round first (connections, imports)
            shift = i % len(labels)
            for label in labels[shift:] + labels[:shift]:
                start = time.perf_counter()
                got[label] = made[label][0](names)
                if i >= 0:
                    times[label].append((time.perf_counter() - start) * 1e3)
    finally:
        for _, close in made.values():
            close()
    for label, values in times.items():
        rows[label] = {"ms": statistics.median(values), "bytes": got[label], "version": _version(label)}
    base = rows.get("boto3", {}).get("ms")
    for row in rows.values():
        if "ms" in row and base:
            row["vs_boto3"] = row["ms"] / base
    return {"objects": len(names), "repeats": repeats, "clients": rows}


def _version(label: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(label)
    except PackageNotFoundError:
        return "?"


def format_clients(result: dict) -> str:
    lines = [f"(e) plain GETs of the 2k restore's {result['objects']} objects, each client in parallel, medians of "
             f"{result['repeats']}, rotated:"]
    for label, row in result["clients"].items():
        if "missing" in row:
            lines.append(f"  {label:8} {row['missing']}")
        else:
            lines.append(f"  {label:8} {row['version']:>8}  {row['ms']:7.1f} ms  {row['bytes'] / 1e6:.1f} MB  "
                         f"{row.get('vs_boto3', 1):.2f}x boto3")
    return "\n".join(lines)
