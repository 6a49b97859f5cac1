"""`kvbridge` (the same as `python -m kvbridge`): parse the command line and run the chosen command.

The commands, each with its arguments and body, live in kvbridge.cli (the table: kvbridge.cli.commands);
this module only dispatches: logging (with a filter that keeps every secret out of it: kvbridge.settings.redact),
SIGTERM, the check that the command's extras are installed (before anything else: kvbridge.cli.extras), the
settings' warnings (unknown KVB_ names) once on stderr, and an error turned into `error: ...` and exit 2: a
KVBridgeError, or a ModuleNotFoundError for a module an extra brings, never a traceback.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

from kvbridge.cli.commands import BY_NAME, build_parser
from kvbridge.cli.extras import for_missing_module, missing_extras_message
from kvbridge.errors import KVBridgeError
from kvbridge.settings import Settings
from kvbridge.settings.redact import hidden_values, hide_in_logs, secret_words


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # no log line shows a secret: a secret-named setting's or flag's value, or a key a *_ENV setting names
    hide_in_logs(hidden_values(Settings.from_env(), os.environ) + secret_words(argv))
    if not args.command:
        parser.print_help()
        return 0
    missing = missing_extras_message(args.command, args)
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    for warning in Settings.from_env().warnings():   # said once, at start: an unknown KVB_ name blocks nothing
        print(f"warning: {warning}", file=sys.stderr)
    command = BY_NAME[args.command]
    if not command.own_sigterm:   # servers install their own; elsewhere SIGTERM must still run cleanup
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return command.run(args)
    except KVBridgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        message = for_missing_module(exc, args.command)
        if not message:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
