"""Chunk hashing: known answers from an independent implementation, plus the rules keys rely on."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from blake3 import blake3

from kvbridge.engine import hashing
from kvbridge.engine.hashing import ChunkHasher, make_hasher, pack_tokens, tail_key, tokens_digest


def reference_chunk_hashes(tokens: list[int], chunk_size: int, namespace: str) -> list[bytes]:
    """The spec written out plainly: struct-packed big-endian uint32, blake3 chained from the seed."""
    prev = blake3(namespace.encode("utf-8")).digest()
    hashes = []
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        chunk = tokens[start:start + chunk_size]
        prev = blake3(prev + struct.pack(f">{len(chunk)}I", *chunk)).digest()
        hashes.append(prev)
    return hashes


RANDOM_TOKENS = [int(t) for t in np.random.default_rng(7).integers(0, 2**32, 1000)]


def test_pinned_known_answer():
    # Pinned once from reference_chunk_hashes; a change here breaks every stored key.
    hashes = ChunkHasher(chunk_size=4, namespace="").chunk_hashes(list(range(8)))
    assert [h.hex() for h in hashes] == [
        "0c800782fd2db8292722629926e43db76d017f349f394e08b5e35a60ac8852d0",
        "3d1bd015d77dd7f8b0d96dee8e3d0cedca368503c7955ac22fd06fe1bafc02c7",
    ]
    assert ChunkHasher(4, "").seed.hex() == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


@pytest.mark.parametrize("chunk_size", [1, 3, 16, 256])
@pytest.mark.parametrize("namespace", ["", "model-abc|f16|v3", "ünïcode"])
def test_matches_reference_implementation(chunk_size, namespace):
    got = ChunkHasher(chunk_size, namespace).chunk_hashes(RANDOM_TOKENS)
    assert got == reference_chunk_hashes(RANDOM_TOKENS, chunk_size, namespace)
    assert len(got) == len(RANDOM_TOKENS) // chunk_size
    assert all(len(h) == 32 for h in got)


@pytest.mark.parametrize("as_input", [
    list, tuple,
    lambda t: np.asarray(t, dtype=np.uint32), lambda t: np.asarray(t, dtype=np.int64),
    lambda t: np.asarray(t, dtype=np.uint64), lambda t: [np.int64(x) for x in t],
], ids=["list", "tuple", "uint32", "int64", "uint64", "numpy-scalars"])
def test_every_input_type_gives_the_same_keys(as_input):
    tokens = [t % 2**31 for t in RANDOM_TOKENS]
    assert ChunkHasher(16, "ns").chunk_hashes(as_input(tokens)) == reference_chunk_hashes(tokens, 16, "ns")


def test_largest_id_is_accepted():
    tokens = [2**32 - 1] * 4
    assert ChunkHasher(4).chunk_hashes(tokens) == reference_chunk_hashes(tokens, 4, "")


def test_trailing_partial_chunk_is_not_hashed():
    hasher = ChunkHasher(16, "ns")
    full = hasher.chunk_hashes(RANDOM_TOKENS[:32])
    assert len(full) == 2
    for extra in (1, 15):
        assert hasher.chunk_hashes(RANDOM_TOKENS[:32 + extra]) == full
    assert hasher.chunk_hashes(RANDOM_TOKENS[:15]) == []
    assert hasher.chunk_hashes([]) == []


def test_key_names_the_chunk_and_everything_before_it():
    hasher = ChunkHasher(16)
    base = hasher.chunk_hashes(RANDOM_TOKENS[:64])
    assert hasher.chunk_hashes(RANDOM_TOKENS[:48]) == base[:3]  # a prefix's keys are a prefix of the keys
    changed = list(RANDOM_TOKENS[:64])
    changed[20] ^= 1  # inside chunk 1
    other = hasher.chunk_hashes(changed)
    assert other[0] == base[0]
    assert all(a != b for a, b in zip(other[1:], base[1:]))


def test_namespace_change_changes_every_hash():
    a = ChunkHasher(16, "model-a").chunk_hashes(RANDOM_TOKENS)
    b = ChunkHasher(16, "model-b").chunk_hashes(RANDOM_TOKENS)
    assert len(a) == len(b) > 0
    assert all(x != y for x, y in zip(a, b))
    assert not set(a) & set(b)


@pytest.mark.parametrize("tokens, bad, position", [
    ([5, -1, 7], -1, 1),
    ([0, 1, 2, 2**32], 2**32, 3),
    ([2**70], 2**70, 0),
    (np.array([3, 4, -5], dtype=np.int64), -5, 2),
    (np.array([2**40, 1], dtype=np.uint64), 2**40, 0),
    (np.array([1, 2, 3, -9], dtype=np.int32), -9, 3),
])
def test_ids_outside_uint32_are_rejected_with_id_and_position(tokens, bad, position):
    with pytest.raises(ValueError, match=rf"token id {bad} at position {position} is outside \[0, 2\*\*32\)"):
        ChunkHasher(1).chunk_hashes(tokens)
    with pytest.raises(ValueError):
        tokens_digest(tokens)


def test_non_integer_ids_are_rejected():
    with pytest.raises(ValueError, match="token id 1.5 at position 1 is not an integer"):
        ChunkHasher(1).chunk_hashes([1, 1.5])
    with pytest.raises(ValueError, match="flat sequence"):
        ChunkHasher(1).chunk_hashes([[1, 2], [3, 4]])


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, True])
def test_bad_chunk_size_names_the_setting(chunk_size):
    with pytest.raises(ValueError, match="KVB_CHUNK_SIZE"):
        ChunkHasher(chunk_size)


def test_pack_tokens_is_big_endian_uint32():
    assert pack_tokens([1, 256, 2**32 - 1]) == b"\x00\x00\x00\x01\x00\x00\x01\x00\xff\xff\xff\xff"
    assert pack_tokens(RANDOM_TOKENS) == struct.pack(f">{len(RANDOM_TOKENS)}I", *RANDOM_TOKENS)


def test_tokens_digest():
    tokens = RANDOM_TOKENS[:256]
    digest = tokens_digest(tokens)
    assert len(digest) == 16
    assert digest == blake3(struct.pack(">256I", *tokens)).digest(length=16)
    assert tokens_digest(np.asarray(tokens, dtype=np.uint32)) == digest
    assert tokens_digest(tokens[:-1] + [tokens[-1] ^ 1]) != digest
    assert tokens_digest([]) == blake3(b"").digest(length=16)


def test_tail_key_is_distinct_and_derived_from_the_previous_key():
    hasher = ChunkHasher(16, "ns")
    hashes = hasher.chunk_hashes(RANDOM_TOKENS[:40])
    key = tail_key(hashes[-1])
    assert key == blake3(b"kvbridge-tail-v1" + hashes[-1]).digest()
    assert len(key) == 32 and key not in hashes
    assert tail_key(hasher.seed) != tail_key(hashes[-1])
    assert hasher.last_key(RANDOM_TOKENS[:40]) == hashes[-1]
    assert hasher.last_key(RANDOM_TOKENS[:5]) == hasher.seed


def test_make_hasher_defaults_to_ours():
    hasher = make_hasher(32, "ns")
    assert isinstance(hasher, ChunkHasher)
    assert (hasher.chunk_size, hasher.namespace) == (32, "ns")


def test_make_hasher_warns_and_falls_back_when_lmcache_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(hashing, "LMCACHE_HASHER_MODULE", "kvbridge_test_absent_lmcache.token_hasher")
    monkeypatch.setattr(hashing, "LMCACHE_HASHER_DIR", tmp_path / "absent")
    with pytest.warns(RuntimeWarning, match="install_lmcache.sh"):
        hasher = make_hasher(16, "ns", prefer_lmcache=True)
    assert isinstance(hasher, ChunkHasher)
    assert hasher.chunk_hashes(RANDOM_TOKENS[:32]) == reference_chunk_hashes(RANDOM_TOKENS[:32], 16, "ns")
