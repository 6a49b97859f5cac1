"""The engines KVB_ENGINE may name: the one table of registered engines, kept where the settings can read it.

Place in the flow: `.env` + environment -> Settings -> **validate(): does KVB_ENGINE name a registered
engine, and what does that engine ask of the settings** -> make_backend. The engine adapters live in a
higher layer (kvbridge.backends), so this table follows the plugin pattern: an adapter module adds its
engine through `kvbridge.backends.registry.register_engine`, and the built-in adapter modules below are
imported by name on the first lookup. The settings layer therefore imports nothing of the backends, yet
`Settings.validate()` sees every engine, including one a test registers. An adapter that fails to import
is remembered with its error: the other engines keep working, and asking for one that is missing names
the broken adapter. What the table holds is the registry's `EngineSpec`; this layer reads only what
`EngineEntry` names (the names, and the engine's own settings checks).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from kvbridge.errors import UnknownEngineError
from kvbridge.plugins import PluginModules

if TYPE_CHECKING:
    from kvbridge.settings.core import Settings

# Each module registers its engine(s) with kvbridge.backends.registry.register_engine() when imported.
BUILTIN_ADAPTERS = (
    "kvbridge.backends.llamacpp",
    "kvbridge.backends.llama_server",
    "kvbridge.backends.ollama",
    "kvbridge.backends.cloud",
)


class EngineEntry(Protocol):
    """What the settings layer reads of a registered engine (kvbridge.backends.registry.EngineSpec)."""

    @property
    def key(self) -> str: ...            # the value of KVB_ENGINE

    @property
    def aliases(self) -> tuple[str, ...]: ...

    def settings_problems(self, settings: Settings, environ: Mapping[str, str]) -> list[str]:
        """The engine's own checks (a model file, cache types, an API key variable)."""
        ...


_ENGINES: dict[str, EngineEntry] = {}
_ADAPTERS = PluginModules(BUILTIN_ADAPTERS)   # a broken adapter is reported by find_engine


def add_engine(entry: EngineEntry) -> None:
    """Put an engine in the table (kvbridge.backends.registry.register_engine calls this); a name taken is a ValueError."""
    taken = {a for e in _ENGINES.values() if e.key != entry.key for a in (e.key, *e.aliases)}
    clash = {entry.key, *entry.aliases} & taken
    if clash:
        raise ValueError(f"engine name(s) {sorted(clash)} already registered")
    _ENGINES[entry.key] = entry


def remove_engine(key: str) -> None:
    _ENGINES.pop(key, None)


def registered_engines() -> list[EngineEntry]:
    _ADAPTERS.load()
    return list(_ENGINES.values())


def known_engine_names() -> list[str]:
    """Every key and alias KVB_ENGINE may take."""
    return [n for e in registered_engines() for n in (e.key, *e.aliases)]


def broken_adapters() -> dict[str, str]:
    """Built-in adapter modules that did not import, with the error each raised."""
    _ADAPTERS.load()
    return dict(_ADAPTERS.broken)


def find_engine(name: str) -> EngineEntry:
    """The engine registered under `name` (a key or an alias, any case); UnknownEngineError listing the known ones."""
    wanted = (name or "").strip().lower()
    entries = registered_engines()
    for entry in entries:
        if wanted == entry.key or wanted in entry.aliases:
            return entry
    if _ADAPTERS.broken:
        broken = _ADAPTERS.broken_summary()
        raise UnknownEngineError(
            f"KVB_ENGINE={name!r} is not available: the engine adapters did not all import: {broken}. "
            f"Engines that did: {', '.join(known_engine_names()) or 'none'}.")
    known = ", ".join(f"{e.key} (aliases: {', '.join(e.aliases)})" if e.aliases else e.key for e in entries)
    raise UnknownEngineError(f"Unknown engine {name!r} (KVB_ENGINE). Known engines: {known}.")
