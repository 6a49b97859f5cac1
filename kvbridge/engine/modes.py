"""Engine modes: the registry CachedEngine asks how to run a request, so a new mode plugs in from above.

Place in the flow: CachedEngine.infer(mode) -> **mode_spec(mode)** -> prepare (tokens, segments) ->
the mode's run(engine, request) -> the record. The exact prefix modes are built in here; blend mode
(kvbridge.blend.mode) registers itself, loaded on the first question asked of the registry, like the
engine adapters (kvbridge.backends.registry): the engine never imports a mode's package, so blend
depends on the engine and never the other way. A mode module that fails to import is remembered with
its error; the other modes keep working. The GUI, the bench and the CLI list modes from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from kvbridge.backends.base import Prompt
from kvbridge.engine.records import RequestRecord
from kvbridge.engine.stages import StageTimer
from kvbridge.errors import BadSettings
from kvbridge.plugins import PluginModules

if TYPE_CHECKING:
    from kvbridge.engine.cached_engine import CachedEngine

# Each module registers its mode(s) with register_mode() when imported.
BUILTIN_MODE_PLUGINS = ("kvbridge.blend.mode",)


@dataclass
class ModeRequest:
    """One request as CachedEngine hands it to its mode: prepared, its record open, the clock running."""

    prompt: Prompt
    n_predict: int
    temperature: float
    record: RequestRecord
    t0: float                          # perf_counter() when the request began (TTFT counts from it)
    timer: StageTimer
    on_text: Callable[[str], None] | None = None


@dataclass(frozen=True)
class ModeSpec:
    name: str                                              # the mode's name, as infer(mode=) and the record take it
    summary: str                                           # what it does, for a person
    run: Callable[["CachedEngine", ModeRequest], None]     # runs one request on the engine, filling its record
    default: bool = True                                   # run when no modes are named (approximate ones: only when chosen)
    make_runner: Callable[["CachedEngine"], object] | None = None   # what the mode keeps per engine (CachedEngine.mode_runner)


def _exact_prefix(engine: "CachedEngine", request: ModeRequest) -> None:
    engine.run_exact_prefix(request)


_MODES: dict[str, ModeSpec] = {spec.name: spec for spec in (
    ModeSpec("cold", "the engine's own cache is dropped before every request; full prefill; the baseline",
             _exact_prefix),
    ModeSpec("native", "the engine's own in-context prefix reuse only (what a user has today)", _exact_prefix),
    ModeSpec("lmcache", "the engine's own cache is dropped first (eviction by another session, or a restart); full "
             "engines restore the longest stored prefix from our store, shadow engines index the prompt and predict "
             "the reuse", _exact_prefix),
)}
_PLUGINS = PluginModules(BUILTIN_MODE_PLUGINS)   # a broken mode module is named by mode_spec


def register_mode(spec: ModeSpec) -> ModeSpec:
    _MODES[spec.name] = spec
    return spec


def unregister_mode(name: str) -> None:
    """Remove a mode (tests register fakes and remove them again)."""
    _MODES.pop(name, None)


def mode_specs() -> list[ModeSpec]:
    _PLUGINS.load()
    return list(_MODES.values())


def mode_names() -> tuple[str, ...]:
    """Every mode, built-in ones first."""
    return tuple(spec.name for spec in mode_specs())


def default_mode_names() -> tuple[str, ...]:
    """The modes run when none are named (blend is approximate by design: run only when chosen)."""
    return tuple(spec.name for spec in mode_specs() if spec.default)


def broken_mode_plugins() -> dict[str, str]:
    """Built-in mode modules that did not import, with the error each raised."""
    _PLUGINS.load()
    return dict(_PLUGINS.broken)


def mode_spec(name: str) -> ModeSpec:
    specs = {spec.name: spec for spec in mode_specs()}
    if name in specs:
        return specs[name]
    broken = "".join(f" ({module} did not import: {error})" for module, error in _PLUGINS.broken.items())
    raise BadSettings(f"Unknown mode {name!r}; use one of {', '.join(specs)}.{broken}")
