"""`kvbridge fleet`: N serve workers behind vllm-router on this host, until SIGTERM or Ctrl-C.

The flags default to KVB_FLEET_WORKERS, KVB_FLEET_POLICY, KVB_FLEET_PORT and KVB_SCHED_EXACT (--exact/--no-exact:
the workers' exact mode, on by default). A stop signal (SIGTERM,
SIGINT or SIGHUP, at any moment: while children start too) stops the router, the workers and the cache
server, in that order, and the exit status is 0; later stop signals are ignored so that nothing cuts the
stop short. A child that dies while the fleet runs stops the rest and exits 1.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time

from kvbridge.cli.command import Command
from kvbridge.cli.common import checked
from kvbridge.fleet.children import STOP_SIGNALS
from kvbridge.settings import Settings
from kvbridge.settings.checks import FLEET_POLICIES


class _Stopped(Exception):
    """A stop signal arrived."""


def add_arguments(p) -> None:
    p.add_argument("--workers", type=int, help="serve workers to start (default: KVB_FLEET_WORKERS, else 3)")
    p.add_argument("--policy", choices=FLEET_POLICIES, help="the router's policy (default: KVB_FLEET_POLICY, "
                                                           "else kv_aware)")
    p.add_argument("--port", type=int, help="the router's port on 127.0.0.1 (default: KVB_FLEET_PORT, else 8000; "
                                            "0: any free port)")
    p.add_argument("--pd", action="store_true", help="prefill/decode: worker-1 prefills and stores, the others "
                                                     "restore and decode")
    p.add_argument("--no-shared-cache", dest="shared_cache", action="store_false",
                   help="no cache server: each worker keeps its own store (L3 from KVB_L3_URL still shared)")
    p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=None,
                   help="every answer equals the same request run alone (default: KVB_SCHED_EXACT, else on); "
                        "--no-exact: the mode off, for throughput")
    p.add_argument("--router-log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="vllm-router's --log-level (its log: KVB_OUTPUT_DIR/fleet/.../router.log)")


def _raise_stopped(signum, frame) -> None:
    """The first stop signal stops the fleet; the ones after it are ignored, so that the stop completes."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise _Stopped()


def run(args) -> int:
    from kvbridge.fleet import Fleet

    settings = Settings.from_env()
    settings = checked(settings if args.exact is None else settings.replace(sched_exact=args.exact))
    fleet = Fleet(settings, workers=settings.fleet_workers if args.workers is None else args.workers,
                  policy=args.policy or settings.fleet_policy,
                  port=settings.fleet_port if args.port is None else args.port,
                  shared_cache=args.shared_cache, pd=args.pd, router_log_level=args.router_log_level)
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
    status = 0
    try:
        fleet.start()
        for line in fleet.describe():
            print(f"  {line}", flush=True)
        status = _watch(fleet)
    except _Stopped:
        pass
    finally:
        for sig in previous:             # a second Ctrl-C must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        fleet.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("fleet stopped.", flush=True)
    return status


def _watch(fleet) -> int:
    """Until a stop signal (raised as _Stopped): 1 once a child has died on its own."""
    while True:
        time.sleep(1)
        gone = fleet.exited()
        if gone:
            time.sleep(2)                # a signal to the whole group reaches the children first
            print(f"fleet: {', '.join(gone)} exited; stopping the rest", file=sys.stderr, flush=True)
            return 1


COMMAND = Command(
    "fleet",
    "several serve workers behind vllm-router (round_robin, cache_aware, kv_aware by KV events), one cache server",
    run, add_arguments, own_sigterm=True)
