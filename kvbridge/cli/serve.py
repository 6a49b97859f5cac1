"""`kvbridge serve`: the OpenAI-compatible endpoint with KVBridge's cache behind it.

Its flags mirror llama-server's (`kvbridge serve -m model.gguf -c 4096 -np 4 --port 8080`; the table is
kvbridge.settings.flags), each a KVB_ variable the flag wins over. Its --engine offers only what serve can run
(SERVE_ENGINES); a shadow engine holds no KV of ours to serve from, and is told so by argparse (exit 2)
before anything loads.
"""
from __future__ import annotations

import argparse

from kvbridge.cli.command import Command
from kvbridge.cli.common import add_flags, settings_with_flags
from kvbridge.settings.checks import SERVE_ENGINES
from kvbridge.settings.flags import SERVE


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


class _Version(argparse.Action):
    """--version, as llama-server's: KVBridge's version and the llama.cpp it runs (llama-cpp-python's release), exit 0.
    Read when asked, so building the parser loads no llama.cpp."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_text())
        parser.exit()


def version_text() -> str:
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"
    return f"kvbridge {of('kvbridge')}\nllama.cpp: llama-cpp-python {of('llama_cpp_python')}"


def add_arguments(p) -> None:
    add_flags(p, SERVE)
    p.add_argument("--version", action=_Version, help="print KVBridge's version and the llama.cpp release it runs, "
                                                       "then exit")
    p.add_argument("--engine", type=serve_engine_choice, metavar="{" + ",".join(SERVE_ENGINES) + "}",
                   help="scheduler: in-process, many requests at once (default: KVB_SERVE_ENGINE); "
                        "llama-server: CachedEngine in lmcache mode, requests queued")


def run(args) -> int:
    from kvbridge.serve.server import run as run_server

    # --port 0: a free port, named on the ready line (how kvbridge.fleet starts its workers); it is no value for
    # KVB_SERVE_PORT, so it goes to the server beside the settings rather than into them
    free_port = args.port == 0
    settings = settings_with_flags(SERVE, args, leave_out=("port",) if free_port else ())
    return run_server(settings, None, 0 if free_port else None, args.engine)


COMMAND = Command(
    "serve",
    "an OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions) with KVBridge's cache behind it",
    run, add_arguments, own_sigterm=True)
