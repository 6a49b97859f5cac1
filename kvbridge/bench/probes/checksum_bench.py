"""What a checksum of each shared-memory object read would cost, next to the copy a restore makes.

A restore through the cache server copies each object out of the shared pages (the floor it is held
to is one copy into memory already touched, kvbridge.bench.common.report.plain_copy_ms). Checking a checksum
of every object read means one more pass over the same bytes. This measures, in one run and
interleaved (so a busy neighbour slows every candidate alike), the copy out of a real /dev/shm
segment and each candidate hash over the same mapped bytes: zlib's crc32 and blake3 (both already
dependencies), and xxhash's xxh3 and crc32c when those packages are importable (they are not
dependencies; install them into a scratch folder and put it on PYTHONPATH to compare).

    python -m kvbridge.bench.probes.checksum_bench               # 47 MB: a restored 2k-token SmolLM2 state
    python -m kvbridge.bench.probes.checksum_bench --mb 175 --repeats 15
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
from blake3 import blake3

from kvbridge.cache_server.shm import Segment
from kvbridge.settings.cmdline import Parser

PAGE = 1 << 20


def candidates() -> dict[str, Callable[[memoryview], object]]:
    """name -> a function hashing a buffer; the optional packages only when importable."""
    found: dict[str, Callable[[memoryview], object]] = {
        "zlib.crc32": zlib.crc32,
        "blake3, 1 thread": lambda view: blake3(view).digest(),
        "blake3, all cores": lambda view: blake3(view, max_threads=blake3.AUTO).digest(),
    }
    try:
        import xxhash
        found["xxh3_64"] = xxhash.xxh3_64_digest
        found["xxh3_128"] = xxhash.xxh3_128_digest
    except ImportError:
        pass
    try:
        import crc32c
        found["crc32c"] = crc32c.crc32c
    except ImportError:
        pass
    return found


def measure(size_bytes: int, repeats: int, directory: Path) -> dict[str, list[float]]:
    """ms of each round, per candidate, over `size_bytes` in a real shared-memory segment."""
    n_pages = -(-size_bytes // PAGE)
    segment = Segment.create(n_pages, PAGE, directory=directory)
    try:
        pages = list(range(n_pages))
        segment.write(pages, os.urandom(size_bytes))
        view = segment.view(pages, size_bytes)
        target = np.empty(size_bytes, dtype=np.uint8)
        target.fill(1)   # touched, like the engine's KV buffer
        source = np.frombuffer(view, dtype=np.uint8)
        runs: dict[str, Callable[[], object]] = {"copy out of shared memory": lambda: np.copyto(target, source)}
        runs.update({name: (lambda fn=fn: fn(view)) for name, fn in candidates().items()})
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append((time.perf_counter() - start) * 1000)
        del source
        view.release()
        return times
    finally:
        segment.close(unlink=True)


def table(times: dict[str, list[float]], size_bytes: int) -> str:
    copy = min(times["copy out of shared memory"])
    lines = [f"{size_bytes / 1e6:.1f} MB, {len(next(iter(times.values())))} interleaved rounds "
             f"({os.cpu_count()} cores)",
             "| pass | fastest ms | median ms | GB/s | fastest ÷ copy |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, values in times.items():
        fastest = min(values)
        lines.append(f"| {name} | {fastest:.2f} | {statistics.median(values):.2f} | "
                     f"{size_bytes / fastest / 1e6:.1f} | {fastest / copy:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=47.0, help="object size in MB (default 47)")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--dir", default="/dev/shm", help="where the segment lives (default /dev/shm)")
    args = parser.parse_args(argv)
    if args.mb <= 0 or args.repeats < 1:
        parser.error("--mb must be > 0 and --repeats >= 1")
    directory = Path(args.dir) if Path(args.dir).is_dir() else Path(tempfile.gettempdir())
    size = int(args.mb * 1e6)
    print(table(measure(size, args.repeats, directory), size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
