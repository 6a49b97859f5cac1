"""What several commands share: settings from the environment with the command's overrides, an engine
on those settings, the engine options, and a progress bar on stderr."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from kvbridge.settings import Settings


def checked(settings: Settings) -> Settings:
    """The settings as they are, or SystemExit listing what needs attention."""
    problems = settings.validate()
    if problems:
        raise SystemExit("Settings need attention:\n  - " + "\n  - ".join(problems))
    return settings


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
