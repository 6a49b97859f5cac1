"""Pluggable KV serialisation (LMCache's serde interface): how a tier turns a payload into bytes.

    from kvbridge.store.serde import get_codec, pack, unpack, CodecMeta, CodecOptions
    codec = get_codec("zstd", CodecOptions(zstd_level=3), setting="the L2 codec setting")
    framed = pack(codec, chunk_payload, CodecMeta(kind="chunk", geometry=geometry))
    name, payload = unpack(framed)            # whatever codec wrote it; CorruptObject if damaged

Place in the flow: ... -> encode_chunk -> **pack** -> tier put; tier get -> **unpack** ->
decode_chunk -> assemble. Modules, in reading order: base (the Codec interface and the registry),
frame (the framed bytes a tier stores), then one module per codec: raw, zstd, int8 (lossy).
"""
from kvbridge.store.serde.base import (
    Codec,
    CodecMeta,
    CodecOptions,
    UnknownCodecError,
    broken_codecs,
    codec_names,
    get_codec,
    known_geometry,
    register_codec,
    remember_geometry,
    unregister_codec,
)
from kvbridge.store.serde.frame import Frame, pack, read_frame, unpack
from kvbridge.store.serde.tier import TierCodec

__all__ = [
    "Codec",
    "CodecMeta",
    "CodecOptions",
    "Frame",
    "UnknownCodecError",
    "broken_codecs",
    "codec_names",
    "get_codec",
    "known_geometry",
    "pack",
    "read_frame",
    "register_codec",
    "remember_geometry",
    "TierCodec",
    "unpack",
    "unregister_codec",
]
