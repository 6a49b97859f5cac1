"""The tiered store on real files in temporary directories: persistence, corruption, LRU, pins, threads."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from blake3 import blake3

from kvbridge.settings import WORK_DIR, Settings
from kvbridge.errors import BadSettings
from kvbridge.engine.hashing import tokens_digest
from kvbridge.store import DiskTier, LRUPolicy, MemoryTier, ObjectMeta, StoredObject, TieredStore
from kvbridge.store.diskformat import FORMAT_VERSION, MAGIC

NS = "test-namespace"


def key(i: int | str) -> bytes:
    return blake3(f"key-{i}".encode()).digest()


def blob_for(k: bytes, size: int = 100, salt: bytes = b"") -> bytes:
    """Deterministic content for a key, so any mix-up between objects is visible."""
    return blake3(k + salt).digest(length=size)


def meta(n_tokens: int = 4, namespace: str = NS, kind: str = "chunk", note: str = "") -> ObjectMeta:
    return ObjectMeta(namespace, n_tokens, tokens_digest(list(range(n_tokens))), kind, note)


def make_store(tmp_path: Path, l1: int = 1000, l2: int = 10_000, namespace: str | None = NS) -> TieredStore:
    return TieredStore([MemoryTier(l1), DiskTier(tmp_path / "l2", l2)], namespace=namespace)


def l2_file(store: TieredStore, k: bytes) -> Path:
    return store.tiers[1].path_for(k)


def same_meta(a: ObjectMeta, b: ObjectMeta) -> bool:
    """Equal apart from last_used, which every hit refreshes."""
    return (a.namespace, a.n_tokens, a.tokens_digest, a.kind, a.note, a.created) == (
        b.namespace, b.n_tokens, b.tokens_digest, b.kind, b.note, b.created)


# -- persistence -------------------------------------------------------------------------------------
def test_new_store_over_same_directory_finds_everything_with_meta(tmp_path):
    first = make_store(tmp_path)
    stored = {key(i): (blob_for(key(i), 50 + i), meta(i + 1, kind="tail" if i == 3 else "chunk", note=f"n{i}"))
              for i in range(6)}
    for k, (blob, m) in stored.items():
        assert first.put(k, blob, m)
    first.close()

    second = make_store(tmp_path)
    assert second.lookup(list(stored)).tiers == ["L2"] * 6
    for k, (blob, m) in stored.items():
        got = second.get(k)
        assert isinstance(got, StoredObject) and got.tier == "L2"
        assert got.blob == blob and same_meta(got.meta, m)
    assert second.stats()["tiers"]["L2"]["objects"] == 6
    assert second.stats()["corrupt"] == 0


def test_l2_directory_is_created_private(tmp_path):
    store = make_store(tmp_path)
    assert (tmp_path / "l2").stat().st_mode & 0o777 == 0o700
    store.put(key(1), blob_for(key(1)), meta())
    assert l2_file(store, key(1)).parent.stat().st_mode & 0o777 == 0o700


def test_meta_json_round_trip_and_no_pickle(tmp_path):
    m = meta(7, kind="snapshot", note="ünïcode")
    assert ObjectMeta.from_json(m.to_json()) == m
    store = make_store(tmp_path)
    store.put(key(1), blob_for(key(1)), m)
    raw = l2_file(store, key(1)).read_bytes()
    assert raw.startswith(MAGIC) and b'"namespace":"test-namespace"' in raw and b"pickle" not in raw


# -- corruption: each case is a counted miss, never an exception, never wrong data ----------------
def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 7)


def _flip_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))


def _flip_header_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[data.index(b'"n_tokens":') + 11] ^= 0x01  # still valid JSON: 4 -> 5; only the checksum notices
    path.write_bytes(bytes(data))


def _set_version(version: int):
    def rewrite(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[len(MAGIC):len(MAGIC) + 4] = struct.pack("<I", version)
        path.write_bytes(bytes(data))
    return rewrite


def _garbage(path: Path) -> None:
    path.write_bytes(b"not a kvbridge file at all" * 10)


CORRUPTIONS = {
    "truncated": _truncate,
    "payload_byte": _flip_payload_byte,
    "header_byte": _flip_header_byte,
    "older_version": _set_version(FORMAT_VERSION - 1),
    "newer_version": _set_version(FORMAT_VERSION + 1),
    "garbage": _garbage,
}


@pytest.mark.parametrize("restart", [False, True], ids=["running", "restarted"])
@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_file_is_a_counted_miss(tmp_path, case, restart):
    store = make_store(tmp_path, l1=0)  # L1 off: every get reads the file
    bad, good = key("bad"), key("good")
    store.put(bad, blob_for(bad), meta())
    store.put(good, blob_for(good), meta())
    CORRUPTIONS[case](l2_file(store, bad))
    if restart:
        store = make_store(tmp_path, l1=0)

    assert store.get(bad) is None
    stats = store.stats()
    assert stats["corrupt"] == 1 and stats["misses"] == 1
    assert store.get(bad) is None and store.stats()["corrupt"] == 1  # dropped, so not counted again
    assert store.lookup([bad]).n_hit == 0
    assert store.get(good).blob == blob_for(good)
    # A newer format belongs to a newer KVBridge sharing the directory: ignored, not deleted.
    assert l2_file(store, bad).exists() == (case == "newer_version")


def test_foreign_namespace_is_a_counted_miss_and_kept(tmp_path):
    other = make_store(tmp_path, namespace="other-model")
    k = key(1)
    other.put(k, blob_for(k), meta(namespace="other-model"))

    mine = make_store(tmp_path, namespace=NS)
    assert mine.lookup([k]).n_hit == 0
    assert mine.get(k) is None
    assert mine.get(k, namespace="other-model").blob == blob_for(k)  # explicit namespace wins
    stats = mine.stats()
    assert stats["foreign"] == 2 and stats["corrupt"] == 0
    assert l2_file(mine, k).exists()  # another namespace's data is not ours to delete


def test_wrong_key_inside_file_is_corrupt(tmp_path):
    store = make_store(tmp_path, l1=0)
    a, b = key("a"), key("b")
    store.put(a, blob_for(a), meta())
    store.put(b, blob_for(b), meta())
    os.replace(l2_file(store, a), l2_file(store, b).with_name(l2_file(store, b).name + ".x"))
    l2_file(store, b).unlink()
    os.replace(l2_file(store, b).with_name(l2_file(store, b).name + ".x"), l2_file(store, b))
    assert store.get(b) is None and store.stats()["corrupt"] == 1


# -- LRU by bytes, pinning, demotion and promotion ------------------------------------------------
def test_l1_evicts_least_recently_used_by_bytes():
    store = TieredStore([MemoryTier(300)], namespace=NS)
    a, b, c, d = (key(x) for x in "abcd")
    for k in (a, b, c):
        store.put(k, blob_for(k), meta())
    store.get(a)  # a becomes most recent; b is now the oldest
    store.put(d, blob_for(d), meta())
    assert [store.contains(k) for k in (a, b, c, d)] == [True, False, True, True]
    assert store.stats()["tiers"]["L1"]["bytes"] == 300
    store.put(key("big"), blob_for(key("big"), 250), meta())  # needs room for 250: evicts c, a, d
    assert store.tiers[0].keys() == [key("big")]
    assert store.stats()["evictions"] == 4


def test_l2_evicts_least_recently_used_and_order_survives_restart(tmp_path):
    store = make_store(tmp_path, l1=0, l2=300)
    a, b, c, d = (key(x) for x in "abcd")
    for age, k in zip((30, 20, 10), (a, b, c)):
        store.put(k, blob_for(k), meta())
        os.utime(l2_file(store, k), (time.time() - age,) * 2)  # a oldest ... c newest on disk
    store = make_store(tmp_path, l1=0, l2=300)  # order comes back from mtimes
    assert store.get(a).tier == "L2"  # a touched: b is now the oldest
    store.put(d, blob_for(d), meta())
    assert [l2_file(store, k).exists() for k in (a, b, c, d)] == [True, False, True, True]
    assert store.stats()["tiers"]["L2"]["evictions"] == 1


def test_lowered_l2_capacity_trims_at_start(tmp_path):
    store = make_store(tmp_path, l1=0, l2=1000)
    for age, i in zip((40, 30, 20, 10), range(4)):
        store.put(key(i), blob_for(key(i)), meta())
        os.utime(l2_file(store, key(i)), (time.time() - age,) * 2)
    smaller = make_store(tmp_path, l1=0, l2=200)
    assert smaller.lookup([key(i) for i in range(4)]).n_hit == 0
    assert sorted(smaller.tiers[1].keys()) == sorted([key(2), key(3)])


def test_policy_skips_pinned_victims():
    policy = LRUPolicy(200)
    for name in "abc":
        policy.on_put(name.encode(), 100)
    policy.pin(b"a")
    assert policy.victims() == [b"b"]
    policy.unpin(b"a")
    assert policy.victims() == [b"a"]


def test_pinned_object_is_not_evicted():
    store = TieredStore([MemoryTier(300)], namespace=NS)
    pinned = key("pinned")
    store.put(pinned, blob_for(pinned), meta())
    with store.pinned([pinned]):
        for i in range(5):
            store.put(key(i), blob_for(key(i)), meta())
        assert store.get(pinned).blob == blob_for(pinned)
    store.put(key("after"), blob_for(key("after")), meta())
    store.put(key("after2"), blob_for(key("after2")), meta())
    store.put(key("after3"), blob_for(key("after3")), meta())
    assert not store.contains(pinned)  # unpinned, it ages out like anything else


def test_l1_eviction_demotes_to_l2(tmp_path):
    store = make_store(tmp_path, l1=200)
    a = key("a")
    store.put(a, blob_for(a), meta())
    store.clear("L2")  # now a lives only in L1
    store.put(key("b"), blob_for(key("b")), meta())
    store.put(key("c"), blob_for(key("c")), meta())  # L1 full: a is evicted, demoted to L2
    assert store.lookup([a]).tiers == ["L2"]
    assert store.stats()["demotions"] == 1
    assert store.get(a).blob == blob_for(a)


def test_get_from_l2_promotes_to_l1_and_reports_l2(tmp_path):
    store = make_store(tmp_path, l1=250)
    a, b, c = key("a"), key("b"), key("c")
    for k in (a, b, c):
        store.put(k, blob_for(k), meta())
    assert store.lookup([a, b, c]).tiers == ["L2", "L1", "L1"]
    got = store.get(a)
    assert got.tier == "L2" and got.blob == blob_for(a)
    assert store.lookup([a]).tiers == ["L1"]
    assert store.get(a).tier == "L1"
    stats = store.stats()
    assert stats["promotions"] == 1 and stats["hits"] == {"L1": 1, "L2": 1}


def test_l1_hit_keeps_the_l2_copy_recent(tmp_path):
    store = make_store(tmp_path, l1=300, l2=300)
    a, b, c, d = (key(x) for x in "abcd")
    for k in (a, b, c):
        store.put(k, blob_for(k), meta())
    assert store.get(a).tier == "L1"
    store.put(d, blob_for(d), meta())  # both tiers evict b, the least recently used everywhere
    assert sorted(store.tiers[1].keys()) == sorted([a, c, d])
    assert store.stats()["demotions"] == 0


def test_put_writes_through_to_l2_and_l1_keeps_the_callers_bytes(tmp_path):
    store = make_store(tmp_path)
    blob = blob_for(key(1))
    store.put(key(1), blob, meta())
    assert store.get(key(1)).blob is blob  # no copy in L1
    assert l2_file(store, key(1)).exists()


def test_object_larger_than_l1_goes_straight_to_l2_and_too_large_is_refused(tmp_path):
    store = make_store(tmp_path, l1=100, l2=500)
    big = key("big")
    assert store.put(big, blob_for(big, 400), meta())
    assert store.lookup([big]).tiers == ["L2"]
    assert not store.put(key("huge"), blob_for(key("huge"), 600), meta())
    assert store.stats()["put_failures"] == 1


# -- lookup, clear, stats, flush -----------------------------------------------------------------
def test_lookup_counts_leading_hits_only(tmp_path):
    store = make_store(tmp_path)
    keys = [key(i) for i in range(4)]
    for k in (keys[0], keys[1], keys[3]):
        store.put(k, blob_for(k), meta())
    assert store.lookup(keys).n_hit == 2
    assert store.lookup(keys).tiers == ["L1", "L1"]
    assert store.lookup(keys[2:]).n_hit == 0
    assert store.lookup([]).n_hit == 0


def test_clear_empties_one_tier(tmp_path):
    store = make_store(tmp_path)
    store.put(key(1), blob_for(key(1)), meta())
    store.clear("L1")
    assert store.lookup([key(1)]).tiers == ["L2"]
    store.clear("L2")
    assert store.get(key(1)) is None and not any((tmp_path / "l2").rglob("*.kvb"))
    with pytest.raises(ValueError, match="L1, L2"):
        store.clear("L3")


def test_stats_numbers(tmp_path):
    store = make_store(tmp_path, l1=250, l2=1000)
    for i in range(3):
        store.put(key(i), blob_for(key(i)), meta())
    store.get(key(2))
    store.get(key(0))  # from L2, promoted
    store.get(key("missing"))
    stats = store.stats()
    assert stats["tiers"]["L1"] == {"objects": 2, "bytes": 200, "capacity": 250, "hits": 1,
                                    "evictions": 2, "location": "memory"}
    assert stats["tiers"]["L2"]["objects"] == 3 and stats["tiers"]["L2"]["bytes"] == 300
    assert stats["tiers"]["L2"]["location"] == str(tmp_path / "l2")
    assert (stats["puts"], stats["misses"], stats["hits"], stats["evictions"]) == (3, 1, {"L1": 1, "L2": 1}, 2)
    assert stats["namespace"] == NS
    json.dumps(stats)  # plain data


def test_flush_writes_l1_only_objects_to_l2(tmp_path):
    store = make_store(tmp_path)
    store.put(key(1), blob_for(key(1)), meta())
    store.clear("L2")
    assert store.flush() == 1 and store.flush() == 0
    assert make_store(tmp_path).get(key(1)).blob == blob_for(key(1))


def test_bad_keys_and_meta_are_rejected(tmp_path):
    store = make_store(tmp_path)
    for bad in (b"", b"x" * 65, "text"):
        with pytest.raises(ValueError):
            store.put(bad, b"blob", meta())
    with pytest.raises(ValueError, match="kind"):
        meta(kind="weird")
    with pytest.raises(TypeError):
        store.put(key(1), b"blob", {"namespace": NS})
    assert store.put(b"k" * 64, b"any 64-byte key works", meta())


# -- sharing a directory, bad settings, full disk -----------------------------------------------
def test_second_store_discovers_new_files_and_misses_vanished_ones(tmp_path):
    writer, reader = make_store(tmp_path), make_store(tmp_path)
    k = key("shared")
    writer.put(k, blob_for(k), meta())
    assert reader.lookup([k]).tiers == ["L2"]  # picked up by looking at the path
    assert reader.stats()["discovered"] == 1
    writer.clear("L2")
    assert reader.get(k) is None
    assert reader.stats()["vanished"] == 1 and reader.stats()["corrupt"] == 0


def test_stale_temp_files_are_removed_at_start(tmp_path):
    store = make_store(tmp_path)
    store.put(key(1), blob_for(key(1)), meta())
    fan = l2_file(store, key(1)).parent
    stale, fresh = fan / ".old.123.tmp", fan / ".new.456.tmp"
    stale.write_bytes(b"half written")
    fresh.write_bytes(b"being written")
    os.utime(stale, (time.time() - 3600,) * 2)
    make_store(tmp_path)
    assert not stale.exists() and fresh.exists()


def test_unusable_l2_dir_names_the_setting(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    settings = Settings(l2_dir=str(blocker / "l2"), l1_bytes=1000)
    with pytest.raises(BadSettings, match="KVB_L2_DIR") as caught:
        TieredStore.from_settings(settings)
    assert "KVB_L2_ENABLED" in str(caught.value)
    l1_only = TieredStore.from_settings(Settings(l2_dir=str(blocker / "l2"), l2_enabled=False))
    assert [tier.name for tier in l1_only.tiers] == ["L1"]


def test_from_settings_builds_l1_and_l2(tmp_path):
    store = TieredStore.from_settings(Settings(l1_bytes=1234, l2_dir=str(tmp_path / "x"), l2_bytes=5678), "ns")
    assert {name: t["capacity"] for name, t in store.stats()["tiers"].items()} == {"L1": 1234, "L2": 5678}
    assert store.namespace == "ns"


FULL_DISK_SCRIPT = """
import json, resource, sys
from kvbridge.store import DiskTier, MemoryTier, ObjectMeta, TieredStore
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # files over 1 MiB fail with EFBIG
store = TieredStore([MemoryTier(0), DiskTier(sys.argv[1], 1 << 30)], namespace="ns")
meta = ObjectMeta("ns", 1, bytes(16))
too_big = store.put(b"k" * 32, b"x" * (2 << 20), meta)
small = store.put(b"s" * 32, b"y" * 1000, meta)
print(json.dumps({"too_big": too_big, "small": small, "stats": store.stats()}))
"""


def test_write_failure_is_a_counted_non_store(tmp_path):
    """A write the OS refuses (here EFBIG from a file-size limit, like ENOSPC) loses only that object."""
    done = subprocess.run([sys.executable, "-c", FULL_DISK_SCRIPT, str(tmp_path / "l2")], cwd=WORK_DIR,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["too_big"] is False and result["small"] is True
    assert result["stats"]["write_errors"] == 1 and result["stats"]["put_failures"] == 1
    assert not list((tmp_path / "l2").rglob("*.tmp"))  # the half-written temp file was removed


# -- threads --------------------------------------------------------------------------------------
def test_concurrent_put_and_get_from_threads(tmp_path):
    store = make_store(tmp_path, l1=3000, l2=6000)  # small: forces evictions, demotions, promotions
    errors: list[str] = []

    def worker(worker_id: int) -> None:
        for i in range(40):
            k = key(f"{(worker_id * 7 + i) % 50}")
            store.put(k, blob_for(k, 200), meta(note="t"))
            for probe in (key(f"{(i * 3) % 50}"), k):
                got = store.get(probe)
                if got is not None and got.blob != blob_for(probe, 200):
                    errors.append(f"wrong data for {probe.hex()[:8]}")
            store.lookup([key(j) for j in range(5)])

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    stats = store.stats()
    for tier in store.tiers:
        assert stats["tiers"][tier.name]["bytes"] == tier.bytes_used() <= tier.capacity()
        assert stats["tiers"][tier.name]["objects"] == len(tier.keys())
    assert stats["corrupt"] == 0 and stats["puts"] == 240


# -- bench-store (a command, not a timed test: this only checks it runs and reports) -------------
def test_bench_store_runs_and_reports(tmp_path):
    from kvbridge.bench.store_bench import format_report, run_bench_store

    result = run_bench_store(Settings(l2_dir=str(tmp_path / "l2")), object_mb=0.2, repeats=1)
    assert result["tiers"]["l1_get_tier"] == "L1" and result["tiers"]["l2_get_tier"] == "L2"
    assert set(result["tiers"]["ratios"]) == {"l1_put", "l1_get", "l2_put", "l2_get"}
    assert result["hashing"]["tokens_per_s"] > 0
    report = format_report(result)
    assert "M tokens/s" in report and "l2_get" in report and "file_write_fsync" in report
    assert list(tmp_path.iterdir()) == []  # the temp directory next to KVB_L2_DIR is gone


# -- tier names and order come from the store (the engine, GUI and charts read them here) --------
def test_tier_names_and_order_come_from_the_store(tmp_path):
    store = TieredStore([MemoryTier(1 << 20), DiskTier(tmp_path / "l2", 1 << 20)], namespace="t")
    try:
        assert store.tier_names == ["L1", "L2"]
        assert store.slower("L1", "L2") == "L2" and store.slower("L2", "none") == "L2"
        assert store.slower("none", "L1") == "L1" and store.slower("none", "none") == "none"
    finally:
        store.close()
