"""A bounded stress test of the tiered store: threads, a second process and a SIGKILLed writer at once.

Four threads run a fixed, seeded mix of put / get / pinned get / lookup / clear / evict on small L1
and L2 capacities; meanwhile a second process works on its own keys in the same L2 directory and a
third process is killed with SIGKILL in the middle of a put. Afterwards:

- every object anybody was served matches its checksum and its token ids;
- each tier's bytes_used equals what is really held (for L2: the payload bytes of the files on disk);
- a restart finds a consistent index: every file indexed, no temp file left, nothing corrupt.

Fixed seed and fixed counts; it takes a few seconds on 2 cores.
"""
from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

from blake3 import blake3

from kvbridge.store import DiskTier, MemoryTier, ObjectMeta, TieredStore
from kvbridge.store.diskformat import FILE_SUFFIX, TEMP_SUFFIX, read_header_file

WORK_DIR = Path(__file__).resolve().parents[1]
NS = "stress"
SEED = 20240901
N_THREADS = 4
OPS_PER_THREAD = 400
N_KEYS = 24
L1_BYTES = 24_000
L2_BYTES = 60_000
PEER_OPS = 500
PEER_L2_BYTES = 40_000

# One content scheme for this process and the subprocesses (they import these functions): everything
# about an object follows from its label and a version, so any reader can check what it was served.
def object_key(label: str) -> bytes:
    return blake3(f"stress-{label}".encode()).digest()


def token_ids(label: str) -> list[int]:
    seed = blake3(label.encode()).digest()
    return list(seed[: 8 + seed[0] % 24])


def tokens_digest(ids: list[int]) -> bytes:
    return blake3(struct.pack(f"<{len(ids)}i", *ids)).digest(length=16)


def object_blob(label: str, version: int | str, big: bool = False) -> bytes:
    seed = blake3(f"{label}/{version}".encode()).digest()
    size = (9000 if big else 500) + int.from_bytes(seed[:2], "little") % 4000
    return blake3(seed).digest(length=size)


def object_meta(label: str, version: int, blob: bytes) -> ObjectMeta:
    ids = token_ids(label)
    return ObjectMeta(NS, len(ids), tokens_digest(ids), note=f"{version}:{blake3(blob).hexdigest()}")


def problem(label: str, blob: bytes, meta: ObjectMeta) -> str:
    """Why a served object is wrong, or '' when it is what some writer stored under that label."""
    version, _, checksum = meta.note.partition(":")
    if blake3(blob).hexdigest() != checksum:
        return f"{label}: payload does not match its checksum"
    ids = token_ids(label)
    if (meta.n_tokens, meta.tokens_digest) != (len(ids), tokens_digest(ids)):
        return f"{label}: token ids differ"
    if blob not in (object_blob(label, version), object_blob(label, version, big=True)):
        return f"{label}: payload is not what was stored"
    return ""


IMPORT_CONTENT = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n" \
                 "from test_store_stress import object_blob, object_key, object_meta, problem\n"

PEER = IMPORT_CONTENT + '''
import json, random, sys, time
from pathlib import Path
from kvbridge.store import DiskTier, MemoryTier, TieredStore

directory, go_file, n_ops, capacity, seed = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
store = TieredStore([MemoryTier(0), DiskTier(directory, capacity)], namespace="stress")  # L1 off: reads hit files
(go_file.parent / "peer-ready").touch()
deadline = time.time() + 60
while not go_file.exists() and time.time() < deadline:
    time.sleep(0.002)
rng, bad, served = random.Random(seed), [], 0
for _ in range(n_ops):
    label = f"peer-{rng.randrange(12)}"
    roll = rng.random()
    if roll < 0.45:
        version = rng.randrange(3)
        blob = object_blob(label, version)
        store.put(object_key(label), blob, object_meta(label, version, blob))
    elif roll < 0.85:
        got = store.get(object_key(label))
        if got is not None:
            served += 1
            bad += [problem(label, got.blob, got.meta)] if problem(label, got.blob, got.meta) else []
    else:
        store.lookup([object_key(f"peer-{i}") for i in range(4)])
print(json.dumps({"bad": bad, "served": served, "stats": store.stats()}))
'''

KILLED_WRITER = IMPORT_CONTENT + '''
import os, sys, time
from kvbridge.store import DiskTier

def hang(fd):  # stop after the temp file is written, before the rename: then get killed there
    print("writing", flush=True)
    time.sleep(600)

os.fsync = hang
blob = object_blob("killed", 0, big=True) * 64
DiskTier(sys.argv[1], 1 << 30).put(object_key("killed"), blob, object_meta("killed", 0, blob))
'''


class Worker:
    """One thread's fixed sequence of operations; it records every problem it sees."""

    def __init__(self, store: TieredStore, worker_id: int) -> None:
        self.store = store
        self.rng = random.Random(SEED + worker_id)
        self.problems: list[str] = []
        self.served = 0

    def run(self) -> None:
        operations = [(0.38, self.put), (0.22, self.get), (0.10, self.pinned_get), (0.18, self.lookup),
                      (0.04, self.clear), (0.08, self.evict)]
        for _ in range(OPS_PER_THREAD):
            roll = self.rng.random()
            for share, operation in operations:
                if roll < share:
                    operation()
                    break
                roll -= share

    def label(self) -> str:
        return f"main-{self.rng.randrange(N_KEYS)}"

    def put(self, label: str | None = None, big: bool = False) -> None:
        label = label or self.label()
        version = self.rng.randrange(3)
        blob = object_blob(label, version, big)
        self.store.put(object_key(label), blob, object_meta(label, version, blob))

    def check(self, label: str, got) -> None:
        if got is not None:
            self.served += 1
            found = problem(label, got.blob, got.meta)
            if found:
                self.problems.append(found)

    def get(self) -> None:
        label = self.label()
        self.check(label, self.store.get(object_key(label)))

    def pinned_get(self) -> None:
        """What a restore does: pin, look up, read while pinned (a clear now waits for the unpin)."""
        label = self.label()
        with self.store.pinned([object_key(label)]):
            if self.store.lookup([object_key(label)]).n_hit:
                self.check(label, self.store.get(object_key(label)))

    def lookup(self) -> None:
        start = self.rng.randrange(N_KEYS - 4)
        result = self.store.lookup([object_key(f"main-{i}") for i in range(start, start + 4)])
        if not 0 <= result.n_hit <= 4 or set(result.tiers) - {"L1", "L2"}:
            self.problems.append(f"odd lookup result {result}")

    def clear(self) -> None:
        self.store.clear(self.rng.choice(["L1", "L2"]))

    def evict(self) -> None:
        """A big object: L1 evicts (and demotes) to make room, L2 evicts to take it."""
        self.put(f"big-{self.rng.randrange(4)}", big=True)


def start_peer(directory: Path, go_file: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PEER, str(directory), str(go_file), str(PEER_OPS),
                             str(PEER_L2_BYTES), str(SEED)],
                            cwd=WORK_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_a_writer_mid_put(directory: Path) -> None:
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(directory)], cwd=WORK_DIR,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = writer.stdout.readline()
        assert line == "writing\n", f"the writer did not reach its put: {line!r}"
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.kill()
        _, err = writer.communicate(timeout=60)
    assert writer.returncode == -signal.SIGKILL, err


def object_files(directory: Path) -> dict[bytes, int]:
    return {bytes.fromhex(path.name[: -len(FILE_SUFFIX)]): read_header_file(path).payload_len
            for path in directory.rglob("*" + FILE_SUFFIX)}


def test_threads_a_second_process_and_a_killed_writer_leave_a_consistent_store(tmp_path):
    directory, go_file = tmp_path / "l2", tmp_path / "go"
    store = TieredStore([MemoryTier(L1_BYTES), DiskTier(directory, L2_BYTES)], namespace=NS)
    peer = start_peer(directory, go_file)
    deadline = time.time() + 60
    while not (tmp_path / "peer-ready").exists() and time.time() < deadline and peer.poll() is None:
        time.sleep(0.01)

    workers = [Worker(store, n) for n in range(N_THREADS)]
    errors: list[BaseException] = []

    def guarded(worker: Worker) -> None:
        try:
            worker.run()
        except BaseException as exc:  # asserted on below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(worker,)) for worker in workers]
    started = time.monotonic()
    go_file.touch()
    for thread in threads:
        thread.start()
    kill_a_writer_mid_put(directory)  # while the threads and the peer are busy
    for thread in threads:
        thread.join(timeout=120)
    out, err = peer.communicate(timeout=120)
    elapsed = time.monotonic() - started

    # Every object served matched its checksum and token ids; nothing raised.
    assert errors == []
    assert peer.returncode == 0, err
    report = json.loads(out)
    assert report["bad"] == [] and report["stats"]["corrupt"] == 0
    assert [problem for worker in workers for problem in worker.problems] == []
    assert sum(worker.served for worker in workers) > 50 and report["served"] > 20  # it really ran
    assert elapsed < 60

    # bytes_used equals what is held: L1 in memory, L2 on disk (this process's keys; the peer owns its own).
    stats = store.stats()
    l1, l2 = store.tiers
    assert stats["tiers"]["L1"]["bytes"] == l1.bytes_used() == sum(len(l1.get(k)[0]) for k in l1.keys())
    assert stats["tiers"]["L1"]["bytes"] <= L1_BYTES and stats["tiers"]["L2"]["bytes"] <= L2_BYTES
    main_labels = [f"main-{i}" for i in range(N_KEYS)] + [f"big-{i}" for i in range(4)]
    main_keys = {object_key(label) for label in main_labels}
    mine_on_disk = {k: size for k, size in object_files(directory).items() if k in main_keys}
    assert dict((k, size) for k, size, _ in l2.entries()) == mine_on_disk
    assert stats["tiers"]["L2"]["bytes"] == l2.bytes_used() == sum(mine_on_disk.values())
    assert stats["tiers"]["L2"]["objects"] == len(mine_on_disk)
    store.close()

    # A restart indexes exactly the files that are there, removes the killed writer's temp file,
    # and serves every object intact.
    restarted = DiskTier(directory, 1 << 30)
    assert list(directory.rglob("*" + TEMP_SUFFIX)) == []
    assert l2.temp_files_removed + restarted.temp_files_removed == 1  # by a clear() after the kill, or now
    on_disk = object_files(directory)
    assert dict((k, size) for k, size, _ in restarted.entries()) == on_disk
    assert restarted.bytes_used() == sum(on_disk.values()) and restarted.corrupt_found == 0
    labels = {object_key(label): label for label in main_labels + [f"peer-{i}" for i in range(12)]}
    assert set(on_disk) <= set(labels)
    for k in on_disk:
        blob, meta = restarted.get(k)
        assert problem(labels[k], blob, meta) == ""
