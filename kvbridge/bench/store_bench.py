"""bench-store: how fast are hashing and the store, next to the plainest way to do the same work?

Every figure is measured in the same run as its baseline, on the same bytes:
- hashing: ChunkHasher.chunk_hashes over a long token array (target >= 20 M tokens/s);
- L1 put/get against one in-memory copy of the object (L1 keeps the bytes object, it copies nothing);
- L2 put/get against a plain file write + fsync and a plain file read of the same bytes (L2 adds a
  header, a blake3 checksum each way, a temp file and a rename).
Both file baselines and L2 reads hit a warm page cache (the file was just written): this compares
the store's overhead, not the disk. `python -m kvbridge bench-store` prints format_report().
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from kvbridge.store import DiskTier, MemoryTier, ObjectMeta, TieredStore

HASH_TARGET_TOKENS_PER_S = 20e6
MB = 1e6


def _median_ms(action: Callable[[int], object], repeats: int) -> float:
    """Median wall time of action(i) over `repeats` runs, in ms (one untimed warm-up run first)."""
    return _paired_median_ms({"only": action}, repeats)["only"]


def _paired_median_ms(actions: dict[str, Callable[[int], object]], repeats: int) -> dict[str, float]:
    """Median ms of each action, run interleaved (a, b, a, b, ...) so a baseline and the operation
    compared with it see the same disk and CPU conditions; one untimed warm-up round first."""
    for action in actions.values():
        action(-1)
    times: dict[str, list[float]] = {name: [] for name in actions}
    for i in range(repeats):
        for name, action in actions.items():
            start = time.perf_counter()
            action(i)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def bench_hashing(chunk_size: int = 256, n_tokens: int = 1 << 20, repeats: int = 5) -> dict:
    from kvbridge.engine.hashing import ChunkHasher  # lazy: the store bench runs even without it

    tokens = np.random.default_rng(0).integers(0, 50_000, size=n_tokens, dtype=np.int64)
    hasher = ChunkHasher(chunk_size=chunk_size, namespace="bench-store")
    ms = _median_ms(lambda _: hasher.chunk_hashes(tokens), repeats)
    rate = n_tokens / (ms / 1e3)
    return {"tokens": n_tokens, "chunk_size": chunk_size, "ms": ms, "tokens_per_s": rate,
            "target_tokens_per_s": HASH_TARGET_TOKENS_PER_S, "meets_target": rate >= HASH_TARGET_TOKENS_PER_S}


def _plain_file_write(path: Path, blob: bytes) -> None:
    with open(path, "wb") as stream:
        stream.write(blob)
        stream.flush()
        os.fsync(stream.fileno())


def _plain_file_read(path: Path) -> bytes:
    with open(path, "rb") as stream:
        return stream.read()


def bench_tiers(object_mb: float, repeats: int, directory: Path) -> dict:
    """ms per operation for L1/L2 put/get and their baselines, all on one random object."""
    size = int(object_mb * MB)
    blob = np.random.default_rng(1).integers(0, 256, size=size, dtype=np.uint8).tobytes()
    meta = ObjectMeta(namespace="bench-store", n_tokens=256, tokens_digest=bytes(16), note="bench")
    keys = [i.to_bytes(4, "big", signed=True) * 8 for i in range(-1, repeats)]

    def key(i: int) -> bytes:
        return keys[i + 1]

    l1 = TieredStore([MemoryTier(size * (repeats + 2))], namespace="bench-store")
    # L1 of size 0 sends every put to L2 and keeps every get reading the file (nothing is promoted).
    l2 = TieredStore([MemoryTier(0), DiskTier(directory / "l2", size * (repeats + 2))], namespace="bench-store")
    plain = directory / "plain"
    plain.mkdir()
    try:
        timings = {
            **_paired_median_ms({"memory_copy": lambda i: bytes(memoryview(blob)),
                                 "l1_put": lambda i: l1.put(key(i), blob, meta)}, repeats),
            "l1_get": _median_ms(lambda i: l1.get(key(i)), repeats),
            **_paired_median_ms({"file_write_fsync": lambda i: _plain_file_write(plain / f"{i + 1}.bin", blob),
                                 "l2_put": lambda i: l2.put(key(i), blob, meta)}, repeats),
            **_paired_median_ms({"file_read": lambda i: _plain_file_read(plain / f"{i + 1}.bin"),
                                 "l2_get": lambda i: l2.get(key(i))}, repeats),
        }
        checks = {"l1_get_tier": l1.get(key(0)).tier, "l2_get_tier": l2.get(key(0)).tier}
    finally:
        l1.close()
        l2.clear("L2")
        l2.close()
    baseline_of = {"l1_put": "memory_copy", "l1_get": "memory_copy",
                   "l2_put": "file_write_fsync", "l2_get": "file_read"}
    ratios = {name: timings[name] / max(timings[base], 1e-9) for name, base in baseline_of.items()}
    rates = {name: size / MB / (ms / 1e3) if ms > 0 else float("inf") for name, ms in timings.items()}
    return {"object_bytes": size, "ms": timings, "mb_per_s": rates, "ratios": ratios,
            "baseline_of": baseline_of, **checks}


def run_bench_store(settings=None, object_mb: float = 40, repeats: int = 5, directory: str | None = None) -> dict:
    """Hashing + tier throughput; the L2 part runs in a temp directory that is removed afterwards.

    The temp directory sits next to KVB_L2_DIR (same filesystem as the real L2) unless `directory`
    is given; without settings, or when that place is not writable, in the system temp directory.
    """
    chunk_size = getattr(settings, "chunk_size", 256) or 256
    if directory is None and settings is not None:
        directory = _writable_parent(Path(settings.l2_dir).expanduser())
    result: dict = {"object_mb": object_mb, "repeats": repeats}
    try:
        result["hashing"] = bench_hashing(chunk_size=chunk_size, repeats=repeats)
    except ImportError as exc:
        result["hashing"] = {"error": f"kvbridge.engine.hashing unavailable: {exc}"}
    with tempfile.TemporaryDirectory(prefix="kvb-bench-store-", dir=directory) as temp:
        result["directory"] = temp
        result["tiers"] = bench_tiers(object_mb, repeats, Path(temp))
    return result


def _writable_parent(l2_dir: Path) -> str | None:
    try:
        l2_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return str(l2_dir.parent) if os.access(l2_dir.parent, os.W_OK) else None


def format_report(result: dict) -> str:
    lines = [f"KVBridge bench-store: {result['object_mb']:g} MB objects, median of {result['repeats']} runs, "
             f"temp dir {result['directory']}"]
    hashing = result["hashing"]
    if "error" in hashing:
        lines.append(f"hashing: {hashing['error']}")
    else:
        verdict = "meets" if hashing["meets_target"] else "BELOW"
        lines.append(
            f"hashing: {hashing['tokens']:,} tokens (chunk {hashing['chunk_size']}) in {hashing['ms']:.1f} ms = "
            f"{hashing['tokens_per_s'] / 1e6:.1f} M tokens/s ({verdict} the {hashing['target_tokens_per_s'] / 1e6:.0f} M target)")
    tiers = result["tiers"]
    lines.append(f"{'operation':<20}{'ms/op':>10}{'MB/s':>12}   ratio to baseline")
    for name in ("memory_copy", "l1_put", "l1_get", "file_write_fsync", "l2_put", "file_read", "l2_get"):
        if name in tiers["ratios"]:
            ratio = f"{tiers['ratios'][name]:.2f}x {tiers['baseline_of'][name]}"
        else:
            ratio = "(baseline)"
        lines.append(f"{name:<20}{tiers['ms'][name]:>10.2f}{tiers['mb_per_s'][name]:>12,.0f}   {ratio}")
    lines.append("L1 keeps the caller's bytes object (no copy); L2 adds a header, blake3 checksums, "
                 "temp file + rename + directory fsync; reads come from a warm page cache.")
    return "\n".join(lines)
