"""The engine registry: the only list of engines. The GUI, the CLI and Settings.validate() read it."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import Settings
from ..errors import UnknownEngineError
from .base import Backend


@dataclass(frozen=True)
class EngineSpec:
    key: str                     # registry key, the value of KVB_ENGINE
    label: str                   # shown to people
    cls: type[Backend]
    blurb: str = ""              # one line for the GUI and --help
    aliases: tuple[str, ...] = field(default_factory=tuple)
    fields: tuple[str, ...] = field(default_factory=tuple)  # Settings fields the GUI shows for it


_ENGINES: dict[str, EngineSpec] = {}


def register_engine(spec: EngineSpec) -> EngineSpec:
    taken = {a for s in _ENGINES.values() if s.key != spec.key for a in (s.key, *s.aliases)}
    clash = {spec.key, *spec.aliases} & taken
    if clash:
        raise ValueError(f"engine name(s) {sorted(clash)} already registered")
    _ENGINES[spec.key] = spec
    return spec


def engine_specs() -> list[EngineSpec]:
    return list(_ENGINES.values())


def known_engine_names() -> list[str]:
    return [n for s in _ENGINES.values() for n in (s.key, *s.aliases)]


def resolve_engine(name: str) -> EngineSpec:
    wanted = (name or "").strip().lower()
    for spec in _ENGINES.values():
        if wanted == spec.key or wanted in spec.aliases:
            return spec
    known = ", ".join(f"{s.key} (aliases: {', '.join(s.aliases)})" if s.aliases else s.key for s in _ENGINES.values())
    raise UnknownEngineError(f"Unknown engine {name!r} (KVB_ENGINE). Known engines: {known}.")


def make_backend(kind: str, settings: Settings) -> Backend:
    return resolve_engine(kind).cls(settings)
