"""The namespace: the hash seed that fingerprints everything that makes KV incompatible.

Objects stored under one namespace are never restored under another: the model file's sha256,
the K/V cache types, the V layout, the state format, the engine library's version and the chunk
size all go into it. Two engines with identical KV (llama-cpp-python in-process and the llama-server
built from the same llama.cpp) get the same namespace and so share stored chunks. namespace_for is
the one builder CachedEngine and the scheduler use.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

NAMESPACE_VERSION = "kvbridge-ns-1"
_lock = threading.Lock()


def file_sha256(path: Path, cache_file: Path | None) -> str:
    """sha256 of a model file, cached by (path, device, inode, size, mtime) so a start does not re-hash 100 MB.

    The inode is part of the key: a file replaced by another (a new download, `mv` over it) gets a new
    inode even when a copy kept its size and mtime, and is hashed again.
    """
    path = Path(path).resolve()
    st = path.stat()
    cache_key = f"{path}|{st.st_dev}:{st.st_ino}|{st.st_size}|{st.st_mtime_ns}"
    with _lock:
        cache = _read_cache(cache_file)
        if cache_key in cache:
            return cache[cache_key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    value = digest.hexdigest()
    if cache_file is not None:
        with _lock:
            # one entry per path: the hash of the file this path held before is stale now
            cache = {k: v for k, v in _read_cache(cache_file).items() if not k.startswith(f"{path}|")}
            cache[cache_key] = value
            _write_cache(cache_file, cache)
    return value


def _read_cache(cache_file: Path | None) -> dict[str, str]:
    if cache_file is None or not cache_file.is_file():
        return {}
    try:
        data = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache only costs one re-hash
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(data, dict) else {}


def _write_cache(cache_file: Path, cache: dict[str, str]) -> None:
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=0, sort_keys=True))
        os.replace(tmp, cache_file)
    except OSError:
        pass  # the cache is an optimisation; hashing again next start is the only cost


def build_namespace(fingerprint: dict[str, str], chunk_size: int) -> str:
    """A readable, stable string: version, then the sorted fingerprint fields, then the chunk size."""
    parts = [NAMESPACE_VERSION] + [f"{k}={fingerprint[k]}" for k in sorted(fingerprint)] + [f"chunk={chunk_size}"]
    return "|".join(parts)


def kv_namespace(fingerprint: dict[str, str], *, model_sha256: str | None, kv_layout: str | None,
                 lossy_codecs: list[str], chunk_size: int) -> str:
    """The namespace of a full-KV engine: its fingerprint plus the model file's sha256, the KV layout's
    digest and any lossy codec a tier stores with (objects written lossy are restored only by readers
    set to the same codec). CachedEngine and the scheduler both name their objects with it."""
    fingerprint = dict(fingerprint)
    if model_sha256 is not None:
        fingerprint["model_sha256"] = model_sha256
    if kv_layout is not None:
        fingerprint["kv_layout"] = kv_layout
    if lossy_codecs:
        fingerprint["kv_codec"] = "+".join(lossy_codecs)
    return build_namespace(fingerprint, chunk_size)


def namespace_for(settings, *, fingerprint: dict[str, str], model_path: Path | None, kv_layout: str | None,
                  store) -> str:
    """The namespace an engine names its objects with: its fingerprint, the model file's sha256 (cached beside
    KVB_L2_DIR; none for a model not on this machine), the KV layout's key, the lossy codecs of `store`'s tiers
    and KVB_CHUNK_SIZE."""
    model_sha = file_sha256(model_path, sha_cache_file(settings.l2_dir)) if model_path is not None else None
    return kv_namespace(fingerprint, model_sha256=model_sha, kv_layout=kv_layout,
                        lossy_codecs=getattr(store, "lossy_codecs", []), chunk_size=settings.chunk_size)


def sha_cache_file(l2_dir: str) -> Path:
    """Where model sha256 sums are cached: beside the L2 directory."""
    return Path(l2_dir).expanduser().parent / "model-sha256.json"


def short_namespace(namespace: str) -> str:
    """A 12-hex-digit handle for status lines; the full string is shown on demand."""
    return hashlib.blake2b(namespace.encode(), digest_size=6).hexdigest()
