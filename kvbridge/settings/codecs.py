"""The KV codec names KVB_L2_SERDE and KVB_L3_SERDE may take: the one table of codecs, kept where the settings can read it.

Place in the flow: `.env` + environment -> Settings -> **validate(): does each tier's codec name a
registered codec** -> the store opens its tiers, each with its codec (kvbridge.store.serde). The codecs
live in a higher layer (the store), so this table follows the plugin pattern: a codec module adds its
class through `kvbridge.store.serde.register_codec`, and the built-in codec modules below are imported
by name on the first lookup. So the settings check and the store read one table, and a codec whose
module does not import here (zstandard not installed) is unknown to both, named with its error.
"""
from __future__ import annotations

from kvbridge.errors import BadSettings
from kvbridge.plugins import PluginModules

# Each module registers its codec(s) with kvbridge.store.serde.register_codec() when imported.
BUILTIN_CODECS = (
    "kvbridge.store.serde.raw",
    "kvbridge.store.serde.zstd",
    "kvbridge.store.serde.int8",
)


class UnknownCodecError(BadSettings, KeyError):
    """A codec name no codec is registered under; the message lists the known ones."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0] if self.args else "unknown KV codec"


_CODECS: dict[str, type] = {}           # name -> its kvbridge.store.serde.Codec class
# a codec whose library is missing (zstandard not installed) is reported by codec_class; the others keep working
_BUILTINS = PluginModules(BUILTIN_CODECS, tolerate=ImportError)


def add_codec(name: str, cls: type) -> None:
    """Put a codec class in the table (kvbridge.store.serde.register_codec calls this); a name taken is a ValueError."""
    if _CODECS.get(name, cls) is not cls:
        raise ValueError(f"codec name {name!r} already registered")
    _CODECS[name] = cls


def remove_codec(name: str) -> None:
    _CODECS.pop(name, None)


def codec_names() -> list[str]:
    _BUILTINS.load()
    return sorted(_CODECS)


def broken_codecs() -> dict[str, str]:
    """Built-in codec modules that did not import, with the error each raised."""
    _BUILTINS.load()
    return dict(_BUILTINS.broken)


def codec_class(name: str, setting: str | None = None) -> type:
    """The codec class registered as `name`; UnknownCodecError naming `setting` (the variable it came from)."""
    _BUILTINS.load()
    cls = _CODECS.get(name)
    if cls is None:
        where = f" (from {setting})" if setting else ""
        broken = "".join(f"; {module} did not load: {error}" for module, error in _BUILTINS.broken.items())
        raise UnknownCodecError(f"unknown KV codec {name!r}{where}; known codecs: "
                                f"{', '.join(sorted(_CODECS)) or 'none'}{broken}")
    return cls
