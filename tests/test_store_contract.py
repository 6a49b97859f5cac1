"""The Tier contract, run over every tier: the same put/get/contains/remove/sizes/clear/corruption tests.

A new tier joins TIERS below; test_every_tier_is_covered fails until it does. The Redis tier runs
against one real redis-server on loopback for the whole session, each test under its own key prefix; the S3
tier against one real SeaweedFS (`weed mini`, tests/s3_helpers.py) the same way.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
from blake3 import blake3

import atexit
import uuid

from kvbridge.store import (
    CorruptObject,
    DiskTier,
    MemoryTier,
    ObjectMeta,
    StoreFault,
    Tier,
    TieredStore,
)

from tests.redis_helpers import REDIS_SERVER

NS = "contract"


def key(label: int | str) -> bytes:
    return blake3(f"key-{label}".encode()).digest()


def blob_for(k: bytes, size: int = 100) -> bytes:
    return blake3(k).digest(length=size)


def meta(n_tokens: int = 4, note: str = "") -> ObjectMeta:
    return ObjectMeta(NS, n_tokens, blake3(bytes(n_tokens)).digest(length=16), note=note)


def _flip_last_byte(tier: DiskTier, k: bytes) -> None:
    path = tier.path_for(k)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


_redis_server = None


def _redis_tier(directory: Path, capacity: int) -> Tier:
    """A RedisTier on the session's server, under a prefix of its own (skipped without redis-server)."""
    global _redis_server
    if not REDIS_SERVER:
        pytest.skip("redis-server not found: ./scripts/setup.sh installs Debian's redis-server")
    from kvbridge.store.redis_tier import RedisTier
    from tests.redis_helpers import RedisServer

    if _redis_server is None:
        _redis_server = RedisServer().start()
        atexit.register(_redis_server.close)
    return RedisTier(_redis_server.url, prefix=f"contract-{uuid.uuid4().hex[:8]}", capacity=capacity, timeout=5.0)


def _flip_last_value_byte(tier: Tier, k: bytes) -> None:
    with _redis_server.client() as client:
        name = tier.redis_key(k)
        value = client.get(name)
        client.setrange(name, len(value) - 1, bytes([value[-1] ^ 0x01]))


def _s3_tier(directory: Path, capacity: int) -> Tier:
    """An S3Tier on the session's SeaweedFS (weed mini), under a prefix of its own (skipped without weed)."""
    from tests.s3_helpers import s3_tier, session_s3

    return s3_tier(session_s3(), capacity=capacity)


def _flip_last_object_byte(tier: Tier, k: bytes) -> None:
    client = tier._client
    value = client.get_object(Bucket=tier.bucket, Key=tier.s3_key(k))["Body"].read()
    client.put_object(Bucket=tier.bucket, Key=tier.s3_key(k), Body=value[:-1] + bytes([value[-1] ^ 0x01]))


# name -> (build a tier of a capacity in a directory, corrupt a stored object or None when it cannot be)
TIERS: dict[str, tuple[Callable[[Path, int], Tier], Callable[[Tier, bytes], None] | None]] = {
    "memory": (lambda directory, capacity: MemoryTier(capacity), None),  # holds the caller's own bytes
    "disk": (lambda directory, capacity: DiskTier(directory / "l2", capacity), _flip_last_byte),
    "redis": (_redis_tier, _flip_last_value_byte),
    "s3": (_s3_tier, _flip_last_object_byte),
}


@pytest.fixture(params=sorted(TIERS))
def kind(request) -> str:
    return request.param


# Tiers that keep their own copy of the bytes (so something stored can be damaged); MemoryTier holds
# the caller's own bytes, so the corruption contract does not apply to it rather than being skipped.
CORRUPTIBLE = sorted(k for k, (_, corrupt) in TIERS.items() if corrupt is not None)


@pytest.fixture
def tier(kind, tmp_path) -> Tier:
    return TIERS[kind][0](tmp_path, 10_000)


def test_every_tier_is_covered(tmp_path):
    def all_subclasses(cls: type) -> set[type]:
        return {sub for direct in cls.__subclasses__() for sub in {direct} | all_subclasses(direct)}

    covered = {type(build(tmp_path / name, 0)) for name, (build, _) in TIERS.items()}
    # the project's tiers (a test's own subclass, loaded when the suite runs together, is not one)
    assert covered == {cls for cls in all_subclasses(Tier) if cls.__module__.startswith("kvbridge.")}


def test_put_then_get_returns_the_same_bytes_and_meta(tier):
    k, m = key(1), meta(7, note="x")
    assert tier.put(k, blob_for(k), m)
    assert tier.contains(k) and tier.keys() == [k]
    blob, got = tier.get(k)
    assert blob == blob_for(k) and (got.n_tokens, got.tokens_digest, got.note) == (7, m.tokens_digest, "x")
    assert tier.meta(k).n_tokens == 7
    assert tier.size(k) == 100


def test_absent_key_is_none_everywhere(tier):
    k = key("absent")
    assert not tier.contains(k)
    assert tier.get(k) is None and tier.meta(k) is None and tier.size(k) is None
    tier.remove(k)  # removing what is not there is fine


def test_sizes_follow_puts_replacements_and_removes(tier):
    for i, size in enumerate((100, 250, 40)):
        tier.put(key(i), blob_for(key(i), size), meta())
    assert tier.bytes_used() == 390
    tier.put(key(1), blob_for(key(1), 10), meta())  # a replacement counts its new size only
    assert tier.bytes_used() == 150 and tier.size(key(1)) == 10
    assert sorted(size for _, size, _ in tier.entries()) == [10, 40, 100]
    tier.remove(key(0))
    assert tier.bytes_used() == 50 and not tier.contains(key(0)) and tier.get(key(0)) is None


def test_clear_empties_the_tier_except_what_it_is_told_to_keep(tier):
    for i in range(4):
        tier.put(key(i), blob_for(key(i)), meta())
    tier.clear(keep={key(2)})
    assert tier.keys() == [key(2)] and tier.bytes_used() == 100
    tier.clear()
    assert tier.keys() == [] and tier.bytes_used() == 0 and tier.get(key(2)) is None


def test_capacity_is_reported_not_enforced(kind, tmp_path):
    """Deciding what to evict is the store's job (one LRU policy), so a tier takes what it is given."""
    tier = TIERS[kind][0](tmp_path, 50)
    assert tier.capacity() == 50
    assert tier.put(key(1), blob_for(key(1), 80), meta()) and tier.bytes_used() == 80


@pytest.mark.parametrize("kind", CORRUPTIBLE)
def test_corrupt_object_raises_a_store_fault_then_is_gone(kind, tier):
    corrupt = TIERS[kind][1]
    k = key("bad")
    tier.put(k, blob_for(k), meta())
    corrupt(tier, k)
    with pytest.raises(CorruptObject) as caught:
        tier.get(k)
    assert isinstance(caught.value, StoreFault)
    assert not tier.contains(k) and tier.get(k) is None and tier.bytes_used() == 0


@pytest.mark.parametrize("kind", CORRUPTIBLE)
def test_corrupt_object_is_a_counted_miss_in_the_store(kind, tier):
    corrupt = TIERS[kind][1]
    store = TieredStore([tier], namespace=NS)
    k = key("bad")
    store.put(k, blob_for(k), meta())
    store.drain()   # a remote tier is written behind the put
    corrupt(tier, k)
    assert store.get(k) is None
    stats = store.stats()
    assert (stats["corrupt"], stats["misses"], stats["tiers"][tier.name]["bytes"]) == (1, 1, 0)


def test_the_store_keeps_each_tier_within_capacity(tier):
    store = TieredStore([tier], namespace=NS)
    for i in range(150):
        store.put(key(i), blob_for(key(i), 100), meta())
        store.drain()   # a remote tier is written behind the put
    assert tier.bytes_used() == store.stats()["tiers"][tier.name]["bytes"] == 10_000
    assert store.lookup([key(149)]).n_hit == 1 and store.lookup([key(0)]).n_hit == 0
