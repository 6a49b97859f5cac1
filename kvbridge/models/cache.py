"""zoo_model(): a zoo model made once and kept, so tests and benchmarks share one file per (arch, size, seed).

Place in the flow: a test or benchmark asks **zoo_model("lfm2")** -> the cached file if one exists
under models/zoo/ (the folder the embedded models live in: the checkout's models/, or the per-user
data folder of an installed package) -> else catalog.make_model writes it.

The file name carries a digest of everything that decides its bytes (GENERATOR_VERSION, the
architecture, its widths at that size, the seed, the gguf and numpy versions), so a changed generator never serves a
stale file. make_model writes beside the target and renames, so a concurrent test process sees
either no file or a whole one; two processes racing both write the same bytes, and the last rename wins.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path

from kvbridge.models.catalog import GENERATOR_VERSION, check_size, make_model, zoo_arch
from kvbridge.settings.models import MODELS_DIR

ZOO_DIR = MODELS_DIR / "zoo"


def model_digest(arch: str, size: str, seed: int) -> str:
    versions = [importlib.metadata.version(package) for package in ("gguf", "numpy")]
    text = (f"zoo v{GENERATOR_VERSION}|{arch}|{size}|{zoo_arch(arch).dims(size)}|{seed}"
            f"|gguf {versions[0]}|numpy {versions[1]}")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def zoo_model(arch: str, size: str = "test", seed: int = 0, directory: Path | None = None) -> Path:
    """The path of zoo model `arch` at `size`, made now if it is not cached yet."""
    zoo_arch(arch)      # an unknown name fails here, naming the known ones
    check_size(size)
    path = (directory or ZOO_DIR) / f"{arch}-{size}-s{seed}-{model_digest(arch, size, seed)}.gguf"
    if not path.is_file():
        make_model(arch, path, size, seed)
    return path
