"""The L2 object file: one file per object, a checked header, then the payload.

Layout, version 1 (little-endian):

    magic        8 bytes  b"KVB-L2\\r\\n"  (the CR LF catches text-mode mangling, as PNG's does)
    version      u32      FORMAT_VERSION
    key_len      u16
    meta_len     u32      JSON metadata (ObjectMeta.to_json, includes the namespace)
    payload_len  u64
    payload_sum  32 bytes blake3 of the payload
    key          key_len bytes
    meta         meta_len bytes
    header_sum   16 bytes blake3 of everything above
    payload      payload_len bytes

Writes are atomic: a uniquely named temp file in the same directory, fsync, os.replace, then an
fsync of the directory. A reader therefore sees a whole old file, a whole new file or no file.
Reading the header alone (for the index at start) never touches the payload.

A temp file's name says who is writing it: `.<object name>.<pid>-<start>-<boot>.<random>.tmp`, where
start is the writer's start time (clock ticks since boot, /proc/<pid>/stat) and boot the first
8 hex digits of the kernel's boot id. A writer killed mid-put (SIGKILL, OOM, power loss) leaves its
temp file behind; `temp_writer_state` tells a live writer from a dead one, also when the pid has
since been given to another process (its start time differs) or the machine rebooted. Without
/proc (not Linux) the writer cannot be identified and the state is "unknown".

Errors: reading raises CorruptObject (a StoreFault) for anything malformed and OSError when the
file cannot be read; writing raises UnstorableObject (a StoreFault) when the object cannot be
expressed in this format and OSError when the OS refuses (disk full). DiskTier turns all of these
into counted misses and skipped writes.
"""
from __future__ import annotations

import os
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path
from functools import lru_cache
from typing import BinaryIO, Literal

import blake3

from kvbridge.store.objects import MAX_KEY_BYTES, CorruptObject, ObjectMeta, UnstorableObject

MAGIC = b"KVB-L2\r\n"
FORMAT_VERSION = 1
FILE_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
MAX_META_BYTES = 64 << 10
_FIXED = struct.Struct("<8sIHIQ32s")
_HEADER_SUM_BYTES = 16
FIXED_BYTES = _FIXED.size     # enough to learn a header's whole length (header_length)


class UnsupportedVersion(CorruptObject):
    """A KVBridge object file of another format version; `newer` ones belong to a newer KVBridge."""

    def __init__(self, version: int) -> None:
        super().__init__(f"format version {version}, this KVBridge reads {FORMAT_VERSION}")
        self.newer = version > FORMAT_VERSION


@dataclass(frozen=True)
class Header:
    key: bytes
    meta: ObjectMeta
    payload_len: int
    payload_sum: bytes
    header_len: int


def encode_header(key: bytes, meta: ObjectMeta, payload: bytes, magic: bytes = MAGIC) -> bytes:
    """The checked header written before `payload` (L3 values use it too, with their own magic)."""
    meta_json = meta.to_json()
    if len(meta_json) > MAX_META_BYTES:
        raise UnstorableObject(f"object metadata is {len(meta_json)} bytes; at most {MAX_META_BYTES} (shorten the note)")
    payload_sum = blake3.blake3(payload, max_threads=blake3.blake3.AUTO).digest()
    head = _FIXED.pack(magic, FORMAT_VERSION, len(key), len(meta_json), memoryview(payload).nbytes,
                       payload_sum) + key + meta_json
    return head + blake3.blake3(head).digest(length=_HEADER_SUM_BYTES)


def header_length(fixed: bytes, magic: bytes = MAGIC) -> int:
    """The whole header's length, from its first FIXED_BYTES; CorruptObject when they are not a header."""
    if len(fixed) < _FIXED.size:
        raise CorruptObject("truncated header")
    found_magic, version, key_len, meta_len, _, _ = _FIXED.unpack_from(fixed, 0)
    if found_magic != magic:
        raise CorruptObject("not a KVBridge object (bad magic)")
    if version != FORMAT_VERSION:
        raise UnsupportedVersion(version)
    if not 0 < key_len <= MAX_KEY_BYTES or meta_len > MAX_META_BYTES:
        raise CorruptObject("implausible header lengths")
    return _FIXED.size + key_len + meta_len + _HEADER_SUM_BYTES


def parse_header(buf: bytes, total_size: int, magic: bytes = MAGIC) -> Header:
    """Check the header at the start of `buf` (which may hold more) of an object `total_size` long."""
    header_len = header_length(bytes(buf[:_FIXED.size]), magic)
    if len(buf) < header_len:
        raise CorruptObject("truncated header")
    _, _, key_len, _, payload_len, payload_sum = _FIXED.unpack_from(buf, 0)
    head = bytes(buf[:header_len - _HEADER_SUM_BYTES])
    if blake3.blake3(head).digest(length=_HEADER_SUM_BYTES) != bytes(buf[header_len - _HEADER_SUM_BYTES:header_len]):
        raise CorruptObject("header checksum mismatch")
    if total_size != header_len + payload_len:
        raise CorruptObject(f"object is {total_size} bytes, its header says {header_len + payload_len} (truncated?)")
    meta = ObjectMeta.from_json(head[_FIXED.size + key_len:])
    return Header(head[_FIXED.size:_FIXED.size + key_len], meta, payload_len, payload_sum, header_len)


def decode_object(value: bytes, expected_key: bytes, magic: bytes = MAGIC) -> tuple[memoryview, ObjectMeta]:
    """A whole object held in memory (an L3 value): its payload (a view) and metadata; CorruptObject when bad."""
    header = parse_header(value, len(value), magic)
    if header.key != expected_key:
        raise CorruptObject("the object holds another key")
    payload = memoryview(value)[header.header_len:]
    if blake3.blake3(payload, max_threads=blake3.blake3.AUTO).digest() != header.payload_sum:
        raise CorruptObject("payload checksum mismatch")
    return payload, header.meta


def read_header(stream: BinaryIO, file_size: int) -> Header:
    """Parse and check the header; the stream is left at the payload. Raises CorruptObject."""
    fixed = stream.read(_FIXED.size)
    rest = stream.read(header_length(fixed) - len(fixed))
    return parse_header(fixed + rest, file_size)


def read_header_file(path: Path) -> Header:
    """Header of an object file; FileNotFoundError when it is gone, CorruptObject when bad."""
    with open(path, "rb") as stream:
        return read_header(stream, os.fstat(stream.fileno()).st_size)


def read_object_file(path: Path, expected_key: bytes) -> tuple[bytes, ObjectMeta]:
    """Whole object, payload checksum verified. FileNotFoundError when gone, CorruptObject when bad."""
    with open(path, "rb") as stream:
        header = read_header(stream, os.fstat(stream.fileno()).st_size)
        if header.key != expected_key:
            raise CorruptObject("the file holds another key")
        payload = stream.read(header.payload_len)
    if len(payload) != header.payload_len:
        raise CorruptObject("truncated payload")
    if blake3.blake3(payload, max_threads=blake3.blake3.AUTO).digest() != header.payload_sum:
        raise CorruptObject("payload checksum mismatch")
    return payload, header.meta


def write_temp_file(path: Path, key: bytes, blob: bytes, meta: ObjectMeta) -> Path:
    """Write and fsync the object under a temp name beside `path`; the caller renames it into place.

    The slow half of a write, safe to run concurrently with anything. Raises UnstorableObject or
    OSError; no temp file is left behind then.
    """
    header = encode_header(key, meta, blob)
    temp = path.with_name(f".{path.name}.{writer_token(os.getpid())}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(header)
            stream.write(blob)
            stream.flush()
            os.fsync(stream.fileno())
    except BaseException:
        unlink_quietly(temp)
        raise
    return temp


# -- who writes a temp file, and is it still alive ------------------------------------------------
@lru_cache(maxsize=8)  # keyed by pid, so a forked child computes its own
def writer_token(pid: int) -> str:
    """`<pid>-<start>-<boot>` for a running process; start and boot are 0 where /proc is missing."""
    return f"{pid}-{_running_start(pid) or 0}-{_boot_id() or 0}"


def temp_writer_state(name: str) -> Literal["alive", "dead", "unknown"]:
    """Whether the writer named in a temp file's name still runs; "unknown" when that cannot be told."""
    body = name[1:-len(TEMP_SUFFIX)] if name.startswith(".") and name.endswith(TEMP_SUFFIX) else ""
    parts = body.rsplit(".", 2)
    fields = parts[1].split("-") if len(parts) == 3 else []
    if len(fields) != 3 or not fields[0].isdigit() or not fields[1].isdigit():
        return "unknown"  # not a name we write (or an older KVBridge's): judged by age instead
    pid, start, boot = int(fields[0]), fields[1], fields[2]
    our_boot = _boot_id()
    if start == "0" or boot == "0" or our_boot is None:
        return "unknown"
    if boot != our_boot:
        return "dead"  # written before the last reboot
    running = _running_start(pid)
    if running is None:
        return "unknown"
    return "alive" if running == start else "dead"  # "" is no process; another start: a recycled pid


def _running_start(pid: int) -> str | None:
    """Start time (ticks since boot) of the running process `pid`; "" when there is none, None when unknown.

    A zombie (killed, not yet reaped) counts as none: it will never rename its temp file.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return ""
    except OSError:
        return None  # no /proc (not Linux) or not allowed to look
    fields = stat[stat.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    if len(fields) < 20:
        return None
    return "" if fields[0] in ("Z", "X") else fields[19]


@lru_cache(maxsize=1)
def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:8] or None
    except OSError:
        return None


def fsync_directory(directory: Path) -> None:
    """Make a rename durable. Some filesystems refuse fsync on a directory; that only costs durability."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # e.g. EINVAL on filesystems without directory fsync; the rename itself is still atomic
    finally:
        os.close(fd)


def unlink_quietly(path: Path) -> None:
    """Remove our own temp file after a failed write; never raises over the error being reported."""
    try:
        os.unlink(path)
    except OSError:
        pass  # gone already, or the disk refuses: once we exit, the next open removes it as a dead writer's
