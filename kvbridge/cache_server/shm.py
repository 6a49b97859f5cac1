"""The cache server's L1 memory: one file of fixed-size pages in POSIX shared memory (/dev/shm).

Flow: the server creates the segment at start and hands its path and nonce to every client in the
hello reply; a client on the same host attaches (maps the same file) and copies object bytes into
or out of the pages a lease names, with no bytes crossing the socket. Which pages hold what is the
pool's business (kvbridge.cache_server.pool); this module only knows bytes, pages and generations.

Layout (little-endian):
    header       magic b"KVBSHM01", format version u32, page_bytes u32, n_pages u64,
                 a 16-byte random nonce, the creator's pid u64            (HEADER_BYTES, padded)
    generations  n_pages u64: the generation of the object that owns each page, 0 when free
    pages        n_pages * page_bytes, starting at a 4096-aligned offset

A client checks a copy by reading the pages' generations after it: any value other than its
lease's generation means the pages were reused meanwhile (a torn copy), and it counts a miss.

Each process keeps the segment file open while it maps it: a writer's lock on one byte of the file
(kvbridge.cache_server.liveness) tells the server the writer may still write, and the server asks
the kernel about it through its own descriptor; the server's own lock on another byte tells a later
server that this segment's creator still runs.

Deliberately left out: multiprocessing.shared_memory (its resource tracker unlinks a segment when
any attaching process exits) and locking of the pages themselves (the pool's leases decide who may
touch which pages).
"""
from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat
import struct
from pathlib import Path

import numpy as np
from blake3 import blake3

from kvbridge.cache_server.liveness import CREATOR_LOCK_OFFSET, WriterLockUnavailable, hold_lock, lock_held
from kvbridge.errors import KVBridgeError

log = logging.getLogger(__name__)

MAGIC = b"KVBSHM01"
FORMAT_VERSION = 1
NONCE_BYTES = 16
_HEADER = struct.Struct("<8sIIQ16sQ")   # magic, version, page_bytes, n_pages, nonce, creator pid
HEADER_BYTES = 64                        # the header padded, so the generation table is 8-aligned
PAGE_ALIGN = 4096
DEFAULT_DIRECTORY = Path("/dev/shm")
DEFAULT_PREFIX = "kvbridge"
CHECKSUM_BYTES = 16


class SegmentUnavailable(KVBridgeError):
    """The shared-memory segment cannot be created or is not the one expected; the message says which file and why."""


def pages_offset(n_pages: int) -> int:
    """Where page 0 starts: after the header and the generation table, rounded up to PAGE_ALIGN."""
    end_of_table = HEADER_BYTES + 8 * n_pages
    return -(-end_of_table // PAGE_ALIGN) * PAGE_ALIGN


def segment_bytes(n_pages: int, page_bytes: int) -> int:
    return pages_offset(n_pages) + n_pages * page_bytes


def _segment_name_pattern(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(prefix)}-(\d+)-(\d+)-[0-9a-f]+\.pool$")


class Segment:
    """A mapped segment file. Build one with Segment.create (server) or Segment.attach (client)."""

    def __init__(self, path: Path, mapping: mmap.mmap, nonce: bytes, page_bytes: int, n_pages: int,
                 creator_pid: int, fd: int = -1) -> None:
        self._path = path
        self._mmap: mmap.mmap | None = mapping
        self._fd = fd   # kept open beside the mapping: the writer lock (kvbridge.cache_server.liveness) lives on it
        self._nonce = nonce
        self._page_bytes = page_bytes
        self._n_pages = n_pages
        self._creator_pid = creator_pid
        self._pages_start = pages_offset(n_pages)
        self._bytes: memoryview | None = memoryview(mapping)
        self._generations: np.ndarray | None = np.frombuffer(mapping, dtype="<u8", count=n_pages,
                                                             offset=HEADER_BYTES)

    # -- opening -----------------------------------------------------------------------------------
    @classmethod
    def create(cls, n_pages: int, page_bytes: int, directory: Path = DEFAULT_DIRECTORY,
               prefix: str = DEFAULT_PREFIX) -> "Segment":
        """A new, zeroed segment file private to this user (mode 0600), named so cleanup can find it."""
        if n_pages < 1 or not 0 < page_bytes < 2 ** 32:
            raise ValueError(f"a segment needs n_pages >= 1 and 0 < page_bytes < 4 GiB, got {n_pages}, {page_bytes}")
        directory = Path(directory)
        path = directory / f"{prefix}-{os.getuid()}-{os.getpid()}-{secrets.token_hex(8)}.pool"
        size = segment_bytes(n_pages, page_bytes)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise SegmentUnavailable(f"cannot create the shared-memory segment {path}: {exc.strerror or exc}") from None
        try:
            try:
                # Reserve the memory now: on tmpfs a sparse file that later runs out of room kills the
                # server with SIGBUS on the first write to a page, instead of failing here with a message.
                os.posix_fallocate(fd, 0, size)
            except AttributeError:      # no posix_fallocate on this platform (macOS): sparse is all we get
                os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise SegmentUnavailable(
                f"cannot reserve {size / 2**20:.1f} MiB for the shared-memory segment {path}: "
                f"{exc.strerror or exc}. Free space in {directory} or lower KVB_L1_BYTES (the cache server's pool size).") from None
        try:
            hold_lock(fd, CREATOR_LOCK_OFFSET, "the segment's creator lock")
        except WriterLockUnavailable as exc:   # no OFD locks here: stale_segments falls back to the pid alone
            log.debug("%s", exc)
        nonce = secrets.token_bytes(NONCE_BYTES)
        mapping[:_HEADER.size] = _HEADER.pack(MAGIC, FORMAT_VERSION, page_bytes, n_pages, nonce, os.getpid())
        return cls(path, mapping, nonce, page_bytes, n_pages, os.getpid(), fd)

    @classmethod
    def attach(cls, path: Path | str, expected_nonce: bytes) -> "Segment":
        """Map a server's segment; it must be a KVBridge segment of this format carrying expected_nonce.

        A client on another host (or talking to another server) finds no such file or a different
        nonce, so it knows to move bytes over the socket instead.
        """
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)   # a link planted under the name is refused
        except OSError as exc:
            raise SegmentUnavailable(f"cannot open the shared-memory segment {path}: {exc.strerror or exc}") from None
        try:
            file_size = os.fstat(fd).st_size
            if file_size < _HEADER.size:
                raise SegmentUnavailable(f"{path} is not a KVBridge segment: only {file_size} bytes long")
            header = os.pread(fd, _HEADER.size, 0)
            magic, version, page_bytes, n_pages, nonce, creator_pid = _HEADER.unpack(header)
            if magic != MAGIC:
                raise SegmentUnavailable(f"{path} is not a KVBridge segment (magic {magic!r})")
            if version != FORMAT_VERSION:
                raise SegmentUnavailable(f"{path} has segment format version {version}; this client reads "
                                         f"version {FORMAT_VERSION} (upgrade the older side)")
            if not secrets.compare_digest(nonce, bytes(expected_nonce)):
                raise SegmentUnavailable(f"{path} belongs to another cache server (its nonce is not the one the "
                                         f"server announced; is the server on another host?)")
            expected_size = segment_bytes(n_pages, page_bytes)
            if file_size != expected_size:
                raise SegmentUnavailable(f"{path} is {file_size} bytes, but its header describes "
                                         f"{n_pages} pages of {page_bytes} bytes ({expected_size} bytes)")
            # Page tables filled now, at connect, rather than one fault per 4 KiB on the first store or
            # restore through each page (a 6 MB chunk: ~3 ms of faults against ~0.7 ms of copying).
            populate = getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, file_size, flags=mmap.MAP_SHARED | populate)
        except OSError as exc:
            os.close(fd)
            raise SegmentUnavailable(f"cannot map the shared-memory segment {path}: {exc.strerror or exc}") from None
        except BaseException:
            os.close(fd)
            raise
        return cls(path, mapping, nonce, page_bytes, n_pages, creator_pid, fd)

    # -- facts -------------------------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self._path

    @property
    def nonce(self) -> bytes:
        return self._nonce

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    @property
    def n_pages(self) -> int:
        return self._n_pages

    @property
    def creator_pid(self) -> int:
        return self._creator_pid

    def fileno(self) -> int:
        """The descriptor of the segment file this process keeps open while the segment is mapped."""
        if self._fd < 0:
            raise ValueError(f"segment {self._path} is closed")
        return self._fd

    @property
    def closed(self) -> bool:
        return self._bytes is None

    def __repr__(self) -> str:
        return f"Segment({str(self._path)!r}, n_pages={self._n_pages}, page_bytes={self._page_bytes})"

    # -- bytes -------------------------------------------------------------------------------------
    def _mapped(self) -> memoryview:
        if self._bytes is None:
            raise ValueError(f"segment {self._path} is closed")
        return self._bytes

    def _page_start(self, page: int) -> int:
        if not 0 <= page < self._n_pages:
            raise IndexError(f"page {page} is outside the segment's {self._n_pages} pages")
        return self._pages_start + page * self._page_bytes

    def _check_size(self, pages: list[int], size: int) -> None:
        if not 0 <= size <= len(pages) * self._page_bytes:
            raise ValueError(f"{size} bytes do not fit in {len(pages)} pages of {self._page_bytes} bytes")

    def view(self, pages: list[int], size: int) -> memoryview | None:
        """Zero-copy: exactly `size` bytes over pages that are consecutive (p, p+1, ...); None when they are not."""
        self._check_size(pages, size)
        if not contiguous(pages):
            return None
        start = self._page_start(pages[0])
        self._page_start(pages[-1])  # bounds
        return self._mapped()[start:start + size]

    def read_into(self, pages: list[int], size: int, out: memoryview) -> None:
        """Gather `size` bytes from the pages, in order, into out[:size]."""
        self._check_size(pages, size)
        mapped, out = self._mapped(), memoryview(out).cast("B")
        if contiguous(pages):
            start = self._page_start(pages[0])
            out[:size] = mapped[start:start + size]
            return
        done = 0
        for page in pages:
            if done >= size:
                break
            n = min(self._page_bytes, size - done)
            start = self._page_start(page)
            out[done:done + n] = mapped[start:start + n]
            done += n

    def read(self, pages: list[int], size: int) -> bytes:
        view = self.view(list(pages), size)
        if view is not None:
            with view:
                return bytes(view)   # one copy
        buffer = bytearray(size)
        self.read_into(pages, size, memoryview(buffer))
        return bytes(buffer)

    def write(self, pages: list[int], data: bytes | memoryview) -> None:
        """Scatter data over the pages, in order (the last page may be partly used)."""
        data = memoryview(data).cast("B")
        self._check_size(pages, len(data))
        mapped = self._mapped()
        if contiguous(pages):
            start = self._page_start(pages[0])
            mapped[start:start + len(data)] = data   # one copy for a contiguous run (the usual case)
            return
        for index, done in enumerate(range(0, len(data), self._page_bytes)):
            piece = data[done:done + self._page_bytes]
            start = self._page_start(pages[index])
            mapped[start:start + len(piece)] = piece

    # -- generations -------------------------------------------------------------------------------
    def _table(self) -> np.ndarray:
        if self._generations is None:
            raise ValueError(f"segment {self._path} is closed")
        return self._generations

    def set_generation(self, pages: list[int], generation: int) -> None:
        self._table()[list(pages)] = generation

    def generation_ok(self, pages: list[int], generation: int) -> bool:
        """Whether every page still carries `generation` (no page was freed or reused since)."""
        if not pages:
            return False
        return bool(np.all(self._table()[list(pages)] == generation))

    # -- closing -----------------------------------------------------------------------------------
    def close(self, unlink: bool = False) -> None:
        """Unmap (and, for the server, remove the file). Safe to call twice.

        A memoryview a caller still holds (from view()) keeps the mapping alive: then the unmap is
        left to the garbage collector when that view goes, rather than failing the caller's shutdown.
        """
        mapping, self._mmap = self._mmap, None
        self._generations = None   # the numpy view exports the mapping's buffer: drop it before closing
        if self._bytes is not None:
            self._bytes.release()
            self._bytes = None
        unmapped = True
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                unmapped = False
                log.warning("segment %s: a view is still in use; it is unmapped when that view is dropped",
                            self._path)
        fd, self._fd = self._fd, -1
        if fd >= 0 and unmapped:
            os.close(fd)
        # else the descriptor stays open for the life of the process: while the pages are mapped, the
        # writer lock on it must say this process may still write (kvbridge.cache_server.liveness)
        if unlink:
            self._path.unlink(missing_ok=True)


def stale_segments(directory: Path = DEFAULT_DIRECTORY, prefix: str = DEFAULT_PREFIX) -> list[Path]:
    """This user's segment files whose creating process is gone (left by a crash), for removal."""
    try:
        entries = sorted(Path(directory).iterdir())
    except FileNotFoundError:
        return []
    return [path for path in entries if is_stale_segment(path, prefix)]


def is_stale_segment(path: Path, prefix: str = DEFAULT_PREFIX) -> bool:
    """Whether `path` is a segment file of this user whose creating server is gone (safe to remove).

    /dev/shm is world-writable, so another account can plant an entry named like one of ours: the
    entry is looked at with lstat (a link is never followed) and only a regular file this uid owns
    counts. What is skipped is logged, and never touched: with protected_symlinks, following
    another user's link in a sticky directory fails with EACCES (that stopped a start once).
    """
    path = Path(path)
    match = _segment_name_pattern(prefix).match(path.name)
    uid = os.getuid()
    if not match or int(match.group(1)) != uid:
        return False
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False   # removed meanwhile
    except OSError as exc:
        log.warning("skipped %s while looking for stale segments: %s", path, exc.strerror or exc)
        return False
    if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
        kind = ("a regular file" if stat.S_ISREG(info.st_mode) else
                "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file")
        log.warning("left %s alone: named like a segment of uid %d, but it is %s owned by uid %d",
                    path, uid, kind, info.st_uid)
        return False
    return not creator_alive(path, int(match.group(2)))


def creator_alive(path: Path, pid: int) -> bool:
    """Whether the server that created the segment may still run: its creator lock is held, or the pid
    in the name is alive. Either says yes: the lock holds across PID namespaces (a containerised
    server's pid names another process here, or none), the pid covers a platform without OFD locks."""
    if pid_alive(pid):
        return True
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError:
        return True   # cannot look: leave it
    try:
        return lock_held(fd, CREATOR_LOCK_OFFSET)
    finally:
        os.close(fd)


def remove_stale_segments(directory: Path | str | None = None) -> list[Path]:
    """Remove this user's segments whose creating server is gone (a SIGKILL leaves its file in
    /dev/shm, holding its memory); a cache server calls it at start. Returns what it removed.

    Nothing here stops a start: an entry that cannot be removed is logged and left. In a sticky
    directory (/dev/shm is one) unlink refuses, with EPERM, to remove another user's entry unless the
    caller is root; root may remove anything, which is why stale_segments checks the owner itself.
    """
    directory = Path(directory) if directory is not None else DEFAULT_DIRECTORY
    return [path for path in stale_segments(directory) if remove_if_stale(path)]


def remove_if_stale(path: Path) -> bool:
    """Remove `path` when it is a stale segment of this user (is_stale_segment); whether it was removed.
    An entry that cannot be removed is logged and left."""
    if not is_stale_segment(path):
        return False
    try:
        Path(path).unlink()
        return True
    except FileNotFoundError:
        return False   # another server starting removed it first
    except OSError as exc:
        log.warning("could not remove the stale segment %s: %s", path, exc.strerror or exc)
        return False


def object_checksum(data) -> bytes:
    """The digest a writer stores with an object and a reader checks after copying it out of the pages
    (KVB_CACHE_SERVER_CHECKSUM): the generation shows a page reused, this shows a page overwritten."""
    return blake3(data, max_threads=blake3.AUTO).digest(length=CHECKSUM_BYTES)


def contiguous(pages) -> bool:
    """Whether the pages are one run p, p+1, ... (then one slice of the mapping covers them)."""
    return bool(pages) and all(b == a + 1 for a, b in zip(pages, pages[1:]))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # alive, owned by someone else (the pid was reused)
    return True
