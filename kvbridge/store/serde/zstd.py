"""`zstd`: lossless Zstandard compression at the configured level (CodecOptions.zstd_level, from KVB_ZSTD_LEVEL).

The zstd frame records the content size, so decoding needs no level and no metadata.
A compressor is made per call: zstandard's objects are not safe to share between threads.
"""
from __future__ import annotations

from typing import Any

import zstandard

from kvbridge.errors import BadSettings
from kvbridge.store.objects import CorruptObject
from kvbridge.store.serde.base import Codec, CodecMeta, CodecOptions, register_codec

MIN_LEVEL, MAX_LEVEL = -7, 22     # negative levels: zstd's fast modes


@register_codec
class ZstdCodec(Codec):
    name = "zstd"
    lossless = True
    blurb = "lossless Zstandard compression"

    def __init__(self, options: CodecOptions = CodecOptions()) -> None:
        if not MIN_LEVEL <= options.zstd_level <= MAX_LEVEL:
            raise BadSettings(f"the zstd level must be {MIN_LEVEL}..{MAX_LEVEL}, got {options.zstd_level}")
        super().__init__(options)

    def encode(self, payload: Any, meta: CodecMeta | None = None) -> bytes:
        return zstandard.ZstdCompressor(level=self.options.zstd_level).compress(payload)

    def decode(self, data: Any, meta: CodecMeta | None = None) -> bytes:
        try:
            return zstandard.ZstdDecompressor().decompress(data)
        except zstandard.ZstdError as error:
            raise CorruptObject(f"zstd: {error}") from error
