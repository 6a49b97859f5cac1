"""The codec interface and its registry: the one list of KV serialisations a tier may be set to.

A codec turns a stored payload into the bytes a tier keeps and back (LMCache's serde interface).
Codecs are stateless and configured once: a tier's TierCodec (kvbridge.store.serde.tier) is named
by KVB_L2_SERDE or KVB_L3_SERDE and gets CodecOptions from KVB_ZSTD_LEVEL. `lossless` is a class
attribute read in two places only: TierCodec marks what a lossy codec wrote (ObjectMeta.lossy), and
the engine adds a lossy codec to the namespace fingerprint (kvbridge.engine.cached_engine), since
it changes what is restored. The table of codecs lives one layer down (kvbridge.settings.codecs),
so the settings checks read the same names without importing the store; adding a codec is one
module that calls register_codec() plus one line in that module's BUILTIN_CODECS.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

from kvbridge.settings import codecs as codec_table

if TYPE_CHECKING:
    from kvbridge.formats.llama_state import KVGeometry

CODEC_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}\Z")   # short ASCII: every object's ObjectMeta.codec


@dataclass(frozen=True)
class CodecOptions:
    """Tunables of the codecs (the zstd level, KVB_ZSTD_LEVEL); decoding never needs them."""

    zstd_level: int = 3


@dataclass(frozen=True)
class CodecMeta:
    """What a codec may know about the payload: its ObjectMeta.kind and the engine's KV geometry.

    Lossless codecs ignore it. int8 needs the geometry to find the K and V rows of a chunk; when none
    is given (TierCodec gives none) it looks the geometry up by the digest in the chunk's header
    (known_geometry, filled by the engine's remember_geometry), and stores the payload losslessly
    only if that digest is unknown too.
    """

    kind: str = "chunk"
    geometry: "KVGeometry | None" = None


class Codec:
    """encode(payload, meta) -> bytes and decode(bytes, meta) -> payload; decode(encode(p)) has len(p).

    decode raises kvbridge.store.objects.CorruptObject for bytes it cannot read (never another error).
    """

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = True
    blurb: ClassVar[str] = ""          # one line for the GUI and --help

    def __init__(self, options: CodecOptions = CodecOptions()) -> None:
        self.options = options

    def encode(self, payload: Any, meta: CodecMeta | None = None) -> bytes:
        raise NotImplementedError

    def decode(self, data: Any, meta: CodecMeta | None = None) -> bytes:
        raise NotImplementedError

    def declined(self, encoded: Any) -> str | None:
        """Why encode() kept this payload as it was (a lossy codec that could not quantise it), or None."""
        return None


_GEOMETRIES: dict[bytes, "KVGeometry"] = {}


def remember_geometry(geometry: "KVGeometry") -> None:
    """Make an engine's KV geometry known to codecs that need it (int8), by its digest.

    A chunk payload carries only the digest; the engine that made it registers the geometry when
    it opens its namespace, so a tier's codec can find the K and V rows without being told.
    """
    _GEOMETRIES[geometry.digest()] = geometry


def known_geometry(digest: bytes) -> "KVGeometry | None":
    return _GEOMETRIES.get(bytes(digest))


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Add a codec class under cls.name (usable as a class decorator)."""
    if not CODEC_NAME.match(cls.name or ""):
        raise ValueError(f"codec name {cls.name!r} must match {CODEC_NAME.pattern}")
    codec_table.add_codec(cls.name, cls)
    return cls


def unregister_codec(name: str) -> None:
    """Remove a codec (tests register fakes and remove them again)."""
    codec_table.remove_codec(name)


def get_codec(name: str, options: CodecOptions | None = None, setting: str | None = None) -> Codec:
    """The codec registered as `name`, configured; UnknownCodecError (kvbridge.settings.codecs) naming
    `setting`, the variable the name came from, when there is none."""
    cls = cast("type[Codec]", codec_table.codec_class(name, setting))   # register_codec adds only Codec classes
    return cls(options or CodecOptions())
