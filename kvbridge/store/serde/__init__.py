"""Pluggable KV serialisation (LMCache's serde interface): how a tier turns a payload into bytes.

    from kvbridge.store.serde import TierCodec
    codec = TierCodec.named("zstd", zstd_level=3, setting="KVB_L2_SERDE")
    stored, meta = codec.encode(blob, meta)     # meta.codec names the codec, meta.lossy is sticky
    blob = TierCodec.decode(stored, meta)       # whatever codec wrote it; CorruptObject if it cannot

Place in the flow: ... -> encode_chunk -> tier put -> **TierCodec.encode** -> the tier's checked
header (ObjectMeta with codec and lossy) + the stored bytes; tier get -> header and checksum checks
-> **TierCodec.decode** -> decode_chunk -> assemble. The tier's header (kvbridge.store.diskformat,
also for L3 values) is what detects damage; codecs only transform bytes. Modules, in reading
order: base (the Codec interface, and register_codec, which adds a codec to the table in
kvbridge.settings.codecs, the home of UnknownCodecError and codec_names), tier (how a tier applies
its codec), then one module per codec: raw, zstd, int8 (lossy).
"""
from kvbridge.store.serde.base import (
    Codec,
    CodecMeta,
    CodecOptions,
    get_codec,
    known_geometry,
    register_codec,
    remember_geometry,
    unregister_codec,
)
from kvbridge.store.serde.tier import TierCodec

__all__ = [
    "Codec",
    "CodecMeta",
    "CodecOptions",
    "TierCodec",
    "get_codec",
    "known_geometry",
    "register_codec",
    "remember_geometry",
    "unregister_codec",
]
