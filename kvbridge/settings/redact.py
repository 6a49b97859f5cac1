"""What a message may show of a value: one rule, keyed on the name of the flag or setting the value belongs to.

A flag or setting whose name says key, token, secret or password (`--api-key`, KVB_SERVE_API_KEY_ENV,
KVB_L3_PASSWORD_ENV, KVB_CACHE_SERVER_PUBLIC_KEY, ...) never has its value printed: not in a refusal of the
command line (kvbridge.settings.cmdline), not in Settings.validate()'s problems, not in a log line. Even a
setting meant to hold only a variable's *name* is covered, because the mistake the rule guards against is the
secret itself typed where the name belongs. Two values are shown, because the person must be told what to fix
and neither can be a secret typed in the wrong place: a key file's path once that file exists (an existing file
is a path), and the variable a `*_ENV` setting names when it is shaped like a conventional variable name
(capitals, digits and underscores, a capital first: SERVE_API_KEY), which no generated key or token is.

Log lines get the same rule through SecretFilter on the root logger's handlers (installed by kvbridge.__main__),
which also hides the secrets themselves: the values of the variables the `*_ENV` settings name.

Numbers are no secrets (KVB_CLOUD_TOKEN_BUDGET counts tokens), and `tokens` is not `token`: the rule reads whole
words, so `--max-tokens 12` is still shown.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Iterable, Mapping

SECRET_WORDS = frozenset({"key", "token", "secret", "password", "passwd", "apikey"})
HIDDEN = "(not shown)"


def secret_name(name: str) -> bool:
    """True when a flag's or setting's name says it holds a secret: a word of it is key, token, secret or
    password (words split at anything not a letter or digit: `--api-key-file`, `KVB_L3_PASSWORD_ENV`)."""
    return any(word in SECRET_WORDS for word in re.split(r"[^a-z0-9]+", name.lower()))


def may_show(name: str, value: object) -> bool:
    """Whether a message may show `value`, the value of the flag or setting `name`."""
    if not isinstance(value, str) or not secret_name(name):
        return True
    if is_file_name(name):
        return bool(value) and os.path.isfile(os.path.expanduser(value))
    return is_variable_setting(name) and bool(_CONVENTIONAL_VARIABLE.fullmatch(value))


_CONVENTIONAL_VARIABLE = re.compile(r"[A-Z][A-Z0-9_]*")


def is_variable_setting(name: str) -> bool:
    """A setting that holds a variable's NAME (KVB_SERVE_API_KEY_ENV, KVB_L3_PASSWORD_ENV)."""
    return name.lower().rstrip("_-").endswith("_env")


def is_file_name(name: str) -> bool:
    """A setting or flag that names a key *file* (KVB_SERVE_API_KEY_FILE, --api-key-file)."""
    return name.lower().rstrip("_-").endswith("file")


def shown(name: str, value: object) -> str:
    """`value` as a message may show it: itself, or HIDDEN."""
    return str(value) if may_show(name, value) else HIDDEN


def scrub(text: str, values: Iterable[str]) -> str:
    """`text` with every whole occurrence of each of `values` replaced by HIDDEN (longest first, so a value that
    holds another goes whole). Whole: not part of a longer run of letters and digits, so a one-letter secret does
    not eat every such letter of the message."""
    for value in sorted({v for v in values if v}, key=len, reverse=True):
        text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(value)}(?![A-Za-z0-9])", HIDDEN, text)
    return text


def secret_words(argv: Iterable[str]) -> list[str]:
    """The values a command line gives to secret-named flags, defined or not: the word after `--api-key`, the
    text after `--api-key=`. What a parser's messages must never show, whatever the parser made of them."""
    words = list(argv)
    found = []
    for i, word in enumerate(words):
        if not word.startswith("-") or word == "--":
            continue
        flag, equals, value = word.partition("=")
        if not secret_name(flag):
            continue
        if not equals:   # the next word, unless it is the next flag (`--api-key --port 8080`)
            value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("-") else ""
        if value and not may_show(flag, value):
            found.append(value)
    return found


def hidden_values(settings, environ: Mapping[str, str]) -> list[str]:
    """What no message or log line may show for these settings (a Settings, read as a dataclass to keep this
    module below kvbridge.settings.core): each secret-named value a message may not show, and each secret a
    `*_ENV` setting names (the key itself, read from `environ`)."""
    values = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if f.name.startswith("_") or not isinstance(value, str) or not value or not secret_name(f.name):
            continue
        if not may_show(f.name, value):
            values.append(value)
        if is_variable_setting(f.name) and environ.get(value):
            values.append(environ[value])
    return values


class SecretFilter(logging.Filter):
    """A handler's filter: every record it writes with each of `values` replaced by HIDDEN (scrub())."""

    def __init__(self, values: Iterable[str]) -> None:
        super().__init__()
        self.values = [value for value in values if value]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = scrub(message, self.values)
        if clean != message:
            record.msg, record.args = clean, ()
        return True


def hide_in_logs(values: Iterable[str], logger: logging.Logger | None = None) -> None:
    """Put a SecretFilter for `values` on every handler of `logger` (the root logger): what any module logs
    through them is scrubbed. Handlers added later (a web server's own) are not covered; they log no settings."""
    secret_filter = SecretFilter(values)
    for handler in (logger or logging.getLogger()).handlers:
        handler.addFilter(secret_filter)
