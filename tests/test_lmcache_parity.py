"""Parity with LMCache's real TokenHasher (lmcache 0.5.6, installed by scripts/install_lmcache.sh).

Skipped, with the reason, when neither an installed lmcache nor the extracted copy in
.lmcache-hasher/ imports. Every test compares actual digests from both implementations.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from blake3 import blake3

from kvbridge.engine.hashing import ChunkHasher, LMCacheChunkHasher, load_lmcache_token_hasher, make_hasher

try:
    TokenHasher = load_lmcache_token_hasher()
    WHY_UNAVAILABLE = ""
except ImportError as error:
    TokenHasher = None
    WHY_UNAVAILABLE = str(error)

pytestmark = pytest.mark.skipif(
    TokenHasher is None, reason=WHY_UNAVAILABLE or "LMCache's TokenHasher is not importable")

RNG = np.random.default_rng(2024)
SEQUENCES = {
    "empty": [],
    "shorter-than-a-chunk": [int(t) for t in RNG.integers(0, 49152, 10)],
    "vocab-ids": [int(t) for t in RNG.integers(0, 49152, 700)],
    "full-uint32-range": [int(t) for t in RNG.integers(0, 2**32, 300)] + [0, 2**32 - 1],
}


@pytest.mark.parametrize("name", list(SEQUENCES))
@pytest.mark.parametrize("chunk_size", [1, 16, 256])
@pytest.mark.parametrize("namespace", ["", "model:sha256=abc|kv=f16|fmt=3"])
def test_lmcache_token_hasher_gives_our_digests(name, chunk_size, namespace):
    tokens = SEQUENCES[name]
    ours = ChunkHasher(chunk_size, namespace)
    # LMCache's own call, exactly as an LMCache user would make it.
    theirs = TokenHasher(chunk_size=chunk_size, hash_algorithm="blake3").compute_chunk_hashes(
        tokens, prefix_hash=ours.seed)
    assert ours.chunk_hashes(tokens) == theirs
    assert len(theirs) == len(tokens) // chunk_size


def test_lmcache_default_seed_is_the_documented_constant():
    # With no vLLM, LMCache's NONE_HASH is blake3(12 zero bytes) (shared/REFERENCE.md).
    none_hash = TokenHasher(chunk_size=4, hash_algorithm="blake3").none_hash
    assert none_hash == blake3(bytes(12)).digest()
    assert none_hash.hex() == "7e3eff9ef7613a50340eb12677ee03b83ac759fcba9bb32705f07248d56d473b"


def test_make_hasher_delegates_to_lmcache_when_asked():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the real one is used
        hasher = make_hasher(16, "ns", prefer_lmcache=True)
    assert isinstance(hasher, LMCacheChunkHasher)
    tokens = SEQUENCES["vocab-ids"]
    assert hasher.chunk_hashes(tokens) == ChunkHasher(16, "ns").chunk_hashes(tokens)
    assert hasher.seed == ChunkHasher(16, "ns").seed


def test_wrapped_lmcache_rejects_bad_ids_like_ours():
    with pytest.raises(ValueError, match="token id -1 at position 2"):
        make_hasher(1, "", prefer_lmcache=True).chunk_hashes([1, 2, -1])
