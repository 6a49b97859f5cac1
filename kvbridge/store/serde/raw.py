"""`raw`: the identity codec and the default; the payload is stored exactly as the engine made it."""
from __future__ import annotations

from typing import Any

from kvbridge.store.serde.base import Codec, CodecMeta, register_codec


@register_codec
class RawCodec(Codec):
    name = "raw"
    lossless = True
    blurb = "stored as is (the default)"

    def encode(self, payload: Any, meta: CodecMeta | None = None) -> bytes:
        return bytes(payload)

    def decode(self, data: Any, meta: CodecMeta | None = None) -> bytes:
        return bytes(data)
