"""`kvbridge gui`: the Gradio testbed (what ./scripts/start.sh runs).

Its flags mirror llama-server's where the meaning is the same (kvbridge.settings.flags): `-m`, `-c`, `-t`,
`-np` (the lab tab's scheduler and --serve's), `--host`/`--port` (the GUI's own, KVB_HOST/KVB_PORT), `-ctk`/`-ctv`.
A flag's bad value stops the start; the other settings' problems the GUI shows, to be fixed in its Engine panel.
"""
from __future__ import annotations

from kvbridge.cli.command import Command
from kvbridge.cli.common import add_flags, settings_with_flags
from kvbridge.settings.flags import GUI


def add_arguments(p) -> None:
    add_flags(p, GUI)
    p.add_argument("--serve", action="store_true",
                   help="also run the OpenAI-compatible endpoint on KVB_SERVE_PORT; the lab tab shows its requests")


def run(args) -> int:
    settings = settings_with_flags(GUI, args, strict=False)   # before the GUI's import: a bad flag answers at once
    from kvbridge.gui.app import main as app_main

    return app_main(settings, serve=args.serve) or 0


COMMAND = Command("gui", "serve the Gradio testbed on KVB_HOST:KVB_PORT (what ./scripts/start.sh runs)",
                  run, add_arguments, own_sigterm=True)
