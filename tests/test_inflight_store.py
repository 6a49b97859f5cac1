"""A lookup sees writes that have not landed yet (issue 47, kvbridge.store.tiered_inflight), with real tiers.

Two cases. An object of this store still in its write-behind queue (a slow directory tier that stands in
for L3: same flags, a put that takes real time) is read from the queued bytes at once. Another writer's
write into a shared L2 directory (a real temp file written by diskformat.write_temp_file, the writer L2
itself uses, by a live process: this one) is waited for: found when it lands within KVB_INFLIGHT_WAIT_MS,
a miss at the bound when it does not, a miss at once when the write fails (its temp file goes). With the
setting at 0 both are misses, as before.
"""
from __future__ import annotations

import os
import threading
import time

import pytest

from kvbridge.store import ObjectMeta, TieredStore
from kvbridge.store.disk import DiskTier
from kvbridge.store.diskformat import write_temp_file
from kvbridge.store.tiers import MemoryTier

NS = "ns-inflight"


class SlowRemoteDir(DiskTier):
    """A directory tier flagged remote (written behind the request, as L3 is) whose put takes `delay` s."""

    remote = True

    def __init__(self, directory, delay: float, name: str = "L3", fail: bool = False) -> None:
        super().__init__(directory, 1 << 30, name=name)
        self.delay, self.fail = delay, fail

    def put(self, key, blob, meta) -> bool:
        time.sleep(self.delay)
        return False if self.fail else super().put(key, blob, meta)

    def health(self) -> dict:
        return {"up": True}


def meta(n: int = 4, namespace: str = NS) -> ObjectMeta:
    return ObjectMeta(namespace, n, bytes(16))


def key(i: int) -> bytes:
    return bytes([i]) * 16


@pytest.fixture
def slow_store(tmp_path):
    made: list[TieredStore] = []

    def make(wait_ms: int = 250, delay: float = 1.0, fail: bool = False) -> TieredStore:
        # an L1 too small for any object: every object is only in the queue for "L3" until it lands
        store = TieredStore([MemoryTier(8), SlowRemoteDir(tmp_path / f"l3-{len(made)}", delay, fail=fail)],
                            namespace=NS, inflight_wait_ms=wait_ms)
        made.append(store)
        return store

    yield make
    for store in made:
        store.drain(10)
        store.close()


def test_a_queued_write_is_read_from_its_bytes_at_once(slow_store):
    store = slow_store(delay=1.0)
    blobs = {i: os.urandom(4096) for i in range(3)}
    for i, blob in blobs.items():
        assert store.put(key(i), blob, meta())
    started = time.monotonic()
    found = store.lookup([key(0), key(1), key(2), key(9)])
    got = store.get_many([key(0), key(1), key(2)])
    one = store.get(key(2))
    took = time.monotonic() - started
    assert found.n_hit == 3 and found.tiers == ["L3"] * 3
    assert [obj.blob for obj in got] == [blobs[0], blobs[1], blobs[2]] and one.blob == blobs[2]
    assert took < 0.5, f"a queued write is read at once, not waited for ({took:.2f} s)"
    assert store.take_inflight() == {"inflight_reads": 4}
    assert store.take_inflight() == {}   # handed over once
    assert store.drain(10)
    assert store.lookup([key(0), key(1), key(2)]).n_hit == 3   # and then from the tier itself
    assert store.get(key(1)).blob == blobs[1] and store.take_inflight() == {}


def test_the_newest_queued_write_wins_and_another_namespace_is_a_miss(slow_store):
    store = slow_store(delay=0.5)
    store.put(key(1), b"old" * 100, meta())
    store.put(key(1), b"new" * 100, meta())
    store.put(key(2), b"theirs" * 100, meta(namespace="other"))
    assert store.get(key(1)).blob == b"new" * 100
    assert store.lookup([key(2)]).n_hit == 0 and store.get(key(2)) is None
    assert store.get(key(2), namespace="other").blob == b"theirs" * 100


def test_a_write_that_will_fail_is_still_served_while_queued_and_missed_after(slow_store):
    store = slow_store(delay=0.3, fail=True)
    store.put(key(1), b"x" * 1000, meta())
    assert store.get(key(1)).blob == b"x" * 1000   # the bytes are right whatever the tier does with them
    assert store.drain(10)
    assert store.lookup([key(1)]).n_hit == 0 and store.get(key(1)) is None


def test_wait_ms_zero_keeps_the_old_behaviour(slow_store):
    store = slow_store(wait_ms=0, delay=0.5)
    store.put(key(1), b"x" * 1000, meta())
    assert store.lookup([key(1)]).n_hit == 0 and store.get(key(1)) is None
    assert store.take_inflight() == {}


# -- another writer's write into a shared L2 directory ------------------------------------------------

def other_writer(directory, k: bytes, blob: bytes, *, then: str, after: float) -> threading.Thread:
    """Another writer of a shared L2 directory, mid-put: its temp file is there now; after `after` s it
    either renames it into place ("land") or removes it ("fail")."""
    tier = DiskTier(directory, 1 << 30)
    path = tier.path_for(k)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    temp = write_temp_file(path, k, blob, meta())
    tier.close()

    def finish():
        time.sleep(after)
        if then == "land":
            os.replace(temp, path)
        else:
            os.unlink(temp)

    thread = threading.Thread(target=finish, daemon=True)
    thread.start()
    return thread


def shared_store(directory, wait_ms: int) -> TieredStore:
    return TieredStore([MemoryTier(1 << 20), DiskTier(directory, 1 << 30)], namespace=NS, inflight_wait_ms=wait_ms)


def test_another_writers_write_that_lands_within_the_bound_is_waited_for(tmp_path):
    blob = os.urandom(8192)
    store = shared_store(tmp_path / "l2", wait_ms=3000)
    writer = other_writer(tmp_path / "l2", key(1), blob, then="land", after=0.3)
    started = time.monotonic()
    found = store.lookup([key(1), key(2)])
    took = time.monotonic() - started
    writer.join()
    assert found.n_hit == 1 and found.tiers == ["L2"]
    assert 0.25 <= took < 2.5, took
    assert store.get(key(1)).blob == blob
    counts = store.take_inflight()
    assert counts["inflight_waits"] == 1 and 250 <= counts["inflight_waited_ms"] < 2500
    assert "inflight_timeouts" not in counts and "inflight_failed" not in counts
    store.close()


def test_a_write_longer_than_the_bound_is_a_miss_at_the_bound(tmp_path):
    store = shared_store(tmp_path / "l2", wait_ms=300)
    writer = other_writer(tmp_path / "l2", key(1), b"x" * 4096, then="land", after=3.0)
    started = time.monotonic()
    found = store.lookup([key(1)])
    took = time.monotonic() - started
    assert found.n_hit == 0
    assert 0.29 <= took < 1.5, f"the wait ends at its bound (300 ms), took {took:.2f} s"
    assert store.take_inflight()["inflight_timeouts"] == 1
    writer.join()
    assert store.lookup([key(1)]).n_hit == 1   # once it landed it is an ordinary hit
    store.close()


def test_a_failed_write_ends_the_wait_at_once(tmp_path):
    store = shared_store(tmp_path / "l2", wait_ms=10_000)
    writer = other_writer(tmp_path / "l2", key(1), b"x" * 4096, then="fail", after=0.2)
    started = time.monotonic()
    found = store.lookup([key(1)])
    took = time.monotonic() - started
    writer.join()
    assert found.n_hit == 0 and took < 2.0, f"a failed write ends the wait (took {took:.2f} s of a 10 s bound)"
    assert store.take_inflight()["inflight_failed"] == 1
    store.close()


def test_one_bound_for_a_whole_lookup(tmp_path):
    """Several keys each mid-write by a stuck writer: the lookup waits for the first only, and
    get_many's waits share one bound: never a bound per key."""
    store = shared_store(tmp_path / "l2", wait_ms=300)
    writers = [other_writer(tmp_path / "l2", key(i), b"x" * 1024, then="land", after=2.0) for i in range(1, 5)]
    started = time.monotonic()
    assert store.lookup([key(i) for i in range(1, 5)]).n_hit == 0
    assert store.get_many([key(i) for i in range(1, 5)]) == [None] * 4
    took = time.monotonic() - started
    assert took < 1.5, f"two calls with a 300 ms bound each took {took:.2f} s"
    for writer in writers:
        writer.join()
    store.close()


def test_no_writer_no_wait_and_zero_turns_the_wait_off(tmp_path):
    store = shared_store(tmp_path / "l2", wait_ms=0)
    writer = other_writer(tmp_path / "l2", key(1), b"x" * 1024, then="land", after=1.0)
    started = time.monotonic()
    assert store.lookup([key(1)]).n_hit == 0 and store.lookup([key(2)]).n_hit == 0
    assert time.monotonic() - started < 0.2 and store.take_inflight() == {}
    writer.join()
    store.close()
