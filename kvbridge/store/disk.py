"""L2: objects as files in a directory (KVB_L2_DIR), indexed in memory, rebuilt from the files at start.

Files are fanned out by the first byte of the key (`ab/abcd...kvb`) so no directory grows huge.
The index holds only headers, so a restart reads a few hundred bytes per object, never payloads.

Sharing one directory between processes is safe because every write is an atomic rename of a
uniquely named temp file and every read checks the file it opened. Each process keeps its own
index: a file another process deleted is a miss ("vanished"), a file another process added is
picked up on a miss by looking at its path (`discover`). Capacity is enforced per process, on
what that process knows of; that is the price of not having a lock file or a daemon.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvbridge.store.diskformat import (
    FILE_SUFFIX,
    TEMP_SUFFIX,
    UnsupportedVersion,
    read_header_file,
    read_object_file,
    write_object_file,
)
from kvbridge.store.objects import CorruptObject, ObjectMeta, ObjectVanished, StoreFault
from kvbridge.store.tiers import Tier

log = logging.getLogger(__name__)

STALE_TEMP_SECONDS = 600.0  # a temp file this old belongs to a writer that died


@dataclass
class _IndexEntry:
    size: int
    meta: ObjectMeta
    last_used: float


class DiskTier(Tier):
    """L2 on a local directory, created with mode 0700. Raises OSError when it cannot be used."""

    persistent = True

    def __init__(self, directory: str | os.PathLike, capacity: int, name: str = "L2") -> None:
        super().__init__(name, capacity)
        self.directory = Path(directory).expanduser()
        self.location = str(self.directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._check_writable()
        self._index: dict[bytes, _IndexEntry] = {}
        self._newer_format: set[bytes] = set()  # keys whose file a newer KVBridge wrote: not re-read
        self._bytes = 0
        self._lock = threading.Lock()
        self._rebuild_index()

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

    def _object_files(self):
        """(path, key) for every object file; other files are left alone, stale temp files removed."""
        with os.scandir(self.directory) as top:
            fans = [fan.path for fan in top if len(fan.name) == 2 and fan.is_dir(follow_symlinks=False)]
        for fan in fans:
            try:
                with os.scandir(fan) as listing:
                    entries = list(listing)
            except FileNotFoundError:
                continue  # another process cleared it
            for entry in entries:
                if entry.name.endswith(TEMP_SUFFIX):
                    self._remove_if_stale(Path(entry.path))
                elif entry.name.endswith(FILE_SUFFIX):
                    try:
                        key = bytes.fromhex(entry.name[: -len(FILE_SUFFIX)])
                    except ValueError:
                        continue  # not a name we write: someone else's file, not ours to judge
                    yield Path(entry.path), key

    def _remove_if_stale(self, path: Path) -> None:
        try:
            if time.time() - path.stat().st_mtime > STALE_TEMP_SECONDS:
                path.unlink()
        except FileNotFoundError:
            pass  # its writer finished (renamed it) or another process cleaned it up

    # -- index -----------------------------------------------------------------------------------
    def _rebuild_index(self) -> None:
        for path, key in self._object_files():
            self._index_file(path, key)
        log.info("L2 index rebuilt from %s: %d objects, %d bytes, %d bad files dropped",
                 self.directory, len(self._index), self._bytes, self.corrupt_found)

    def _index_file(self, path: Path, key: bytes) -> int | None:
        """Read one header into the index; the payload size, or None when gone or bad."""
        try:
            header = read_header_file(path)
            if header.key != key:
                raise CorruptObject("file name and key in the header differ")
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return None
        except CorruptObject as fault:
            self.corrupt_found += 1
            self._drop_bad_file(path, fault)
            return None
        except OSError as exc:
            log.warning("L2: cannot read %s (%s); treated as absent", path, exc)
            return None
        with self._lock:
            old = self._index.get(key)
            self._bytes += header.payload_len - (old.size if old else 0)
            self._index[key] = _IndexEntry(header.payload_len, header.meta, mtime)
        return header.payload_len

    def _drop_bad_file(self, path: Path, fault: CorruptObject) -> None:
        """Remove it, unless it is a newer KVBridge's format (that program can still use it)."""
        if isinstance(fault, UnsupportedVersion) and fault.newer:
            self._newer_format.add(bytes.fromhex(path.name[: -len(FILE_SUFFIX)]))
            log.warning("L2: %s is from a newer KVBridge (%s); left in place, ignored", path, fault)
            return
        log.warning("L2: dropping bad object file %s: %s", path, fault)
        try:
            path.unlink()
        except FileNotFoundError:
            pass  # another process dropped it first

    def _forget(self, key: bytes) -> None:
        with self._lock:
            old = self._index.pop(key, None)
            if old:
                self._bytes -= old.size

    # -- Tier interface --------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return key in self._index

    def meta(self, key: bytes) -> ObjectMeta | None:
        entry = self._index.get(key)
        return entry.meta if entry else None

    def get(self, key: bytes) -> tuple[bytes, ObjectMeta] | None:
        if key not in self._index:
            return None
        path = self.path_for(key)
        try:
            blob, meta = read_object_file(path, key)
        except FileNotFoundError:
            self._forget(key)
            raise ObjectVanished(f"{path} was removed by another process") from None
        except CorruptObject as fault:
            self._forget(key)
            self._drop_bad_file(path, fault)
            raise  # the store counts it
        except OSError as exc:
            raise StoreFault(f"cannot read {path}: {exc}") from exc
        now = time.time()
        try:
            os.utime(path, (now, now))  # the recency order survives a restart via mtime
        except FileNotFoundError:
            pass  # removed right after we read it; the data we hold was verified
        with self._lock:
            old = self._index.get(key)
            self._bytes += len(blob) - (old.size if old else 0)
            self._index[key] = _IndexEntry(len(blob), meta, now)
        return blob, meta

    def put(self, key: bytes, blob: bytes, meta: ObjectMeta) -> bool:
        path = self.path_for(key)
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            write_object_file(path, key, blob, meta)
        except OSError as exc:
            log.warning("L2: object not stored in %s: %s", self.directory, exc)
            return False
        with self._lock:
            old = self._index.get(key)
            self._bytes += len(blob) - (old.size if old else 0)
            self._index[key] = _IndexEntry(len(blob), meta, time.time())
        return True

    def remove(self, key: bytes) -> None:
        self._forget(key)
        try:
            self.path_for(key).unlink()
        except FileNotFoundError:
            pass  # another process removed it already

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def bytes_used(self) -> int:
        return self._bytes

    def entries(self) -> list[tuple[bytes, int, float]]:
        with self._lock:
            return [(key, entry.size, entry.last_used) for key, entry in self._index.items()]

    def clear(self) -> None:
        """Remove every object file in the directory, including ones other processes wrote."""
        with self._lock:
            self._index.clear()
            self._bytes = 0
        for path, _ in self._object_files():
            try:
                path.unlink()
            except FileNotFoundError:
                pass  # removed concurrently

    def discover(self, key: bytes) -> int | None:
        if key in self._index:
            return self._index[key].size
        if key in self._newer_format:
            return None
        path = self.path_for(key)
        if not path.exists():
            return None
        return self._index_file(path, key)
