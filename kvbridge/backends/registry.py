"""The engine registry: the only list of engines. The GUI, the CLI and Settings.validate() read it.

The built-in adapters are imported on the first question asked of the registry, not when the
package is imported, so the engine core can import `kvbridge.backends.base` for its types without
loading any adapter. An adapter that fails to import is remembered with its error: the other
engines keep working, and asking for one that is missing names the broken adapter.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from kvbridge.backends.base import Backend
from kvbridge.errors import UnknownEngineError
from kvbridge.settings import Settings

# Each module registers its engine(s) with register_engine() when imported.
BUILTIN_ADAPTERS = (
    "kvbridge.backends.llamacpp",
    "kvbridge.backends.llama_server",
    "kvbridge.backends.ollama",
    "kvbridge.backends.cloud",
)


@dataclass(frozen=True)
class EngineSpec:
    key: str                     # registry key, the value of KVB_ENGINE
    label: str                   # shown to people
    cls: type[Backend]
    blurb: str = ""              # one line for the GUI and --help
    aliases: tuple[str, ...] = field(default_factory=tuple)
    fields: tuple[str, ...] = field(default_factory=tuple)  # Settings fields the GUI shows for it


_ENGINES: dict[str, EngineSpec] = {}
_BROKEN_ADAPTERS: dict[str, str] = {}    # module -> "ErrorType: message"
_builtins_loaded = False


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    for module in BUILTIN_ADAPTERS:
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - one broken adapter must not hide the others; reported by resolve_engine
            _BROKEN_ADAPTERS[module] = f"{type(error).__name__}: {error}"


def register_engine(spec: EngineSpec) -> EngineSpec:
    taken = {a for s in _ENGINES.values() if s.key != spec.key for a in (s.key, *s.aliases)}
    clash = {spec.key, *spec.aliases} & taken
    if clash:
        raise ValueError(f"engine name(s) {sorted(clash)} already registered")
    _ENGINES[spec.key] = spec
    return spec


def unregister_engine(key: str) -> None:
    """Remove an engine (tests register fakes and remove them again)."""
    _ENGINES.pop(key, None)


def engine_specs() -> list[EngineSpec]:
    _load_builtins()
    return list(_ENGINES.values())


def known_engine_names() -> list[str]:
    return [n for s in engine_specs() for n in (s.key, *s.aliases)]


def broken_adapters() -> dict[str, str]:
    """Built-in adapter modules that did not import, with the error each raised."""
    _load_builtins()
    return dict(_BROKEN_ADAPTERS)


def resolve_engine(name: str) -> EngineSpec:
    wanted = (name or "").strip().lower()
    specs = engine_specs()
    for spec in specs:
        if wanted == spec.key or wanted in spec.aliases:
            return spec
    if _BROKEN_ADAPTERS:
        broken = "; ".join(f"{module} ({error})" for module, error in _BROKEN_ADAPTERS.items())
        raise UnknownEngineError(
            f"KVB_ENGINE={name!r} is not available: the engine adapters did not all import: {broken}. "
            f"Engines that did: {', '.join(known_engine_names()) or 'none'}.")
    known = ", ".join(f"{s.key} (aliases: {', '.join(s.aliases)})" if s.aliases else s.key for s in specs)
    raise UnknownEngineError(f"Unknown engine {name!r} (KVB_ENGINE). Known engines: {known}.")


def make_backend(kind: str, settings: Settings) -> Backend:
    return resolve_engine(kind).cls(settings)
