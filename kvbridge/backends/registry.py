"""The engine registry: the only list of engines. The GUI, the CLI and Settings.validate() read it.

The table itself lives one layer down, in kvbridge.settings.engines, so that Settings.validate() can
check KVB_ENGINE and run the engine's own `Backend.settings_problems` without importing the backends;
that module also names the built-in adapters (BUILTIN_ADAPTERS) and imports them on the first question
asked of the table, not when this package is imported, so the engine core can import
`kvbridge.backends.base` for its types without loading any adapter. This module is the engine side of
the table: what an engine is (EngineSpec: its Backend class, label, blurb and GUI fields), how an
adapter adds one (register_engine) and how a backend is built from a name (make_backend).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import cast

from kvbridge.backends.base import Backend
from kvbridge.settings import Settings
from kvbridge.settings import engines as engine_table


@dataclass(frozen=True)
class EngineSpec:
    key: str                     # registry key, the value of KVB_ENGINE
    label: str                   # shown to people
    cls: type[Backend]
    blurb: str = ""              # one line for the GUI and --help
    aliases: tuple[str, ...] = field(default_factory=tuple)
    fields: tuple[str, ...] = field(default_factory=tuple)  # Settings fields the GUI shows for it

    def settings_problems(self, settings: Settings, environ: Mapping[str, str]) -> list[str]:
        """The engine's own checks, which Settings.validate() runs after the general ones."""
        return self.cls.settings_problems(settings, environ)


def register_engine(spec: EngineSpec) -> EngineSpec:
    """Add an engine under its key and aliases; a name another engine holds is a ValueError."""
    engine_table.add_engine(spec)
    return spec


def unregister_engine(key: str) -> None:
    """Remove an engine (tests register fakes and remove them again)."""
    engine_table.remove_engine(key)


# Only register_engine adds to the table, so every entry in it is an EngineSpec.
def engine_specs() -> list[EngineSpec]:
    return cast("list[EngineSpec]", engine_table.registered_engines())


def resolve_engine(name: str) -> EngineSpec:
    """The engine named by a key or an alias (any case); UnknownEngineError listing the known ones."""
    return cast(EngineSpec, engine_table.find_engine(name))


def make_backend(kind: str, settings: Settings) -> Backend:
    return resolve_engine(kind).cls(settings)
