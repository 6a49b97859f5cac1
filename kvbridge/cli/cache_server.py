"""`kvbridge cache-server`: the cache server that engines share when KVB_STORE_URL points at it.

Where it listens: --url (tcp://HOST:PORT or ipc:///path), or llama-server's --host/--port, which make
KVB_CACHE_SERVER_URL tcp://HOST:PORT (kvbridge.settings.flags); not both. It runs no model, so it takes no
model flags.
"""
from __future__ import annotations

from kvbridge.cli.command import Command
from kvbridge.cli.common import add_flags, settings_with_flags
from kvbridge.settings.flags import CACHE_SERVER


def add_arguments(p) -> None:
    p.add_argument("--url", help="where to listen: tcp://HOST:PORT or ipc:///path "
                                 "(default: KVB_CACHE_SERVER_URL, else tcp://127.0.0.1:5555); not with --host/--port")
    add_flags(p, CACHE_SERVER)
    p.add_argument("--server-module", action="append", metavar="JSON",
                   help='a module to load: {"module_path": "pkg.mod", "config": {...}} or a JSON list of them; '
                        "repeatable; after those in KVB_CACHE_SERVER_MODULES")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus text on 127.0.0.1:PORT/metrics (default: KVB_CACHE_SERVER_METRICS_PORT)")


def run(args) -> int:
    from kvbridge.cache_server.cli import run as run_server

    if args.url is not None and (args.host is not None or args.port is not None):
        raise SystemExit(f"cache-server: --url {args.url} names the whole address; give it or --host/--port "
                         "(which make tcp://HOST:PORT), not both")
    settings = settings_with_flags(CACHE_SERVER, args)
    return run_server(settings, args.url, args.server_module or [], args.metrics_port)


COMMAND = Command(
    "cache-server",
    "run the cache server (ZMQ + shared memory) that engines share when KVB_STORE_URL points at it",
    run, add_arguments, own_sigterm=True)
