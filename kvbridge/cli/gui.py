"""`kvbridge gui`: the Gradio testbed (what ./scripts/start.sh runs)."""
from __future__ import annotations

from kvbridge.cli.command import Command


def add_arguments(p) -> None:
    p.add_argument("--serve", action="store_true",
                   help="also run the OpenAI-compatible endpoint on KVB_SERVE_PORT; the lab tab shows its requests")


def run(args) -> int:
    from kvbridge.gui.app import main as app_main

    return app_main(serve=args.serve) or 0


COMMAND = Command("gui", "serve the Gradio testbed on KVB_HOST:KVB_PORT (what ./scripts/start.sh runs)",
                  run, add_arguments, own_sigterm=True)
