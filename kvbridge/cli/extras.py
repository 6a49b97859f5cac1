"""Which extra each command needs, checked before the command runs: a missing extra is a message, never a traceback.

Place in the flow: `kvbridge` parses its arguments, then kvbridge.__main__ asks `missing_extras_message` here,
before the command reads or checks any setting or model; a non-empty answer is printed and the exit is 2.
COMMAND_EXTRAS has one row per command of kvbridge.cli.commands.COMMANDS (tests/test_packaging.py holds
that). An engine command also needs what its engine needs (the in-process engines: llama), the engine
being the command's --engine, else KVB_ENGINE (serve and fleet: KVB_SERVE_ENGINE). `for_missing_module`
is the last line of defence: a ModuleNotFoundError that still escapes a command, for a module an extra
brings, gets the same message. What to install comes from kvbridge.settings.install (the extra's own
requirements: KVBridge is on no package index). Deliberately left out: the optional packages of one
setting (a cache server URL needs pyzmq, KVB_L3_URL needs redis); the last line of defence names those.
"""
from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass, field

from kvbridge.settings.install import install_advice

# The modules each runtime extra brings (an import name per distribution of the extra in pyproject.toml;
# tests/test_packaging.py holds the two together). fleet's own package is vllm-router's binary.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "llama": ("llama_cpp",),
    "gui": ("gradio", "plotly"),
    "serve": ("starlette", "uvicorn"),
    "cache-server": ("zmq",),
    "redis": ("redis", "hiredis"),
    "s3": ("boto3",),
    "fleet": ("vllm_router",),
}
# fleet's requirements include kvbridge[serve,cache-server]: checking fleet checks those too
EXTRA_INCLUDES: dict[str, tuple[str, ...]] = {"fleet": ("serve", "cache-server")}
MODULE_EXTRA = {module: extra for extra, modules in EXTRA_MODULES.items() for module in modules}
# The engines that run llama.cpp in this process (registry keys; aliases resolve to them first).
ENGINE_EXTRAS: dict[str, tuple[str, ...]] = {"llamacpp": ("llama",), "scheduler": ("llama",)}


@dataclass(frozen=True)
class Needs:
    """What a command needs beyond the base install."""

    extras: tuple[str, ...] = ()
    engine: str = ""                        # "engine": --engine, else KVB_ENGINE; "serve_engine": else KVB_SERVE_ENGINE
    when_flag: dict[str, tuple[str, ...]] = field(default_factory=dict)   # argparse dest -> extras when it is set


COMMAND_EXTRAS: dict[str, Needs] = {
    "setup": Needs(),
    "gui": Needs(("gui",), when_flag={"serve": ("serve",)}),
    "demo": Needs(engine="engine"),
    "bench": Needs(("gui",), engine="engine"),              # plotly draws the run's figures (HTML)
    "bench-store": Needs(),
    "bench-restore": Needs(("cache-server",), engine="engine"),
    "bench-cache-server": Needs(("cache-server",)),
    "bench-l3": Needs(("redis",), engine="engine"),
    "bench-s3": Needs(("s3",), engine="engine"),
    "bench-floor": Needs(("llama", "cache-server", "redis")),   # every path: in-process, cache server, L3
    "bench-scheduler": Needs(("llama",)),
    "bench-serve": Needs(("serve", "llama")),                  # serve's scheduler against llama-server
    "bench-fleet": Needs(("fleet", "llama")),
    "bench-misses": Needs(("redis",), engine="engine"),        # the redis-stop scenario
    "cache-server": Needs(("cache-server",)),
    "serve": Needs(("serve",), engine="serve_engine"),
    "fleet": Needs(("fleet",), engine="serve_engine"),        # the workers are serve
    "namespace": Needs(engine="engine"),
    "engines": Needs(),
    "scenarios": Needs(),
    "explain": Needs(engine="engine"),
    "cut-probe": Needs(("llama",)),                            # probes llama.cpp in this process
}


def extra_installed(extra: str) -> bool:
    """Every module the extra (and what it includes) brings can be imported; nothing is imported to find out."""
    extras = (extra, *EXTRA_INCLUDES.get(extra, ()))
    return all(importlib.util.find_spec(module) is not None for name in extras for module in EXTRA_MODULES[name])


def _engine_extras(args: argparse.Namespace, which: str) -> tuple[str, tuple[str, ...]]:
    """(the engine's name, the extras it needs) for the command's --engine, else the setting."""
    name = getattr(args, "engine", None)
    if not name:
        from kvbridge.settings import Settings

        name = getattr(Settings.from_env(), which)   # read, not checked: the command checks the settings itself
    key = name.strip().lower()
    if key not in ENGINE_EXTRAS:   # an alias, or another engine: the registry (it imports the adapters) says which
        from kvbridge.errors import KVBridgeError
        from kvbridge.settings.engines import find_engine

        try:
            key = find_engine(name).key
        except KVBridgeError:   # an unknown engine: the command's own settings check says so
            pass
    return name, ENGINE_EXTRAS.get(key, ())


def missing_extras_message(command: str, args: argparse.Namespace) -> str:
    """'' when the command has what it needs; else what is missing and the line that installs it."""
    needs = COMMAND_EXTRAS[command]
    wanted = list(needs.extras)
    for dest, extras in needs.when_flag.items():
        if getattr(args, dest, None):
            wanted += extras
    engine, engine_wants = _engine_extras(args, needs.engine) if needs.engine else ("", ())
    wanted += engine_wants
    missing = [extra for extra in dict.fromkeys(wanted) if not extra_installed(extra)]
    if not missing:
        return ""
    why = ""
    if set(missing) & set(engine_wants):
        setting = "KVB_SERVE_ENGINE" if needs.engine == "serve_engine" else "KVB_ENGINE"
        why = f"\nThe engine {engine!r} runs llama.cpp in this process; --engine or {setting} chooses another."
    return _message(f"`kvbridge {command}`", missing) + why


def for_missing_module(error: ModuleNotFoundError, command: str) -> str:
    """The same message for a module an extra brings that a command imported anyway; '' for any other module."""
    top = (error.name or "").partition(".")[0]
    extra = MODULE_EXTRA.get(top)
    return _message(f"`kvbridge {command}` (it imports {top})", [extra]) if extra else ""


def _message(what: str, missing: list[str]) -> str:
    names = missing[0] if len(missing) == 1 else ", ".join(missing[:-1]) + " and " + missing[-1]
    noun = "extra" if len(missing) == 1 else "extras"
    return (f"{what} needs KVBridge's {names} {noun}, which {'is' if len(missing) == 1 else 'are'} not installed "
            f"here.\n{install_advice(*missing)}")
