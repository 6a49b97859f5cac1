"""The cache server's L1 on real segment files: bytes round-trip, pages are never lost or shared,
leases protect what a client is copying, pressure acts in order, and every eviction is reported."""
from __future__ import annotations

import hashlib
import os
import random
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.cache_server.pool import (
    FREE,
    LEASED_OBJECT,
    OBJECT,
    PENDING,
    QUARANTINED,
    LeaseNotOwned,
    PagedPool,
    PressureLevel,
    StoreRefused,
    UnknownLease,
    Watermarks,
)
from kvbridge.cache_server.shm import MAGIC, Segment, SegmentUnavailable, stale_segments
from kvbridge.settings import WORK_DIR
from kvbridge.store.objects import ObjectMeta

PAGE = 4096
NO_PRESSURE = Watermarks(0.0, 0.0, 0.0, 0.0)   # a pool that evicts only when a store does not fit


def key(i: int | str) -> bytes:
    return hashlib.blake2b(f"key-{i}".encode(), digest_size=16).digest()


def blob_for(k: bytes, size: int) -> bytes:
    """Deterministic content for a key, so any mix-up between objects or pages is visible."""
    return hashlib.shake_128(k).digest(size)


def meta(note: str = "") -> ObjectMeta:
    return ObjectMeta("test-ns", 4, b"d" * 16, note=note)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make_pool(tmp_path):
    """PagedPools over segment files in tmp_path; every segment closed and removed afterwards."""
    segments: list[Segment] = []

    def make(n_pages: int = 16, page_bytes: int = PAGE, **options) -> PagedPool:
        segment = Segment.create(n_pages, page_bytes, directory=tmp_path)
        segments.append(segment)
        options.setdefault("watermarks", Watermarks())
        return PagedPool(segment, **options)

    yield make
    for segment in segments:
        segment.close(unlink=True)


def store(pool: PagedPool, k: bytes, size: int, client: str = "writer", priority: int = 9) -> tuple[int, ...]:
    """A whole client store: prepare, copy the bytes into the pages, commit. The pages used."""
    lease = pool.prepare_write(k, size, meta(), client, priority)
    pool.segment.write(list(lease.pages), blob_for(k, size))
    assert pool.commit(lease.lease_id, client)
    return lease.pages


def read_back(pool: PagedPool, k: bytes, client: str = "reader") -> bytes | None:
    lease = pool.acquire_read(k, client)
    if lease is None:
        return None
    try:
        return pool.segment.read(list(lease.pages), lease.size)
    finally:
        pool.release(lease.lease_id, client)


def fill_with_leased(pool: PagedPool, until_free: int, client: str = "holder") -> list[int]:
    """Commit one-page objects and keep a read lease on each until only `until_free` pages are free."""
    leases = []
    i = 0
    while pool.stats()["free_pages"] > until_free:
        k = key(f"held-{i}")
        store(pool, k, 100)
        leases.append(pool.acquire_read(k, client).lease_id)
        i += 1
    return leases


# -- the segment -------------------------------------------------------------------------------------
def test_a_segment_in_dev_shm_is_private_to_the_user_and_removed_on_close():
    segment = Segment.create(4, PAGE)
    try:
        assert segment.path.parent == Path("/dev/shm")
        assert stat.S_IMODE(segment.path.stat().st_mode) == 0o600
        assert segment.path.name.startswith(f"kvbridge-{os.getuid()}-{os.getpid()}-")
        assert (segment.n_pages, segment.page_bytes, segment.creator_pid) == (4, PAGE, os.getpid())
        assert len(segment.nonce) == 16
        assert segment.path.read_bytes()[:8] == MAGIC
    finally:
        segment.close(unlink=True)
    assert not segment.path.exists()
    segment.close(unlink=True)   # idempotent


def test_attach_with_the_right_nonce_shares_the_bytes_both_ways(tmp_path):
    server = Segment.create(8, PAGE, directory=tmp_path)
    client = Segment.attach(server.path, server.nonce)
    try:
        data = blob_for(b"shared", 3 * PAGE - 7)
        server.write([5, 2, 7], data)
        assert client.read([5, 2, 7], len(data)) == data
        client.write([0, 1], data[:PAGE + 1])
        assert bytes(server.view([0, 1], PAGE + 1)) == data[:PAGE + 1]
        server.set_generation([3], 42)
        assert client.generation_ok([3], 42) and not client.generation_ok([3, 4], 42)
        assert (client.n_pages, client.page_bytes, client.creator_pid) == (8, PAGE, os.getpid())
    finally:
        client.close()
        server.close(unlink=True)


def test_attach_refuses_another_servers_segment_and_names_the_file(tmp_path):
    server = Segment.create(2, PAGE, directory=tmp_path)
    try:
        with pytest.raises(SegmentUnavailable, match="nonce") as refused:
            Segment.attach(server.path, bytes(16))
        assert str(server.path) in str(refused.value)
        not_a_segment = tmp_path / "other.pool"
        not_a_segment.write_bytes(b"x" * 100)
        with pytest.raises(SegmentUnavailable, match=str(not_a_segment)):
            Segment.attach(not_a_segment, server.nonce)
        with pytest.raises(SegmentUnavailable, match="missing.pool"):
            Segment.attach(tmp_path / "missing.pool", server.nonce)
        original = server.path.read_bytes()
        for name, patched, complaint in [("magic.pool", b"NOTKVB01" + original[8:], "magic"),
                                         ("version.pool", original[:8] + (99).to_bytes(4, "little") + original[12:],
                                          "version 99"),
                                         ("short.pool", original[:-1], "bytes")]:
            (tmp_path / name).write_bytes(patched)
            with pytest.raises(SegmentUnavailable, match=complaint):
                Segment.attach(tmp_path / name, server.nonce)
    finally:
        server.close(unlink=True)


def test_close_with_a_view_still_held_does_not_crash(tmp_path):
    segment = Segment.create(2, PAGE, directory=tmp_path)
    held = segment.view([0, 1], 10)
    segment.close(unlink=True)
    assert segment.closed and not segment.path.exists()
    assert bytes(held) == bytes(10)   # the mapping lives on until the view goes
    del held


def test_stale_segments_finds_the_files_of_dead_creators_only(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    alive = Segment.create(1, PAGE, directory=tmp_path)
    orphan = Segment.create(1, PAGE, directory=tmp_path)
    orphan.close()
    stale_path = tmp_path / f"kvbridge-{os.getuid()}-{dead.pid}-00ff.pool"
    orphan.path.rename(stale_path)
    (tmp_path / f"other-{os.getuid()}-{dead.pid}-00ff.pool").write_bytes(b"")   # not ours by prefix
    try:
        assert stale_segments(tmp_path) == [stale_path]
        assert stale_segments(tmp_path / "no-such-dir") == []
    finally:
        alive.close(unlink=True)


_CONTAINED_CREATOR = r"""
import sys
from pathlib import Path
from kvbridge.cache_server.shm import Segment
directory, name = sys.argv[1:]
segment = Segment.create(1, 4096, directory=Path(directory))
segment.path.rename(Path(directory) / name)   # as a server in its own PID namespace names it: a pid not ours
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_live_servers_segment_is_not_stale_whatever_pid_its_name_carries(tmp_path):
    """The creator's lock says a server runs, not the pid in the name (in a container that pid names
    another process of this namespace, or none): a real creator process, its segment renamed to carry
    the pid of a process that is gone."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"kvbridge-{os.getuid()}-{dead.pid}-0aa0.pool"
    creator = subprocess.Popen([sys.executable, "-c", _CONTAINED_CREATOR, str(tmp_path), name], cwd=WORK_DIR,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert creator.stdout.readline().strip() == "ready"
        assert stale_segments(tmp_path) == []                     # its creator still holds the lock
        creator.stdin.write("exit\n")
        creator.stdin.flush()
        assert creator.wait(timeout=30) == 0
        assert stale_segments(tmp_path) == [tmp_path / name]      # gone: now it is stale
    finally:
        if creator.poll() is None:
            creator.kill()
            creator.wait()


# -- bytes in and out --------------------------------------------------------------------------------
def test_a_committed_object_reads_back_zero_copy_when_its_pages_are_contiguous(make_pool):
    pool = make_pool()
    k = key("a")
    pages = store(pool, k, 3 * PAGE - 1)
    assert list(pages) == [pages[0], pages[0] + 1, pages[0] + 2]
    lease = pool.acquire_read(k, "reader")
    view = pool.segment.view(list(lease.pages), lease.size)
    assert view is not None and bytes(view) == blob_for(k, 3 * PAGE - 1)
    assert pool.segment.generation_ok(list(lease.pages), lease.generation)
    del view
    pool.release(lease.lease_id, "reader")
    pool.check_invariants()


def test_a_fragmented_pool_scatters_an_object_and_it_still_reads_back(make_pool):
    pool = make_pool(16, watermarks=NO_PRESSURE)
    for i in range(16):
        store(pool, key(i), 10)
    for i in range(0, 16, 2):
        assert pool.remove(key(i))   # eight single free pages, no two adjacent
    k = key("big")
    pages = store(pool, k, 3 * PAGE)
    assert len(pages) == 3 and pool.segment.view(list(pages), 3 * PAGE) is None
    assert read_back(pool, k) == blob_for(k, 3 * PAGE)
    for i in range(1, 16, 2):
        assert read_back(pool, key(i)) == blob_for(key(i), 10)
    assert pool.stats()["free_pages"] == 5
    pool.check_invariants()


def test_allocation_takes_the_best_fitting_run(make_pool):
    pool = make_pool(16, watermarks=NO_PRESSURE)
    for i in range(16):
        store(pool, key(i), 10)
    for i in (0, 2, 3, 4, 9, 10):    # holes of one, three and two pages
        assert pool.remove(key(i))
    assert store(pool, key("two"), 2 * PAGE) == (9, 10)
    assert store(pool, key("three"), 3 * PAGE) == (2, 3, 4)
    assert store(pool, key("one"), PAGE) == (0,)


def test_generation_tells_a_copy_that_raced_a_reuse(make_pool):
    pool = make_pool(4)
    old = key("old")
    store(pool, old, 2 * PAGE)
    lease = pool.acquire_read(old, "slow-reader")
    pool.release(lease.lease_id, "slow-reader")
    assert pool.remove(old)
    assert not pool.segment.generation_ok(list(lease.pages), lease.generation)   # freed: slots zeroed
    new = key("new")
    assert store(pool, new, 2 * PAGE) == lease.pages                              # the same pages, reused
    assert not pool.segment.generation_ok(list(lease.pages), lease.generation)
    assert read_back(pool, new) == blob_for(new, 2 * PAGE)


def test_a_second_writer_of_the_same_key_keeps_the_first_object(make_pool):
    pool = make_pool(8)
    k = key("same")
    first = pool.prepare_write(k, 100, meta(), "a", 9)
    second = pool.prepare_write(k, 100, meta(), "b", 9)
    pool.segment.write(list(first.pages), blob_for(k, 100))
    pool.segment.write(list(second.pages), b"\xff" * 100)
    assert pool.commit(first.lease_id, "a") and pool.commit(second.lease_id, "b")
    assert read_back(pool, k) == blob_for(k, 100)
    assert pool.stats()["free_pages"] == 7
    with pytest.raises(StoreRefused) as refused:
        pool.prepare_write(k, 100, meta(), "c", 9)
    assert refused.value.reason == "exists"
    with pytest.raises(StoreRefused) as refused:
        pool.prepare_write(key("huge"), 9 * PAGE, meta(), "c", 9)
    assert refused.value.reason == "too_large"
    assert pool.stats()["refused"] == {"exists": 1, "busy": 0, "too_large": 1, "pressure": 0, "no_space": 0}
    pool.check_invariants()


# -- leases ------------------------------------------------------------------------------------------
def test_a_leased_object_survives_any_pressure(make_pool):
    pool = make_pool(16)
    k = key("precious")
    store(pool, k, 2 * PAGE)
    lease = pool.acquire_read(k, "reader")
    for i in range(40):
        store(pool, key(i), 3 * PAGE)
        pool.evict_to_target()
    assert pool.clear() >= 1 and not pool.remove(k)
    assert pool.contains(k) and pool.keys() == [k]
    assert pool.segment.read(list(lease.pages), lease.size) == blob_for(k, 2 * PAGE)
    assert pool.segment.generation_ok(list(lease.pages), lease.generation)
    pool.release(lease.lease_id, "reader")
    assert pool.remove(k)
    pool.check_invariants()


def test_a_lease_of_another_client_is_refused_and_nothing_changes(make_pool):
    pool = make_pool(8)
    store(pool, key("a"), 100)
    store(pool, key("b"), 100)
    mine = pool.acquire_read(key("a"), "me")
    theirs = pool.acquire_read(key("b"), "them")
    pending = pool.prepare_write(key("c"), 100, meta(), "them", 9)
    before = (pool.stats(), pool.page_map())
    with pytest.raises(LeaseNotOwned):
        pool.release([mine.lease_id, theirs.lease_id], "me")   # one foreign id refuses the whole batch
    with pytest.raises(LeaseNotOwned):
        pool.commit(pending.lease_id, "me")
    with pytest.raises(UnknownLease):
        pool.release(9999, "me")
    assert (pool.stats(), pool.page_map()) == before
    pool.release(mine.lease_id, "me")
    with pytest.raises(UnknownLease):
        pool.release(mine.lease_id, "me")                       # already released
    pool.check_invariants()


def test_an_expired_read_lease_lets_the_object_go_but_quarantines_its_pages(make_pool):
    clock = FakeClock()
    pool = make_pool(4, clock=clock, lease_timeout_s=30)
    k = key("old")
    store(pool, k, 2 * PAGE)
    lease = pool.acquire_read(k, "stuck")
    clock.now += 10
    assert pool.expire_leases() == 0
    clock.now += 21
    assert pool.expire_leases() == 1 and pool.stats()["expired"] == 1
    assert pool.remove(k)                              # no longer pinned by a live lease
    assert pool.page_map()[lease.pages[0]] == QUARANTINED
    for i in range(4):                                 # churn: never placed on the stuck client's pages
        placed = store(pool, key(i), 2 * PAGE)
        assert not set(placed) & set(lease.pages)
    assert pool.stats()["quarantined_pages"] == 2
    pool.release(lease.lease_id, "stuck")
    assert pool.stats()["quarantined_pages"] == 0
    pool.check_invariants()


def test_an_expired_write_lease_cannot_commit_and_its_pages_wait_for_the_client(make_pool):
    clock = FakeClock()
    pool = make_pool(4, clock=clock, lease_timeout_s=30)
    lease = pool.prepare_write(key("slow"), PAGE, meta(), "slow", 9)
    clock.now += 31
    assert pool.expire_leases() == 1
    assert pool.commit(lease.lease_id, "slow") is False
    assert not pool.contains(key("slow"))
    assert pool.stats()["quarantined_pages"] == 1
    assert pool.drop_client("slow") == 1
    assert pool.stats()["free_pages"] == 4
    pool.check_invariants()


# -- pressure ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("free_ratio, level", [(0.5, PressureLevel.OK), (0.2, PressureLevel.OK),
                                               (0.19, PressureLevel.SOFT), (0.09, PressureLevel.HARD),
                                               (0.04, PressureLevel.CRITICAL), (0.0, PressureLevel.CRITICAL)])
def test_watermark_levels(free_ratio, level):
    assert Watermarks().level(free_ratio) == level


def test_levels_rise_in_order_as_pending_writes_fill_the_pool(make_pool):
    pool = make_pool(40)          # SOFT below 8 free pages, HARD below 4, CRITICAL below 2
    seen = {}
    for i in range(40):
        seen[pool.stats()["free_pages"]] = pool.level()
        pool.prepare_write(key(i), 10, meta(), "writer", 9)
    seen[0] = pool.level()
    assert [seen[free] for free in (8, 7, 4, 3, 2, 1, 0)] == [
        PressureLevel.OK, PressureLevel.SOFT, PressureLevel.SOFT, PressureLevel.HARD,
        PressureLevel.HARD, PressureLevel.CRITICAL, PressureLevel.CRITICAL]
    levels = [seen[free] for free in sorted(seen, reverse=True)]
    assert levels == sorted(levels)
    assert pool.stats()["level"] == "CRITICAL"
    pool.check_invariants()


def test_hard_pressure_refuses_a_low_priority_store_and_admits_a_high_one(make_pool):
    pool = make_pool(40)
    fill_with_leased(pool, until_free=3)
    assert pool.level() == PressureLevel.HARD
    before = pool.page_map()
    with pytest.raises(StoreRefused) as refused:
        pool.prepare_write(key("low"), 10, meta(), "low", priority=1)
    assert refused.value.reason == "pressure"
    assert pool.stats()["refused"]["pressure"] == 1 and pool.page_map() == before
    pool.prepare_write(key("high"), 10, meta(), "high", priority=9)
    pool.check_invariants()


def test_cold_objects_make_room_so_a_full_unleased_pool_is_not_under_pressure(make_pool):
    pool = make_pool(40)
    for i in range(40):
        store(pool, key(i), 10)
    store(pool, key("low"), 10, client="low", priority=1)
    assert pool.stats()["refused"]["pressure"] == 0 and pool.level() <= PressureLevel.SOFT
    assert not pool.contains(key(0)) and pool.contains(key(39))   # the least recently used went first


def test_a_read_makes_an_object_the_last_to_be_evicted(make_pool):
    pool = make_pool(8, watermarks=Watermarks(0.0, 0.0, 0.0, target_free=0.5))
    for i in range(8):
        store(pool, key(i), 10)
    assert read_back(pool, key(0)) is not None
    pool.evict_to_target()
    assert pool.keys() == [key(i) for i in (5, 6, 7, 0)]


def test_critical_pressure_revokes_the_lowest_priority_pending_write(make_pool):
    pool = make_pool(40)
    lowest = pool.prepare_write(key("lowest"), 4 * PAGE, meta(), "lowest", priority=5)
    lower = pool.prepare_write(key("lower"), 2 * PAGE, meta(), "lower", priority=6)
    fill_with_leased(pool, until_free=1)
    assert pool.level() == PressureLevel.CRITICAL
    pool.prepare_write(key("urgent"), 10, meta(), "urgent", priority=9)
    assert pool.stats()["revoked"] == 1                  # the pages coming back lift CRITICAL: no more
    assert pool.commit(lowest.lease_id, "lowest") is False
    assert pool.commit(lower.lease_id, "lower") is True
    page_map = pool.page_map()
    assert all(page_map[p] == QUARANTINED for p in lowest.pages)
    assert pool.stats()["quarantined_pages"] == 4 and pool.stats()["free_pages"] == 0
    pool.check_invariants()
    pool.release(lowest.lease_id, "lowest")
    assert pool.stats()["free_pages"] == 4 and pool.stats()["quarantined_pages"] == 0
    pool.check_invariants()


# -- eviction ----------------------------------------------------------------------------------------
def test_every_eviction_reaches_on_evict_with_the_right_bytes(make_pool):
    reported: dict[bytes, bytes] = {}

    def on_evict(k: bytes, m: ObjectMeta, view: memoryview) -> None:
        assert k not in reported and m.namespace == "test-ns"
        reported[k] = bytes(view)

    pool = make_pool(16, on_evict=on_evict)
    rng = random.Random(7)
    sizes = {}
    for i in range(60):
        sizes[key(i)] = rng.randint(1, 4 * PAGE)
        store(pool, key(i), sizes[key(i)])
        if i % 10 == 9:
            pool.evict_to_target()
            assert pool.stats()["free_pages"] >= 0.3 * 16
    for k, size in sizes.items():
        if pool.contains(k):
            assert read_back(pool, k) == blob_for(k, size)
        else:
            assert reported[k] == blob_for(k, size)
    assert not set(reported) & set(pool.keys())
    assert pool.stats()["evictions"] == len(reported) == 60 - pool.object_count()


def test_page_map_draws_each_page_state(make_pool):
    clock = FakeClock()
    pool = make_pool(6, clock=clock, lease_timeout_s=30)
    pool.prepare_write(key("zombie"), 10, meta(), "z", 9)
    clock.now += 31
    pool.expire_leases()
    store(pool, key("plain"), 10)
    store(pool, key("leased"), 10)
    pool.acquire_read(key("leased"), "r")
    pool.prepare_write(key("pending"), 10, meta(), "w", 9)
    assert pool.page_map() == bytes([QUARANTINED, OBJECT, LEASED_OBJECT, PENDING, FREE, FREE])
    pool.drop_client("z")
    assert pool.page_map()[0] == FREE


# -- the contract under churn ------------------------------------------------------------------------
def test_a_random_mix_of_operations_never_loses_or_shares_a_page(make_pool):
    """Fragmentation, leases, zombies and evictions in a seeded mix; every invariant after every op."""
    rng = random.Random(20240611)
    clock = FakeClock()
    evicted: list[bytes] = []

    def size_of(k: bytes) -> int:
        return 1 + k[0] * 64   # 1..4 pages of 4096, fixed per key so content is checkable anywhere

    def on_evict(k: bytes, m: ObjectMeta, view: memoryview) -> None:
        assert bytes(view) == blob_for(k, size_of(k))
        evicted.append(k)

    pool = make_pool(16, on_evict=on_evict, clock=clock, lease_timeout_s=30,
                     watermarks=Watermarks(0.25, 0.15, 0.08, 0.4))
    clients = ["a", "b", "c"]
    reads: dict[str, list[int]] = {c: [] for c in clients}
    writes: dict[str, list[int]] = {c: [] for c in clients}
    keys = [key(i) for i in range(30)]
    done = dict.fromkeys(("prepare", "commit", "abort", "acquire", "release", "evict", "remove", "expire",
                          "drop", "clear"), 0)
    scattered = 0
    for _ in range(800):
        clock.now += rng.uniform(0, 2)   # leases held for ~20 ops or more expire on their own
        client = rng.choice(clients)
        op = rng.choices(list(done), weights=[10, 5, 2, 8, 5, 2, 2, 3, 0.5, 0.3])[0]
        if op == "prepare":
            k = rng.choice(keys)
            try:
                lease = pool.prepare_write(k, size_of(k), meta(), client, rng.randint(0, 9))
            except StoreRefused:
                continue
            scattered += any(b != a + 1 for a, b in zip(lease.pages, lease.pages[1:]))
            pool.segment.write(list(lease.pages), blob_for(k, size_of(k)))
            writes[client].append(lease.lease_id)
        elif op in ("commit", "abort") and writes[client]:
            lease_id = writes[client].pop(rng.randrange(len(writes[client])))
            if op == "abort" or not pool.commit(lease_id, client):
                pool.release(lease_id, client)    # an abort, or a revoked/expired lease let go of
        elif op == "acquire":
            k = rng.choice(keys)
            lease = pool.acquire_read(k, client)
            if lease is not None:
                assert pool.segment.read(list(lease.pages), lease.size) == blob_for(k, size_of(k))
                reads[client].append(lease.lease_id)
        elif op == "release" and reads[client]:
            pool.release(reads[client].pop(rng.randrange(len(reads[client]))), client)
        elif op == "evict":
            pool.evict_to_target()
        elif op == "remove":
            pool.remove(rng.choice(keys))
        elif op == "expire":
            pool.expire_leases()
        elif op == "drop":
            pool.drop_client(client)
            reads[client].clear()
            writes[client].clear()
        elif op == "clear":
            pool.clear()
        else:
            continue
        done[op] += 1
        pool.check_invariants()
    stats = pool.stats()
    assert all(done.values()), done
    assert scattered and evicted and stats["evictions"] == len(evicted)
    assert stats["expired"] and stats["revoked"] and stats["refused"]["pressure"], stats
    for client in clients:
        pool.drop_client(client)
    pool.clear()
    pool.check_invariants()
    assert pool.stats()["free_pages"] == 16


# -- grants: pages lent ahead of a writer's next store (issue 47) ---------------------------------------
def test_a_grant_is_filled_then_named_in_one_step_and_its_spare_pages_go_back(make_pool):
    pool = make_pool(16, watermarks=NO_PRESSURE)
    grant = pool.grant_write(3 * PAGE, "w", 5)
    assert grant is not None and len(grant.pages) == 3 and pool.stats()["write_leases"] == 1
    k = key("granted")
    pool.segment.write(list(grant.pages[:2]), blob_for(k, PAGE + 5))
    with pytest.raises(UnknownLease):
        pool.commit(grant.lease_id, "w")   # a grant is named when committed, never committed nameless
    with pytest.raises(LeaseNotOwned):
        pool.commit_granted(grant.lease_id, "other", k, PAGE + 5, meta())
    with pytest.raises(ValueError):
        pool.commit_granted(grant.lease_id, "w", k, 3 * PAGE + 1, meta())   # larger than the grant
    pool.check_invariants()
    assert pool.commit_granted(grant.lease_id, "w", k, PAGE + 5, meta()) == "stored"
    assert read_back(pool, k) == blob_for(k, PAGE + 5)
    assert pool.stats()["write_leases"] == 0 and pool.stats()["free_pages"] == 14   # the third page is free again
    pool.check_invariants()


def test_a_grant_stays_the_writers_after_an_exists_and_goes_with_its_lease_otherwise(make_pool):
    clock = FakeClock()
    pool = make_pool(8, watermarks=NO_PRESSURE, clock=clock, lease_timeout_s=30)
    store(pool, key("chunk"), 100)
    grant = pool.grant_write(PAGE, "w", 5)
    assert pool.commit_granted(grant.lease_id, "w", key("chunk"), 100, meta()) == "exists"
    assert pool.stats()["write_leases"] == 1        # still lent: the next store uses it
    clock.now += 31
    assert pool.expire_leases() == 1
    assert pool.commit_granted(grant.lease_id, "w", key("late"), 100, meta()) == "revoked"
    assert not pool.contains(key("late")) and pool.stats()["quarantined_pages"] == 1
    pool.release(grant.lease_id, "w")
    assert pool.stats()["free_pages"] == 7
    pool.check_invariants()


def test_no_grant_under_pressure_and_a_grant_never_evicts(make_pool):
    pool = make_pool(10, watermarks=Watermarks(0.3, 0.2, 0.1, 0.5))
    for i in range(6):
        store(pool, key(f"full-{i}"), PAGE)
    assert pool.grant_write(2 * PAGE, "w", 9) is None       # 4 free, 2 left after it: under SOFT pressure
    assert pool.grant_write(PAGE, "w", 9) is not None       # 3 left: still OK
    assert pool.stats()["objects"] == 6                      # nothing was evicted for either
    pool.check_invariants()


def test_a_random_mix_of_grants_and_stores_never_loses_or_shares_a_page(make_pool):
    rng = random.Random(47)
    clock = FakeClock()
    pool = make_pool(16, clock=clock, lease_timeout_s=30, watermarks=Watermarks(0.25, 0.15, 0.08, 0.4))
    keys = [key(i) for i in range(20)]
    grants: dict[str, list] = {"a": [], "b": []}
    outcomes: dict[str, int] = {}
    for _ in range(600):
        clock.now += rng.uniform(0, 2)
        client = rng.choice(list(grants))
        op = rng.choices(["grant", "fill", "store", "read", "expire", "drop", "evict"], [6, 8, 4, 4, 2, 0.5, 2])[0]
        if op == "grant":
            lease = pool.grant_write(rng.randint(1, 3) * PAGE, client, 5)
            if lease is not None:
                grants[client].append(lease)
        elif op == "fill" and grants[client]:
            lease = grants[client].pop(rng.randrange(len(grants[client])))
            k = rng.choice(keys)
            size = 1 + k[0] % len(lease.pages) * PAGE if k[0] % 3 else 1 + k[0] * 40   # may not fit
            try:
                pool.segment.write(list(lease.pages[:-(-size // PAGE)]), blob_for(k, size))
                outcome = pool.commit_granted(lease.lease_id, client, k, size, meta())
            except ValueError:
                outcome = "too_large"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            if outcome == "revoked":
                pool.release(lease.lease_id, client)
            elif outcome != "stored":
                grants[client].append(lease)
        elif op == "store":
            try:
                store(pool, rng.choice(keys[10:]), rng.randint(1, 2 * PAGE), client)
            except StoreRefused:
                pass
        elif op == "read":
            k = rng.choice(keys)
            lease = pool.acquire_read(k, client)
            if lease is not None:
                pool.release(lease.lease_id, client)
        elif op == "expire":
            pool.expire_leases()
        elif op == "drop":
            pool.drop_client(client)
            grants[client].clear()
        elif op == "evict":
            pool.evict_to_target()
        pool.check_invariants()
    assert outcomes.get("stored") and outcomes.get("exists") and outcomes.get("revoked"), outcomes
    for client in grants:
        pool.drop_client(client)
    pool.clear()
    pool.check_invariants()
    assert pool.stats()["free_pages"] == 16
