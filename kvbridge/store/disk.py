"""L2: objects as files in a directory (KVB_L2_DIR), indexed in memory, rebuilt from the files at start.

Files are fanned out by the first byte of the key (`ab/abcd...kvb`) so no directory grows huge.
The index holds only headers, so a restart reads a few hundred bytes per object, never payloads.

Threads. One lock guards the index, and every step that makes a file appear or disappear (the
rename that completes a put, an unlink, the header read that indexes a file) runs under it together
with the matching index change. So the index and bytes_used() always describe the files this
process knows of, whichever thread wins a race; concurrent puts of one key leave the index
describing the file that won. Only the slow parts run outside the lock: writing and fsyncing a
temp file, and reading and checking a payload.

Processes. Sharing one directory is safe because every write is an atomic rename of a uniquely
named temp file and every read checks the file it opened. Each process keeps its own index: a file
another process deleted is a miss ("vanished"), a file another process added is picked up on a miss
by looking at its path (`discover`). Capacity is enforced per process, on what that process knows
of; that is the price of not having a lock file or a daemon.

Dead writers. A writer killed mid-put leaves its temp file. Opening a DiskTier (and clear())
removes the temp files whose writer is dead, told by the pid and start time in the file name
(diskformat.temp_writer_state); a live writer's temp file is never touched. Temp files whose
writer cannot be identified (no /proc, a foreign name) are removed once STALE_TEMP_SECONDS old.
Limitation: a writer in another pid namespace (another container sharing the directory) looks
dead; its put then fails cleanly (a counted write error), it never leaves a torn file.

Owners. Embedded stores share a directory with each other, a cache server keeps one to itself:
each DiskTier holds a flock on `.kvbridge-owner.lock` for its lifetime, shared for embedded stores
(owner="embedded"), exclusive for a cache server (owner="cache-server"), so whichever opens second
refuses with DirectoryOwned, a BadSettings naming the holder and what to change.

Errors. The constructor raises OSError when the directory cannot be used (TieredStore.from_settings
turns that into BadSettings), DirectoryOwned when the other kind of owner holds it. After that, get() raises only StoreFault subclasses, put() returns
False on any storage fault, remove()/discover() log and carry on, clear() raises StoreFault only
when the directory cannot be listed.
"""
from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Iterator

from kvbridge.store.diskformat import (
    FILE_SUFFIX,
    TEMP_SUFFIX,
    UnsupportedVersion,
    fsync_directory,
    read_header_file,
    read_object_file,
    temp_writer_state,
    unlink_quietly,
    write_temp_file,
)
from kvbridge.errors import BadSettings
from kvbridge.store.objects import CorruptObject, ObjectMeta, ObjectVanished, StoreFault
from kvbridge.store.serde.tier import TierCodec
from kvbridge.store.tiers import Tier

log = logging.getLogger(__name__)

STALE_TEMP_SECONDS = 600.0  # a temp file whose writer cannot be identified is abandoned after this
OWNER_LOCK_FILE = ".kvbridge-owner.lock"
OWNERS = ("embedded", "cache-server")


class DirectoryOwned(BadSettings):
    """The L2 directory is held by the other kind of owner (a cache server vs embedded stores)."""


def _take_owner_lock(directory: Path, owner: str) -> int:
    """A descriptor holding the directory's owner flock; DirectoryOwned when the other kind holds it."""
    if owner not in OWNERS:
        raise ValueError(f"owner must be one of {OWNERS}, got {owner!r}")
    path = directory / OWNER_LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if owner == "cache-server" else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
        os.close(fd)
        if owner == "cache-server":
            what = (f"{holder}" if holder.startswith("cache server") else
                    "an embedded store (a KVBridge process running without KVB_STORE_URL)")
            raise DirectoryOwned(
                f"KVB_L2_DIR={directory} is in use by {what}; a cache server needs an L2 directory of its own. "
                "Stop that process (or set KVB_STORE_URL there so it uses this server), or point KVB_L2_DIR elsewhere."
            ) from None
        raise DirectoryOwned(
            f"KVB_L2_DIR={directory} belongs to a running {holder or 'cache server'}; an embedded store must not "
            "share it. Set KVB_STORE_URL to that server's address to use its cache, or point KVB_L2_DIR elsewhere."
        ) from None
    except BaseException:
        os.close(fd)
        raise
    if owner == "cache-server":
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"cache server (pid {os.getpid()})".encode(), 0)
    return fd


@dataclass
class _IndexEntry:
    size: int
    meta: ObjectMeta
    last_used: float


class DiskTier(Tier):
    """L2 on a local directory, created with mode 0700. Raises OSError when it cannot be used."""

    persistent = True

    def __init__(self, directory: str | os.PathLike, capacity: int, name: str = "L2", owner: str = "embedded",
                 codec: TierCodec | None = None) -> None:
        super().__init__(name, capacity)
        self.codec = codec if codec is not None else TierCodec()
        self.directory = Path(directory).expanduser()
        self.location = str(self.directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._check_writable()
        self._owner_fd: int | None = _take_owner_lock(self.directory, owner)
        self._index: dict[bytes, _IndexEntry] = {}
        self._newer_format: set[bytes] = set()  # keys whose file a newer KVBridge wrote: not re-read
        self._bytes = 0
        self._lock = threading.Lock()
        with self._lock:
            self._rebuild_index_locked()

    # -- paths -----------------------------------------------------------------------------------
    def path_for(self, key: bytes) -> Path:
        name = key.hex()
        return self.directory / name[:2] / (name + FILE_SUFFIX)

    def _check_writable(self) -> None:
        """Fail at start, with the OS's reason, rather than silently on every put."""
        probe = self.directory / f".probe.{os.getpid()}.{threading.get_ident()}{TEMP_SUFFIX}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.close(fd)
        os.unlink(probe)

    def _object_files(self) -> Iterator[tuple[Path, bytes]]:
        """(path, key) for every object file; dead writers' temp files are removed on the way.

        Raises OSError when the directory itself cannot be listed; a fan directory that cannot be
        is logged and skipped. Other files are left alone.
        """
        with os.scandir(self.directory) as top:
            fans = [fan.path for fan in top if len(fan.name) == 2 and fan.is_dir(follow_symlinks=False)]
        for fan in fans:
            try:
                with os.scandir(fan) as listing:
                    entries = list(listing)
            except FileNotFoundError:
                continue  # another process removed it
            except OSError as exc:
                log.warning("L2: cannot list %s (%s); its objects are skipped", fan, exc)
                continue
            for entry in entries:
                if entry.name.endswith(TEMP_SUFFIX):
                    self._remove_if_abandoned(Path(entry.path))
                elif entry.name.endswith(FILE_SUFFIX):
                    try:
                        key = bytes.fromhex(entry.name[: -len(FILE_SUFFIX)])
                    except ValueError:
                        continue  # not a name we write: someone else's file, not ours to judge
                    yield Path(entry.path), key

    def _remove_if_abandoned(self, path: Path) -> None:
        """Remove a temp file whose writer is dead (or, when that cannot be told, that is old)."""
        state = temp_writer_state(path.name)
        try:
            if state == "alive":
                return
            if state == "unknown" and time.time() - path.stat().st_mtime <= STALE_TEMP_SECONDS:
                return
            path.unlink()
        except FileNotFoundError:
            return  # its writer finished (renamed it) or another process cleaned it up
        except OSError as exc:
            log.warning("L2: cannot remove abandoned temp file %s: %s", path, exc)
            return
        self.temp_files_removed += 1
        log.info("L2: removed %s, left by a writer that died mid-put", path)

    # -- index (every method named *_locked runs with self._lock held) ----------------------------
    def _rebuild_index_locked(self) -> None:
        for path, key in self._object_files():
            self._index_file_locked(path, key)
        log.info("L2 index rebuilt from %s: %d objects, %d bytes, %d bad files dropped, %d dead writers' "
                 "temp files removed", self.directory, len(self._index), self._bytes, self.corrupt_found,
                 self.temp_files_removed)

    def _index_file_locked(self, path: Path, key: bytes) -> int | None:
        """Read one header into the index; the payload size, or None when gone or bad."""
        try:
            header = read_header_file(path)
            if header.key != key:
                raise CorruptObject("file name and key in the header differ")
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            self._forget_locked(key)
            return None
        except CorruptObject as fault:
            self.corrupt_found += 1
            self._drop_bad_file_locked(path, key, fault)
            return None
        except OSError as exc:
            log.warning("L2: cannot read %s (%s); treated as absent", path, exc)
            return None
        self._set_locked(key, _IndexEntry(header.payload_len, header.meta, mtime))
        return header.payload_len

    def _set_locked(self, key: bytes, entry: _IndexEntry) -> None:
        old = self._index.get(key)
        self._bytes += entry.size - (old.size if old else 0)
        self._index[key] = entry

    def _forget_locked(self, key: bytes) -> None:
        old = self._index.pop(key, None)
        if old:
            self._bytes -= old.size

    def _drop_bad_file_locked(self, path: Path, key: bytes, fault: CorruptObject) -> None:
        """Forget and remove it, unless it is a newer KVBridge's format (that program can still use it)."""
        self._forget_locked(key)
        if isinstance(fault, UnsupportedVersion) and fault.newer:
            self._newer_format.add(key)
            log.warning("L2: %s is from a newer KVBridge (%s); left in place, ignored", path, fault)
            return
        log.warning("L2: dropping bad object file %s: %s", path, fault)
        self._unlink_locked(path)

    def _unlink_locked(self, path: Path) -> bool:
        """Whether the file is gone now."""
        try:
            path.unlink()
        except FileNotFoundError:
            pass  # another process removed it first
        except OSError as exc:
            log.warning("L2: cannot remove %s (%s); it stays on disk", path, exc)
            return False
        return True

    # -- Tier interface --------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def meta(self, key: bytes) -> ObjectMeta | None:
        with self._lock:
            entry = self._index.get(key)
        return entry.meta if entry else None

    def size(self, key: bytes) -> int | None:
        with self._lock:
            entry = self._index.get(key)
        return entry.size if entry else None

    def get(self, key: bytes) -> tuple[bytes, ObjectMeta] | None:
        if not self.contains(key):
            return None
        path = self.path_for(key)
        try:
            stored, meta = read_object_file(path, key)  # outside the lock: tens of MB
        except FileNotFoundError:
            with self._lock:
                self._index_file_locked(path, key)  # forgets it, unless a put has replaced it since
            raise ObjectVanished(f"{path} was removed by another process") from None
        except CorruptObject:
            with self._lock:
                self._drop_if_still_bad_locked(path, key)
            raise  # the store counts it
        except OSError as exc:
            raise StoreFault(f"cannot read {path}: {exc}") from exc
        now = time.time()
        with self._lock:
            entry = self._index.get(key)
            if entry is not None:  # else removed while we read (clear, eviction): it stays removed
                entry.last_used = now
                if entry.size != len(stored):  # replaced while we read, here or by another process
                    self._index_file_locked(path, key)
        try:
            os.utime(path, (now, now))  # the recency order survives a restart via mtime
        except OSError:
            pass  # removed right after we read it, or not ours to touch; costs recency only
        return TierCodec.decode(stored, meta), meta  # CorruptObject (counted) when it cannot be decoded

    def _drop_if_still_bad_locked(self, path: Path, key: bytes) -> None:
        """A read found the file bad; a put may have replaced it since, so check again before dropping."""
        try:
            read_object_file(path, key)
        except FileNotFoundError:
            self._forget_locked(key)
        except CorruptObject as fault:
            self._drop_bad_file_locked(path, key, fault)
        except OSError:
            pass  # unreadable just now: leave it; the next get decides
        else:
            self._index_file_locked(path, key)

    def put(self, key: bytes, blob: bytes, meta: ObjectMeta) -> bool:
        path = self.path_for(key)
        try:
            blob, meta = self.codec.encode(blob, meta)
            path.parent.mkdir(mode=0o700, exist_ok=True)
            temp = write_temp_file(path, key, blob, meta)  # outside the lock: the slow part
        except (OSError, StoreFault) as exc:
            log.warning("L2: object not stored in %s: %s", self.directory, exc)
            return False
        try:
            with self._lock:
                os.replace(temp, path)
                self._newer_format.discard(key)
                self._set_locked(key, _IndexEntry(memoryview(blob).nbytes, meta, time.time()))
        except OSError as exc:
            unlink_quietly(temp)
            log.warning("L2: object not stored in %s: %s", self.directory, exc)
            return False
        fsync_directory(path.parent)
        return True

    def remove(self, key: bytes) -> None:
        """Remove the object; when its file cannot be removed (logged) it stays, and stays indexed."""
        with self._lock:
            if self._unlink_locked(self.path_for(key)):
                self._forget_locked(key)

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    def entries(self) -> list[tuple[bytes, int, float]]:
        with self._lock:
            return [(key, entry.size, entry.last_used) for key, entry in self._index.items()]

    def close(self) -> None:
        """Give up the directory's owner lock (the files stay). Idempotent."""
        fd, self._owner_fd = self._owner_fd, None
        if fd is not None:
            os.close(fd)

    def clear(self, keep: Collection[bytes] = ()) -> None:
        """Remove every object file in the directory (also other processes'), except those in `keep`.

        Files that cannot be removed (logged) stay indexed; StoreFault when the directory cannot be listed.
        """
        with self._lock:
            try:
                listed = list(self._object_files())
            except OSError as exc:
                raise StoreFault(f"cannot list {self.directory} to clear it: {exc}") from exc
            for path, key in listed:
                if key not in keep:
                    self._unlink_locked(path)
            for key in [key for key in self._index if key not in keep]:
                if self._unlink_locked(self.path_for(key)):  # gone already, unless it would not go
                    self._forget_locked(key)

    def writing(self, key: bytes) -> bool:
        """A live writer's temp file for `key` is beside its path (write_temp_file names it after the key)."""
        path = self.path_for(key)
        prefix = f".{path.name}."
        try:
            with os.scandir(path.parent) as listing:
                names = [entry.name for entry in listing if entry.name.startswith(prefix)]
        except OSError:
            return False   # no fan directory yet (nothing written under it) or unreadable: no writer seen
        return any(name.endswith(TEMP_SUFFIX) and temp_writer_state(name) == "alive" for name in names)

    def discover(self, key: bytes) -> int | None:
        with self._lock:
            entry = self._index.get(key)
            if entry is not None:
                return entry.size
            if key in self._newer_format:
                return None
            return self._index_file_locked(self.path_for(key), key)
