"""What several commands share: settings from the environment with the command's overrides, an engine
on those settings, the engine options, and a progress bar on stderr."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from kvbridge.settings import Settings
from kvbridge.settings.flags import (SHARED_CONTEXT, argparse_type, batches_for, blame, flags_for, from_llama_env,
                                     help_text, ignored_for, ignored_lines, overrides)


def checked(settings: Settings) -> Settings:
    """The settings as they are, or SystemExit listing what needs attention."""
    problems = settings.validate()
    if problems:
        raise SystemExit("Settings need attention:\n  - " + "\n  - ".join(problems))
    return settings


def add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """The llama-server-style flags `command` takes (kvbridge.settings.flags.FLAGS), each defaulting to None:
    not given, the environment and `.env` decide."""
    for flag in flags_for(command):
        if flag.kind == "switch":
            parser.add_argument(*flag.spellings, dest=flag.dest, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text(flag, command))
            continue
        parser.add_argument(*flag.spellings, dest=flag.dest, metavar=flag.metavar, default=None,
                            type=argparse_type(flag), help=help_text(flag, command))
    for batch in batches_for(command):   # llama-server's batch sizes: KVBridge's own size only
        parser.add_argument(*batch.spellings, dest=batch.dest, metavar="N", default=None, type=batch.argparse_type,
                            help=f"llama-server's {batch.what}; {batch.why()}")
    for ignored in ignored_for(command):   # llama-server's, accepted and ignored with a line at start
        if ignored.takes_value:
            parser.add_argument(*ignored.spellings, dest=ignored.dest, metavar="X", default=None,
                                help=f"llama-server's; accepted and ignored: {ignored.why}")
        else:
            parser.add_argument(*ignored.spellings, dest=ignored.dest, action="store_true", default=None,
                                help=f"llama-server's; accepted and ignored: {ignored.why}")


def settings_with_flags(command: str, args, *, leave_out: tuple[str, ...] = (), strict: bool = True) -> Settings:
    """Settings.from_env() with the flags given to `command` over them (all but `leave_out`), checked: a
    problem a flag caused names the flag and its value and always stops the command (the person just typed
    it); the others stop it too when `strict` (the GUI shows them instead, to be fixed in its Engine panel)."""
    settings = Settings.from_env()
    given = from_llama_env(command, vars(args), os.environ)   # serve: LLAMA_ARG_* where no flag was given
    given = {name: value for name, value in given.items() if name not in leave_out}
    if command in SHARED_CONTEXT and given.get("ctx_size") == 0:   # -c 0: the model's own, as llama-server's
        given["ctx_size"] = trained_context(settings.replace(**overrides(command, {**given, "ctx_size": None},
                                                                         settings)))
        print(f"kvbridge {command}: -c 0 is the model's trained context, {given['ctx_size']} tokens", file=sys.stderr)
    for line in ignored_lines(command, given, os.environ):
        print(f"kvbridge {command}: {line}", file=sys.stderr)
    settings = settings.replace(**overrides(command, given, settings))
    flagged, others = blame(command, given, settings.validate())
    if flagged or (strict and others):
        raise SystemExit("Settings need attention:\n  - " + "\n  - ".join(flagged + others))
    return settings


def trained_context(settings: Settings) -> int:
    """The context the model was trained on (its GGUF's <architecture>.context_length), for -c 0; SystemExit
    naming -c when the model cannot be read or does not say."""
    from kvbridge.backends.gguf_vocab import GGUFVocab
    from kvbridge.backends.llama_cpp_model import model_path_for
    from kvbridge.errors import KVBridgeError

    try:
        path = model_path_for(settings)
        meta = GGUFVocab(path).metadata
    except KVBridgeError as exc:
        raise SystemExit(f"Settings need attention:\n  - -c 0 asks for the model's trained context, but the model "
                         f"cannot be read: {exc}") from None
    value = meta.get(f"{meta.get('general.architecture', '')}.context_length", "")
    if not str(value).isdigit() or int(value) <= 0:
        raise SystemExit(f"Settings need attention:\n  - -c 0 asks for the model's trained context, and {path.name} "
                         "does not say it (no <architecture>.context_length): give -c N")
    return int(value)


def settings_for_model(command: str, args) -> Settings:
    """The settings of a command that looks at serve's model (explain, namespace, bench, demo): the environment,
    serve's model flags given to it (kvbridge.settings.flags.MODEL_COMMANDS), then --engine, --chunk-size and
    --n-predict; checked, a problem a flag caused naming the flag."""
    settings = Settings.from_env()
    given = vars(args)
    settings = settings.replace(**overrides(command, given, settings))
    settings = settings.replace(**{name: given[name] for name in ("engine", "chunk_size", "n_predict")
                                   if given.get(name) is not None})
    flagged, others = blame(command, given, settings.validate())
    if flagged or others:
        raise SystemExit("Settings need attention:\n  - " + "\n  - ".join(flagged + others))
    return settings


def add_model_options(parser: argparse.ArgumentParser, command: str) -> None:
    """--engine and --chunk-size, and serve's model flags as `command` takes them (add_flags)."""
    add_engine_options(parser)
    add_flags(parser, command)


def settings_from(args) -> Settings:
    """Settings.from_env() with the command line's --engine, --chunk-size and --n-predict over them, checked."""
    settings = Settings.from_env()
    overrides = {}
    for name in ("engine", "chunk_size", "n_predict"):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    if overrides:
        settings = dataclasses.replace(settings, **overrides)
    return checked(settings)


def make_engine(settings: Settings, l2_dir: str | None = None):
    """A CachedEngine on the configured backend; with l2_dir, its L2 there instead of KVB_L2_DIR."""
    from kvbridge.backends import make_backend
    from kvbridge.engine.cached_engine import CachedEngine

    if l2_dir is not None:
        settings = dataclasses.replace(settings, l2_dir=l2_dir)
    return CachedEngine(settings, make_backend(settings.engine, settings))


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", help="engine key or alias (default: KVB_ENGINE)")
    parser.add_argument("--chunk-size", dest="chunk_size", type=int, help="tokens per chunk (default: KVB_CHUNK_SIZE)")


def progress(done: int, total: int, what: str) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what[:60]:60}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()
