"""`kvbridge serve`: the OpenAI-compatible endpoint with KVBridge's cache behind it.

Its --engine offers only what serve can run (SERVE_ENGINES); a shadow engine holds no KV of ours to
serve from, and is told so by argparse (exit 2) before anything loads.
"""
from __future__ import annotations

import argparse

from kvbridge.cli.command import Command
from kvbridge.cli.common import checked
from kvbridge.settings import Settings
from kvbridge.settings.checks import SERVE_ENGINES


def serve_engine_choice(value: str) -> str:
    """--engine of serve: one it can run, else argparse's error (exit 2) saying why and what to use."""
    if value in SERVE_ENGINES:
        return value
    from kvbridge.backends import engine_specs

    use = " or ".join(f"--engine {key}" for key in SERVE_ENGINES)
    shadow = {name for spec in engine_specs() if spec.cls.kv_mode == "shadow" for name in (spec.key, *spec.aliases)}
    if value in shadow:
        raise argparse.ArgumentTypeError(f"{value!r} is a shadow engine: it holds no KV of KVBridge's to serve from; "
                                         f"use {use}")
    raise argparse.ArgumentTypeError(f"{value!r} is not an engine serve can run; use {use}")


def add_arguments(p) -> None:
    p.add_argument("--host", help="address to listen on (default: KVB_SERVE_HOST, else 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default: KVB_SERVE_PORT, else 8000)")
    p.add_argument("--engine", type=serve_engine_choice, metavar="{" + ",".join(SERVE_ENGINES) + "}",
                   help="scheduler: in-process, many requests at once (default: KVB_SERVE_ENGINE); "
                        "llama-server: CachedEngine in lmcache mode, requests queued")


def run(args) -> int:
    from kvbridge.serve.server import run as run_server

    settings = checked(Settings.from_env())
    return run_server(settings, args.host, args.port, args.engine)


COMMAND = Command(
    "serve",
    "an OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions) with KVBridge's cache behind it",
    run, add_arguments, own_sigterm=True)
