"""Liveness: when each client instance was last heard from (InstanceClock), and whether a writer
through shared memory may still be writing (the writer lock).

InstanceClock: the server's client table and the storage module, a liveness target, both keep one.

The writer lock decides when a dropped writer's quarantined pages may be reused. A writer dropped
for silence may only be paused (SIGSTOP, a frozen VM) and copy into its pages when it resumes, so its
pages stay out of reuse while it can still write. What a client says about itself at hello (pid,
host name) cannot decide that: in a container (own PID and UTS namespaces, a shared /dev/shm) the
pid names another process of the server's namespace, or none, and the host name is the
container's. A pidfd or a process's start time and boot id need the pid as the server's namespace
sees it, which nothing on a ZMQ connection gives (tcp has no peer credentials, and ZMQ hides the
ipc socket's). So the proof is one the kernel keeps: before it writes through shared memory a
client takes an open-file-description (OFD) write lock on one byte of the segment file, at an offset
derived from its instance id, through the file descriptor it keeps open beside its mapping. The
kernel drops that lock exactly when the last descriptor of that open file closes: when the writer's
process (and any child it forked, which shares descriptor and mapping) is gone, in whatever PID
namespace it runs, SIGKILL included; a stopped process keeps it. The server asks the kernel
(F_OFD_GETLK through its own descriptor of the same file) whether someone holds the byte: it gives
a write lease only to a client whose lock it sees, and frees a dropped writer's pages only once the
lock is gone. A client that cannot take the lock (no OFD locks on this platform) stores inline.

What this does not stop: a process of the same OS user that takes another client's lock, or writes
into the segment at will (it can map the file anyway); the same user is trusted (Docs/Security.md).
The byte range starts at 2**62, beyond any segment's end (a lock past EOF is allowed), and the 48-bit
offset of a random instance id does not meet another's in practice; a collision only keeps pages
quarantined longer. The byte just below, 2**62 - 1, is the creator's: the cache server holds it while
it runs, so a starting server tells a live server's segment from a dead one's (kvbridge.cache_server.shm
stale_segments) without the pid in the file's name, which a containerised server writes in its own
namespace.
"""
from __future__ import annotations

import fcntl
import os
import struct
import threading
import time

from blake3 import blake3


class InstanceClock:
    """A module's view of client instances; stale ones are what reap_stale_instances returns.

    An instance is stale once silent for reap_timeout_s; one that has been seen only once (its
    registration) is given registration_grace_s instead, if that is longer (an engine may take a
    while to load its model between hello and its first request).
    """

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, float, int]] = {}   # id -> (first, last, touches)

    def touch(self, instance_id: str) -> None:
        now = self._clock()
        with self._lock:
            first, _, touches = self._seen.get(instance_id, (now, now, 0))
            self._seen[instance_id] = (first, now, touches + 1)

    def stale(self, reap_timeout_s: float, registration_grace_s: float) -> list[str]:
        now = self._clock()
        with self._lock:
            return [iid for iid, (first, last, touches) in self._seen.items()
                    if now - last > (reap_timeout_s if touches > 1 else max(reap_timeout_s, registration_grace_s))]

    def seen(self, instance_id: str) -> tuple[float, float, int] | None:
        """(first seen, last seen, touches) on this clock, or None for an instance it does not know."""
        with self._lock:
            return self._seen.get(instance_id)

    def now(self) -> float:
        return self._clock()

    def forget(self, instance_id: str) -> None:
        with self._lock:
            self._seen.pop(instance_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)


# -- the writer lock -----------------------------------------------------------------------------
OFD_LOCKS = hasattr(fcntl, "F_OFD_SETLK")
LOCK_BASE = 1 << 62
_FLOCK = struct.Struct("@hhqqi4x")   # struct flock on 64-bit Linux: type, whence, start, len, pid (+ padding)


class WriterLockUnavailable(OSError):
    """This platform has no OFD locks, or another open file already holds this instance's lock byte."""


def writer_lock_offset(instance_id: str) -> int:
    """The byte of the segment file whose lock says "instance_id may still write"."""
    return LOCK_BASE + int.from_bytes(blake3(instance_id.encode()).digest(length=6), "little")


def hold_writer_lock(fd: int, instance_id: str) -> None:
    """Take the instance's lock through fd (open for writing); it lasts until that open file closes."""
    hold_lock(fd, writer_lock_offset(instance_id), "the writer lock")


def writer_lock_held(fd: int, instance_id: str) -> bool:
    """Whether another open file holds the instance's lock (through fd, the server's own open file).

    False when OFD locks do not exist here: then no client can have taken one, and the storage
    module gives such a client no write lease at all."""
    return lock_held(fd, writer_lock_offset(instance_id))


# The segment's creator (the cache server) holds this byte while it runs, so a starting server can
# tell a live server's segment from a dead one's without trusting the pid in the file's name (a
# server in a container names it with a pid of its own namespace).
CREATOR_LOCK_OFFSET = LOCK_BASE - 1


def hold_lock(fd: int, offset: int, what: str) -> None:
    """An OFD write lock on one byte through fd (open for writing); it lasts until that open file closes."""
    if not OFD_LOCKS:
        raise WriterLockUnavailable(f"this platform has no open-file-description locks (F_OFD_SETLK) for {what}")
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))
    except OSError as exc:
        raise WriterLockUnavailable(exc.errno, f"cannot take {what}: {exc.strerror}") from None


def lock_held(fd: int, offset: int) -> bool:
    """Whether another open file holds a lock on the byte (False where OFD locks do not exist)."""
    if not OFD_LOCKS:
        return False
    probe = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)
    return _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, probe))[0] != fcntl.F_UNLCK
