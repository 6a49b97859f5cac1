"""Two real processes write one L2 directory at the same time; a third store finds everything intact."""
from __future__ import annotations

import json
import subprocess
import sys
import time

from blake3 import blake3

from kvbridge.settings import WORK_DIR
from kvbridge.store import DiskTier, MemoryTier, TieredStore

N_SHARED = 4        # keys both writers keep rewriting, each with its own content
N_OWN = 6           # keys only one writer writes
SIZE = 1 << 20      # big enough that a write takes a while, so readers overlap writers
RUN_SECONDS = 1.5

WRITER = """
import json, sys, time
from pathlib import Path
from blake3 import blake3
from kvbridge.store import DiskTier, MemoryTier, ObjectMeta, TieredStore

directory, name, go_file = sys.argv[1], sys.argv[2], Path(sys.argv[3])
n_shared, n_own, size, seconds = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7])
key = lambda label: blake3(label.encode()).digest()
content = lambda k, writer: blake3(k + writer.encode()).digest(length=size)
blobs = {w: {i: content(key(f"shared-{i}"), w) for i in range(n_shared)} for w in ("alpha", "beta")}
store = TieredStore([MemoryTier(0), DiskTier(directory, 1 << 30)], namespace="mp")  # L1 off: reads hit files
(go_file.parent / f"ready-{name}").touch()
deadline = time.time() + 60
while not go_file.exists() and time.time() < deadline:
    time.sleep(0.002)
for i in range(n_own):
    k = key(f"{name}-{i}")
    store.put(k, content(k, name), ObjectMeta("mp", i, bytes(16), note=name))
bad, seen_other, rounds = [], 0, 0
stop = time.time() + seconds
while time.time() < stop:
    i = rounds % n_shared
    store.put(key(f"shared-{i}"), blobs[name][i], ObjectMeta("mp", i, bytes(16), note=name))
    for j in range(n_shared):  # whatever the other writer is doing: a whole old file, a whole new one, or a miss
        got = store.get(key(f"shared-{j}"))
        if got is None:
            continue
        if got.blob != blobs.get(got.meta.note, {}).get(j):
            bad.append(f"shared-{j}")
        seen_other += got.meta.note != name
    rounds += 1
print(json.dumps({"bad": bad, "seen_other": seen_other, "rounds": rounds, "stats": store.stats()}))
"""


def test_two_processes_share_one_l2_directory(tmp_path):
    directory, go_file = tmp_path / "l2", tmp_path / "go"
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(directory), name, str(go_file), str(N_SHARED), str(N_OWN), str(SIZE),
             str(RUN_SECONDS)],
            cwd=WORK_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name in ("alpha", "beta")
    ]
    deadline = time.time() + 60
    while not all((tmp_path / f"ready-{name}").exists() for name in ("alpha", "beta")) and time.time() < deadline:
        time.sleep(0.01)
    go_file.touch()  # both are imported and waiting: start them together
    reports = []
    for writer in writers:
        out, err = writer.communicate(timeout=120)
        assert writer.returncode == 0, err
        reports.append(json.loads(out))
    for report in reports:
        assert report["bad"] == [] and report["stats"]["corrupt"] == 0
        assert report["stats"]["put_failures"] == 0
        assert report["seen_other"] > 0 and report["rounds"] > N_SHARED  # they really did overlap

    reader = TieredStore([MemoryTier(0), DiskTier(directory, 1 << 30)], namespace="mp")
    for label in [f"shared-{i}" for i in range(N_SHARED)] + [f"{w}-{i}" for w in ("alpha", "beta") for i in range(N_OWN)]:
        k = blake3(label.encode()).digest()
        got = reader.get(k)
        assert got is not None, label
        assert got.meta.note in ("alpha", "beta")
        assert got.blob == blake3(k + got.meta.note.encode()).digest(length=SIZE), label  # whole, one writer's
    stats = reader.stats()
    assert stats["corrupt"] == 0 and stats["tiers"]["L2"]["objects"] == N_SHARED + 2 * N_OWN
    assert not list(directory.rglob("*.tmp"))
