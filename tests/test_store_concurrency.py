"""Concurrency and fault defects of the store (issue 9, items 1.4 and 1.5), one test each.

Real threads, real files, real processes and a real SIGKILL. Where a race needs help to show up in
a bounded time the test shortens the interpreter's switch interval; it never fakes the interleaving.
"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from blake3 import blake3

import kvbridge.store as store_api
from kvbridge.store import DiskTier, MemoryTier, ObjectMeta, StoreFault, TieredStore
from kvbridge.store import diskformat
from kvbridge.store.diskformat import FILE_SUFFIX, TEMP_SUFFIX, read_header_file

WORK_DIR = Path(__file__).resolve().parents[1]
NS = "test-namespace"


def key(label: int | str) -> bytes:
    return blake3(f"key-{label}".encode()).digest()


def blob_for(k: bytes, size: int = 100) -> bytes:
    return blake3(k).digest(length=size)


def meta(note: str = "") -> ObjectMeta:
    return ObjectMeta(NS, 4, bytes(16), note=note)


def files_on_disk(directory: Path) -> dict[bytes, int]:
    """key -> payload size of every object file, read from the headers."""
    return {bytes.fromhex(path.name[: -len(FILE_SUFFIX)]): read_header_file(path).payload_len
            for path in directory.rglob("*" + FILE_SUFFIX)}


@contextmanager
def frequent_thread_switches():
    """Races that need a thread switch between two bytecodes show up in a bounded number of tries."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def run_threads(*targets) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(target):
        try:
            target()
        except BaseException as exc:  # collected and asserted on by the test
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return errors


# -- index races -----------------------------------------------------------------------------------
def test_discover_racing_remove_never_raises_nor_resurrects_a_removed_object(tmp_path):
    """Another process keeps writing one object; this process evicts it while its threads discover it.

    After each remove, once every discoverer has finished the call it was in, the index must not
    hold the object again (it did when a header read finished after the remove: an index entry for
    a file that is gone, counted in bytes_used).
    """
    directory = tmp_path / "l2"
    tier, other_process = DiskTier(directory, 1 << 30), DiskTier(directory, 1 << 30)
    k = key("raced")
    other_process.put(k, blob_for(k, 300), meta())
    path = tier.path_for(k)
    template = path.with_name("template")
    os.link(path, template)
    stop, calls, resurrected = threading.Event(), [0] * 3, []

    def discoverer(n: int):
        def run():
            while not stop.is_set():
                tier.discover(k)
                calls[n] += 1
        return run

    def evictor():
        try:
            for i in range(200):
                os.link(template, path.with_name(f"new-{i}"))
                os.replace(path.with_name(f"new-{i}"), path)  # the other process's atomic write
                time.sleep(0)  # let a discoverer start reading it
                tier.remove(k)
                seen = list(calls)
                while any(now <= then for now, then in zip(calls, seen)) and not stop.is_set():
                    time.sleep(0)
                if tier.contains(k):
                    resurrected.append(i)
                    tier.remove(k)
        finally:
            stop.set()

    with frequent_thread_switches():
        errors = run_threads(*(discoverer(n) for n in range(len(calls))), evictor)
    assert errors == [] and resurrected == []
    assert tier.keys() == [] and tier.bytes_used() == 0


def test_concurrent_puts_of_one_key_keep_bytes_used_equal_to_disk(tmp_path):
    """Four threads put one key with four sizes at once, round after round; after each round the
    index must describe the file that won, and the store's count must match the tier's."""
    store = TieredStore([MemoryTier(0), DiskTier(tmp_path / "l2", 1 << 30)], namespace=NS)
    tier, k, sizes = store.tiers[1], key("contended"), (100, 2000, 30_000, 400_000)
    mismatches: list[tuple[int, int, int]] = []

    def check_round():
        on_disk = files_on_disk(tier.directory)[k]
        counted = (tier.bytes_used(), store.stats()["tiers"]["L2"]["bytes"])
        if counted != (on_disk, on_disk):
            mismatches.append((on_disk, *counted))

    rounds = threading.Barrier(len(sizes), action=check_round)

    def putter(size: int):
        def run():
            for _ in range(15):
                assert store.put(k, blob_for(k, size), meta())
                rounds.wait(timeout=60)
        return run

    errors = run_threads(*(putter(size) for size in sizes))
    assert errors == [] and mismatches == []
    assert store.get(k).blob == blob_for(k, tier.bytes_used())


# -- clear() and pins ----------------------------------------------------------------------------
def test_clear_defers_deleting_a_pinned_object_until_its_last_unpin(tmp_path):
    store = TieredStore([MemoryTier(0), DiskTier(tmp_path / "l2", 1 << 30)], namespace=NS)
    kept, gone = key("pinned"), key("unpinned")
    for k in (kept, gone):
        store.put(k, blob_for(k), meta())
    path = store.tiers[1].path_for(kept)
    with store.pinned([kept]):
        with store.pinned([kept]):  # pins nest: deletion waits for the outermost
            store.clear("L2")
            assert store.get(kept).blob == blob_for(kept)  # the reader that pinned it still gets it
            assert store.get(gone) is None and not store.tiers[1].path_for(gone).exists()
        assert path.exists() and store.stats()["clear_deferred"] == 1
    assert not path.exists()
    assert store.lookup([kept]).n_hit == 0
    l2 = store.stats()["tiers"]["L2"]
    assert (l2["objects"], l2["bytes"], store.tiers[1].bytes_used()) == (0, 0, 0)


def test_a_put_after_clear_keeps_the_new_object_even_if_it_was_pinned(tmp_path):
    store = TieredStore([MemoryTier(0), DiskTier(tmp_path / "l2", 1 << 30)], namespace=NS)
    k = key("renewed")
    store.put(k, blob_for(k), meta())
    with store.pinned([k]):
        store.clear("L2")
        store.put(k, blob_for(k, 150), meta())  # fresh content after the clear: wanted, not doomed
    assert store.get(k).blob == blob_for(k, 150)


# -- temp files of writers that died mid-put --------------------------------------------------------
HANGING_WRITER = """
import os, sys, time
from kvbridge.store import DiskTier, ObjectMeta

def hang(fd):  # stop between writing the temp file and renaming it, as a writer killed mid-put does
    print("writing", flush=True)
    time.sleep(600)

os.fsync = hang
DiskTier(sys.argv[1], 1 << 30).put(bytes.fromhex(sys.argv[2]), b"x" * (1 << 20), ObjectMeta("ns", 1, bytes(16)))
"""


def start_hanging_writer(directory: Path, k: bytes) -> subprocess.Popen:
    """A real process stopped inside DiskTier.put, its temp file written and not yet renamed."""
    writer = subprocess.Popen([sys.executable, "-c", HANGING_WRITER, str(directory), k.hex()],
                              cwd=WORK_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = writer.stdout.readline()
    if line != "writing\n":
        writer.kill()
        pytest.fail(f"the writer did not start its put: {line!r} {writer.stderr.read()}")
    return writer


def temp_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*" + TEMP_SUFFIX))


def test_temp_file_of_a_writer_killed_mid_put_is_removed_when_a_store_opens(tmp_path):
    directory = tmp_path / "l2"
    DiskTier(directory, 1 << 30)
    killed = start_hanging_writer(directory, key("killed"))
    try:
        [orphan] = temp_files(directory)
        os.kill(killed.pid, signal.SIGKILL)
        os.waitid(os.P_PID, killed.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped: a zombie
        reopened = TieredStore([DiskTier(directory, 1 << 30)], namespace=NS)
        assert not orphan.exists()
        assert reopened.tiers[0].keys() == [] and reopened.stats()["temp_files_removed"] == 1
    finally:
        killed.kill()
        killed.communicate()


def test_temp_file_of_a_live_writer_survives_and_a_recycled_pid_does_not_protect_one(tmp_path):
    directory = tmp_path / "l2"
    DiskTier(directory, 1 << 30)
    live = start_hanging_writer(directory, key("live"))
    try:
        [in_flight] = temp_files(directory)
        # The same writer name with this (live) process's pid but the writer's start time: a pid
        # that was recycled after the writer died. It must not protect the file.
        recycled = in_flight.with_name(in_flight.name.replace(f".{live.pid}-", f".{os.getpid()}-", 1))
        assert recycled.name != in_flight.name
        recycled.write_bytes(b"half written by a dead writer")
        DiskTier(directory, 1 << 30)
        assert in_flight.exists() and not recycled.exists()
    finally:
        live.kill()
        live.communicate()


# -- 1.5: storage faults stay inside the store ---------------------------------------------------
def test_storage_fault_types_are_exported_from_the_package():
    for name in ("StoreFault", "CorruptObject", "ObjectVanished", "UnstorableObject"):
        assert name in store_api.__all__ and issubclass(getattr(store_api, name), StoreFault)


FAULTY_CALLS = ["stat", "open", "unlink", "utime", "replace", "fsync", "mkdir", "scandir", "read",
                "replace+unlink"]


@contextmanager
def failing(monkeypatch, call: str):
    """The disk fails (EIO) under the store for one kind of call, like a dying disk or a lost NFS mount."""
    def fail(*args, **kwargs):
        raise OSError(errno.EIO, f"injected {call} failure")

    with monkeypatch.context() as patch:
        for name in call.split("+"):
            if name == "read":  # every file the store opens with the built-in open()
                patch.setattr(diskformat, "open", fail, raising=False)
            else:
                patch.setattr(os, name, fail)
        yield


@pytest.mark.parametrize("call", FAULTY_CALLS)
def test_a_failing_disk_is_misses_and_skipped_writes_never_an_exception(tmp_path, monkeypatch, call):
    directory = tmp_path / "l2"
    store = TieredStore([MemoryTier(250), DiskTier(directory, 450)], namespace=NS)
    for i in range(4):
        store.put(key(i), blob_for(key(i)), meta())  # L1 keeps 2, L2 keeps 4
    behind = key("written-by-another-process")
    DiskTier(directory, 1 << 30).put(behind, blob_for(behind), meta())

    with failing(monkeypatch, call):
        for k in (behind, key(0), key(3)):
            store.lookup([k])
            got = store.get(k)  # an L2 read, a promotion, an L1 eviction that demotes
            assert got is None or got.blob == blob_for(k)
        for i in range(10, 16):
            assert store.put(key(i), blob_for(key(i)), meta())  # L1 takes it even when L2 cannot
        store.flush()
        try:
            store.clear("L2")
        except StoreFault:
            pass  # the one documented way clear() reports a disk it cannot list

    k = key("after")
    assert store.put(k, blob_for(k), meta()) and store.get(k).blob == blob_for(k)
    tier = store.tiers[1]
    assert store.stats()["tiers"]["L2"]["bytes"] == tier.bytes_used()


def test_metadata_too_large_for_the_disk_format_is_a_counted_skipped_write(tmp_path):
    store = TieredStore([MemoryTier(0), DiskTier(tmp_path / "l2", 1 << 30)], namespace=NS)
    k = key("long-note")
    assert store.put(k, blob_for(k), meta(note="n" * (diskformat.MAX_META_BYTES + 1))) is False
    stats = store.stats()
    assert stats["write_errors"] == 1 and stats["put_failures"] == 1
    assert temp_files(tmp_path / "l2") == []
