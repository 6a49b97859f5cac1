"""How a persistent tier applies its codec: encode on put, decode on get, the codec named in the metadata.

A tier (L2 files, L3 values) stores `TierCodec.encode(blob, meta)`'s bytes under its own checked
header, with the returned metadata: `codec` says how those bytes were made, so any reader decodes
them whatever its own setting, and `lossy` (sticky) says the KV once passed through a lossy codec,
so a record restored from it can say so. A codec may decline a payload (int8 on a quantised cache
type): the object is then stored raw and the reason is kept in `declined` for the GUI.

Decoding raises CorruptObject for anything it cannot read (a codec this reader lacks included): the
tier drops the object and the store counts a miss, as for any other damaged object.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any

from kvbridge.store.objects import CorruptObject, ObjectMeta
from kvbridge.settings.codecs import UnknownCodecError
from kvbridge.store.serde.base import Codec, CodecMeta, CodecOptions, get_codec

log = logging.getLogger(__name__)


class TierCodec:
    """The codec one tier writes with (KVB_L2_SERDE, KVB_L3_SERDE)."""

    def __init__(self, codec: Codec | None = None) -> None:
        self.codec = codec if codec is not None else get_codec("raw")
        self.name = self.codec.name
        self.lossless = self.codec.lossless
        self.declined: dict[str, int] = {}      # reason -> objects stored raw for it
        self._lock = threading.Lock()

    @classmethod
    def named(cls, name: str, zstd_level: int = 3, setting: str | None = None) -> "TierCodec":
        """UnknownCodecError (a BadSettings naming `setting`) when no codec has that name."""
        return cls(get_codec(name, CodecOptions(zstd_level=zstd_level), setting=setting))

    def label(self) -> str:
        return self.name if self.lossless else f"{self.name} (lossy)"

    def encode(self, blob: Any, meta: ObjectMeta) -> tuple[Any, ObjectMeta]:
        """(bytes to store, metadata to store with them); raw passes the blob through uncopied."""
        if self.name == "raw":
            return blob, (meta if meta.codec == "raw" else replace(meta, codec="raw"))
        encoded = self.codec.encode(blob, CodecMeta(kind=meta.kind))
        reason = self.codec.declined(encoded)
        if reason is not None:
            with self._lock:
                first = reason not in self.declined
                self.declined[reason] = self.declined.get(reason, 0) + 1
            if first:
                log.info("%s codec stores some objects losslessly: %s", self.name, reason)
            return blob, replace(meta, codec="raw")
        lossy = meta.lossy or ("" if self.lossless else self.name)
        return encoded, replace(meta, codec=self.name, lossy=lossy)

    @staticmethod
    def decode(stored: Any, meta: ObjectMeta) -> Any:
        """The payload the engine stored (lossy codecs: what they kept of it)."""
        if meta.codec == "raw":
            return stored
        try:
            codec = get_codec(meta.codec)
        except UnknownCodecError as error:   # a newer KVBridge or a plug-in codec not installed here
            raise CorruptObject(f"stored with codec {meta.codec!r}, unknown here: {error}") from error
        return codec.decode(stored, CodecMeta(kind=meta.kind))
