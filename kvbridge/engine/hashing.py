"""Chunk keys: LMCache-compatible rolling blake3 hashes of token ids.

Place in the flow: prompt -> tokens -> **chunk hashes** -> lookup -> restore -> suffix prefill -> store.
A prompt's tokens are cut into chunks of `chunk_size`; chunk i is named by

    h_0 = blake3(seed || pack(chunk_0)),   h_i = blake3(h_{i-1} || pack(chunk_i))

where pack() writes each id as a big-endian uint32 and seed = blake3(namespace). This is exactly
LMCache's `TokenHasher.compute_chunk_hashes(tokens, prefix_hash=seed)`, so a key names a chunk *and
everything before it*, and the namespace (model, KV layout, ...) keeps incompatible KV apart.
Only complete chunks get a hash; the trailing partial chunk is handled by `tail_key()`.

Deliberately left out: LMCache's vLLM hash functions (sha256_cbor, builtin `hash()`): blake3 is
the one that is stable across processes without vLLM and needs nothing but the `blake3` package.
"""
from __future__ import annotations

import array
import importlib
import sys
import warnings
from collections.abc import Sequence
from typing import Protocol

import numpy as np
from blake3 import blake3

from kvbridge.settings import DATA_HOME

MAX_TOKEN_ID = 2**32 - 1
TOKEN_DIGEST_BYTES = 16
TAIL_KEY_PREFIX = b"kvbridge-tail-v1"
# scripts/install_lmcache.sh extracts LMCache's token_hasher.py here (git-ignored).
LMCACHE_HASHER_DIR = DATA_HOME / ".lmcache-hasher"
LMCACHE_HASHER_MODULE = "lmcache.v1.multiprocess.token_hasher"

TokenIds = Sequence[int] | np.ndarray


def pack_tokens(tokens: TokenIds) -> bytes:
    """Token ids as big-endian uint32 bytes (LMCache's `struct.pack(">nI", ...)`), in one numpy pass."""
    return _as_id_array(tokens).astype(">u4").tobytes()


def tokens_digest(tokens: TokenIds) -> bytes:
    """16-byte blake3 of the packed ids: travels with a stored object so a hash hit can be confirmed."""
    return blake3(pack_tokens(tokens)).digest(length=TOKEN_DIGEST_BYTES)


def tail_key(prev_hash_or_seed: bytes) -> bytes:
    """Key of the partial last chunk's KV: filed under the last full chunk's hash (or the seed)."""
    return blake3(TAIL_KEY_PREFIX + bytes(prev_hash_or_seed)).digest()


class ChunkHasherLike(Protocol):
    chunk_size: int
    namespace: str
    seed: bytes

    def chunk_hashes(self, tokens: TokenIds) -> list[bytes]: ...


class ChunkHasher:
    """Rolling chunk hashes under a namespace; bit-identical to LMCache's TokenHasher (blake3)."""

    def __init__(self, chunk_size: int = 256, namespace: str = ""):
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a whole number >= 1 (KVB_CHUNK_SIZE), got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.namespace = namespace
        self.seed = blake3(namespace.encode("utf-8")).digest()

    def __repr__(self) -> str:
        return f"ChunkHasher(chunk_size={self.chunk_size}, namespace={self.namespace!r})"

    def chunk_hashes(self, tokens: TokenIds) -> list[bytes]:
        """One 32-byte key per complete chunk; the trailing partial chunk is not hashed."""
        ids = _as_id_array(tokens)
        n_full = len(ids) // self.chunk_size
        if n_full == 0:
            return []
        packed = memoryview(ids[: n_full * self.chunk_size].astype(">u4").tobytes())
        step = self.chunk_size * 4
        prev = self.seed
        hashes = []
        append = hashes.append
        # One Python call per chunk is the floor here; slicing a memoryview copies nothing.
        for start in range(0, n_full * step, step):
            prev = blake3(prev + packed[start:start + step]).digest()
            append(prev)
        return hashes

    def last_key(self, tokens: TokenIds) -> bytes:
        """The hash of the last complete chunk, or the seed when there is none (what tail_key() takes)."""
        hashes = self.chunk_hashes(tokens)
        return hashes[-1] if hashes else self.seed


class LMCacheChunkHasher:
    """LMCache's own TokenHasher behind the ChunkHasher API (for parity checks and the curious)."""

    def __init__(self, token_hasher_cls: type, chunk_size: int = 256, namespace: str = ""):
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a whole number >= 1 (KVB_CHUNK_SIZE), got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.namespace = namespace
        self.seed = blake3(namespace.encode("utf-8")).digest()
        self._token_hasher = token_hasher_cls(chunk_size=chunk_size, hash_algorithm="blake3")

    def __repr__(self) -> str:
        return f"LMCacheChunkHasher(chunk_size={self.chunk_size}, namespace={self.namespace!r})"

    def chunk_hashes(self, tokens: TokenIds) -> list[bytes]:
        # Our range check first, so bad ids fail the same way whichever hasher is in use.
        ids = _as_id_array(tokens).tolist()
        return self._token_hasher.compute_chunk_hashes(ids, prefix_hash=self.seed)


def load_lmcache_token_hasher() -> type:
    """LMCache's TokenHasher class: an installed lmcache, else the copy install_lmcache.sh extracted.

    Raises ImportError (with what to run) when neither imports.
    """
    try:
        return importlib.import_module(LMCACHE_HASHER_MODULE).TokenHasher
    except ImportError as first_error:
        if not LMCACHE_HASHER_DIR.is_dir():
            raise ImportError(
                f"LMCache's TokenHasher is not importable ({first_error}); run ./scripts/install_lmcache.sh"
            ) from first_error
    if str(LMCACHE_HASHER_DIR) not in sys.path:
        sys.path.insert(0, str(LMCACHE_HASHER_DIR))
    for name in [m for m in sys.modules if m == "lmcache" or m.startswith("lmcache.")]:
        del sys.modules[name]  # a half-imported real lmcache must not shadow the extracted copy
    try:
        return importlib.import_module(LMCACHE_HASHER_MODULE).TokenHasher
    except ImportError as error:
        raise ImportError(
            f"LMCache's TokenHasher in {LMCACHE_HASHER_DIR} does not import ({error}); "
            "run ./scripts/install_lmcache.sh again"
        ) from error


def make_hasher(chunk_size: int = 256, namespace: str = "", prefer_lmcache: bool = False) -> ChunkHasherLike:
    """Our ChunkHasher, or LMCache's TokenHasher when asked (KVB_PREFER_LMCACHE_HASHER) and importable."""
    if prefer_lmcache:
        try:
            return LMCacheChunkHasher(load_lmcache_token_hasher(), chunk_size, namespace)
        except ImportError as error:
            warnings.warn(f"{error}. Using KVBridge's own hasher, which gives identical keys.",
                          RuntimeWarning, stacklevel=2)
    return ChunkHasher(chunk_size, namespace)


def _as_id_array(tokens: TokenIds) -> np.ndarray:
    """Token ids as a 1-D integer array, every id in [0, 2**32); ValueError naming the first bad one."""
    ids = _list_as_int64(tokens) if isinstance(tokens, (list, tuple)) else np.asarray(tokens)
    if ids.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if ids.ndim != 1:
        raise ValueError(f"token ids must be a flat sequence, got an array of shape {ids.shape}")
    if ids.dtype.kind not in "iu":
        return _checked_slowly(tokens if isinstance(tokens, (list, tuple)) else ids.tolist())
    if ids.dtype.kind == "u" and ids.dtype.itemsize <= 4:
        return ids
    if ids.dtype.kind == "i" and ids.dtype.itemsize <= 4:
        bad = ids < 0
    else:
        bad = (ids < 0) | (ids > MAX_TOKEN_ID)
    if bad.any():
        position = int(np.flatnonzero(bad)[0])
        raise _bad_id(ids[position], position)
    return ids


def _list_as_int64(tokens: list[int] | tuple[int, ...]) -> np.ndarray:
    """A list of ints through array.array: about twice as fast as np.asarray on a Python list."""
    try:
        return np.frombuffer(array.array("q", tokens), dtype=np.int64)
    except (OverflowError, TypeError):  # huge ints or non-ints: let numpy build it and the checks name them
        return np.asarray(tokens)


def _checked_slowly(values: Sequence) -> np.ndarray:
    """Ids numpy did not make an integer array of (huge ints, floats, mixed): find the offender, else convert."""
    for position, value in enumerate(values):
        if not isinstance(value, (int, np.integer)):
            raise ValueError(f"token id {value!r} at position {position} is not an integer")
        if not 0 <= value <= MAX_TOKEN_ID:
            raise _bad_id(value, position)
    return np.asarray(values, dtype=np.uint32)


def _bad_id(value: object, position: int) -> ValueError:
    return ValueError(
        f"token id {int(value)} at position {position} is outside [0, 2**32): "
        "LMCache-compatible hashing packs ids as unsigned 32-bit integers"
    )
