"""The serde frame: which codec wrote an object travels with it, so any reader can decode it.

Layout, version 1 (little-endian):

    magic        8 bytes  b"KVB-SER\\n"
    version      u16      FRAME_VERSION
    flags        u8       bit 0: written by a lossy codec (readable without knowing the codec)
    name_len     u8
    decoded_len  u64      length of the payload decode() must give back
    encoded_len  u64
    checksum     32 bytes blake3 of the 28 header bytes above, the name and the encoded bytes
    name         name_len bytes, ASCII codec name
    encoded      encoded_len bytes, what the codec produced

The checksum covers the ENCODED bytes (checked before anything is decoded, so a damaged object
never reaches a decompressor) and the header, so a flipped codec name is caught too. Anything that
does not match, an unknown codec, or a decode that gives another length raises CorruptObject.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import blake3

from kvbridge.store.objects import CorruptObject
from kvbridge.store.serde.base import Codec, CodecMeta, UnknownCodecError, get_codec

MAGIC = b"KVB-SER\n"
FRAME_VERSION = 1
FLAG_LOSSY = 1
_HEAD = struct.Struct("<8sHBBQQ")
_SUM_BYTES = 32
FRAME_OVERHEAD = _HEAD.size + _SUM_BYTES     # plus the codec name


@dataclass(frozen=True)
class Frame:
    """A checked frame, not yet decoded (`encoded` views the input)."""

    codec: str
    lossy: bool
    decoded_len: int
    encoded: memoryview


def pack(codec: str | Codec, payload: Any, meta: CodecMeta | None = None) -> bytes:
    """Encode `payload` with `codec` (a name, or a configured Codec) and frame the result."""
    if isinstance(codec, str):
        codec = get_codec(codec)
    encoded = codec.encode(payload, meta)
    name = codec.name.encode("ascii")
    head = _HEAD.pack(MAGIC, FRAME_VERSION, 0 if codec.lossless else FLAG_LOSSY, len(name),
                      memoryview(payload).nbytes, len(encoded))
    checksum = blake3.blake3(head)
    checksum.update(name)
    checksum.update(encoded)
    return b"".join((head, checksum.digest(), name, encoded))


def read_frame(data: Any) -> Frame:
    """Check a frame's magic, version, lengths and checksum; CorruptObject if any fails."""
    buf = memoryview(data).cast("B")
    if len(buf) < FRAME_OVERHEAD:
        raise CorruptObject(f"serde frame of {len(buf)} bytes is shorter than its header")
    magic, version, flags, name_len, decoded_len, encoded_len = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptObject("not a serde frame (bad magic)")
    if version != FRAME_VERSION:
        raise CorruptObject(f"serde frame version {version}, this KVBridge reads {FRAME_VERSION}")
    name_at = FRAME_OVERHEAD
    encoded_at = name_at + name_len
    if len(buf) != encoded_at + encoded_len:
        raise CorruptObject(f"serde frame is {len(buf)} bytes, its header says {encoded_at + encoded_len}")
    checksum = blake3.blake3(buf[:_HEAD.size])
    checksum.update(buf[name_at:])
    if checksum.digest() != bytes(buf[_HEAD.size:name_at]):
        raise CorruptObject("serde frame checksum mismatch")
    try:
        name = bytes(buf[name_at:encoded_at]).decode("ascii")
    except UnicodeDecodeError as error:
        raise CorruptObject("serde frame codec name is not ASCII") from error
    return Frame(name, bool(flags & FLAG_LOSSY), decoded_len, buf[encoded_at:])


def unpack(data: Any, meta: CodecMeta | None = None) -> tuple[str, bytes]:
    """(codec name, payload) of a frame, whatever codec wrote it; CorruptObject if it cannot be read."""
    frame = read_frame(data)
    try:
        codec = get_codec(frame.codec)
    except UnknownCodecError as error:     # written by a newer KVBridge or a plug-in not installed here
        raise CorruptObject(f"serde frame written by codec {frame.codec!r}: {error}") from error
    payload = codec.decode(frame.encoded, meta)
    if len(payload) != frame.decoded_len:
        raise CorruptObject(f"codec {frame.codec!r} decoded {len(payload)} bytes, the frame says {frame.decoded_len}")
    return frame.codec, payload
