"""The one argument parser of every KVBridge command line: a flag is a spelling defined exactly, or refused.

argparse guesses by default: `--api-key X` is read as `--api-key-file X` (the unique flag it begins), `-n 32`
as `-np 32`, `-mg 0` as `-m g` and then `0`. `allow_abbrev=False` stops the first only: on Python 3.11 a
single-dash word still matches any flag it begins, and a short flag still swallows the letters after it. A
command line that mirrors llama-server's meets exactly the spellings llama-server has and KVBridge does not
(`-n`, `-ngl`, `--api-key`), so here nothing is guessed: a word that is no defined spelling (or
`SPELLING=VALUE`) is refused, by name.

And nothing a parser prints shows a secret (kvbridge.settings.redact): a refusal names each unknown flag and
never the words after it, says what to use instead where the flag is one of llama-server's that KVBridge
refuses on purpose (kvbridge.settings.flags.REFUSED), and any message that would quote the value given to a
flag whose name says key, token, secret or password has that value replaced.

Deliberately left out: `-c4096` (a short flag with its value run together) is refused like any other unknown
word; `-c 4096` and `-c=4096` are the spellings.
"""
from __future__ import annotations

import argparse
import sys

from kvbridge.settings.redact import scrub, secret_words


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser with exact spellings only and no secret in its messages. Subparsers made by
    add_subparsers() are of this class too (argparse makes them of the parent's class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self._secret_words: list[str] = []

    def _get_option_tuples(self, option_string: str) -> list:
        # argparse asks this only of a word that is no defined spelling (nor SPELLING=VALUE), for the flags it
        # might abbreviate or run into its value; every such guess reads one flag as another, so there is none
        return []

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        self._secret_words = secret_words(args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._chosen(namespace)
            parser.error(unknown_message(extras, parser))
        return namespace

    def error(self, message: str):
        super().error(scrub(message, self._secret_words))

    def _chosen(self, namespace) -> "Parser":
        """The subparser the command line chose (the deepest), whose flags and usage a refusal speaks of."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(namespace, action.dest, None) or "")
                if isinstance(chosen, Parser):
                    chosen._secret_words = self._secret_words
                    return chosen._chosen(namespace)
        return self


def unknown_message(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """The refusal of what no flag took: each unknown flag by name (never what follows it, nor what follows `=`),
    why and what instead where flags.REFUSED knows it; the other words counted, not shown."""
    from kvbridge.settings.flags import REFUSED   # here: flags imports Settings, which a bare parser needs not

    flags = [word.partition("=")[0] for word in extras if word.startswith("-") and len(word) > 1]
    lines = []
    for flag in dict.fromkeys(flags):
        if flag in REFUSED:
            lines.append(f"{flag} is refused: {REFUSED[flag]}")
            continue
        near = [s for s in parser._option_string_actions if s != flag and (s.startswith(flag) or flag.startswith(s))]
        other = "is another flag" if len(near) == 1 else "are other flags"
        also = f" ({', '.join(sorted(near))} {other})" if near else ""
        lines.append(f"unknown flag {flag}{also}; flags are spelled in full, as `{parser.prog} --help` lists them")
    others = len(extras) - len(flags)
    if others:
        words = f"{others} {'more ' if flags else ''}word{'s' if others > 1 else ''} that no flag takes"
        lines.append(f"{words}, not shown in case {'it is' if others == 1 else 'one is'} a secret"
                     + ("" if flags else f"; `{parser.prog} --help` lists what it takes"))
    return "; ".join(lines)
