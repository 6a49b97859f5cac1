"""What a command is: its name, its help, the arguments it adds to its own parser, and its body."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    pass


@dataclass(frozen=True)
class Command:
    name: str
    help: str                                              # the one line of `--help` and the command's description
    run: Callable[[argparse.Namespace], int]               # the body: returns the exit code
    add_arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments
    own_sigterm: bool = False                              # installs its own SIGTERM handler (a server)
