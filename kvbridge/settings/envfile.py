"""The `.env` writer: set KVB_ settings in a `.env` file in place, and never write a secret there.

The last step of the settings flow (`.env` + environment -> Settings -> validate -> GUI Save ->
here): the GUI turns Settings into text with `kvbridge.settings.settings_to_env()` and hands it to
`update_env_file()`, which keeps comments, order and other keys and replaces the file atomically.
Secret detection (`looks_like_secret`, `is_variable_name`) lives here because keeping keys off
disk is this module's promise; validation and the cloud engine use the same tests. A leaf module:
it imports nothing from the rest of KVBridge but its errors, so config.py can re-export it.
"""
from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from kvbridge.errors import BadSettings

_SECRET_NAME_SUFFIXES = ("_API_KEY", "_KEY", "_TOKEN", "_SECRET", "_PASSWORD")
_NOT_SECRET_NAMES = frozenset({"KVB_CLOUD_API_KEY_ENV", "KVB_CLOUD_TOKEN_BUDGET"})
_SECRET_VALUE_RE = re.compile(
    r"\bsk-[A-Za-z0-9_-]{8,}|\bsk_(?:live|test)_\w{8,}|\bgsk_\w{8,}|(?i:\bbearer\s+\S)|\bhf_[A-Za-z0-9]{16,}"
    r"|\bxai-[A-Za-z0-9]{16,}|\bgh[pousr]_[A-Za-z0-9]{16,}|\bgithub_pat_\w{16,}|\bAKIA[0-9A-Z]{16}\b|\bAIza[\w-]{30,}"
)
_VARIABLE_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENV_NAME_RE = re.compile(r"KVB_[A-Z0-9_]+")
_ASSIGNMENT_RE = re.compile(
    r"(?P<lead>[ \t]*(?:export[ \t]+)?)(?P<key>[A-Za-z_][A-Za-z0-9_.]*)[ \t]*=[ \t]*"
    r"""(?P<value>'(?:\\.|[^'\\])*'|"(?:\\.|[^"\\])*"|[^\r\n]*?)(?P<comment>[ \t]+#[^\r\n]*)?[ \t]*(?P<eol>\r?\n)?"""
)
_BARE_VALUE_RE = re.compile(r"[\w./:@,+~%-]*")


def looks_like_secret(value: str) -> bool:
    """True for text shaped like an API key or a bearer token (sk-..., gsk_..., 'Bearer ...')."""
    return bool(_SECRET_VALUE_RE.search(value))


def is_variable_name(text: str) -> bool:
    """True when `text` can name an environment variable (what KVB_CLOUD_API_KEY_ENV must hold)."""
    return bool(_VARIABLE_NAME_RE.fullmatch(text))


def update_env_file(path: str | Path, changes: Mapping[str, str]) -> None:
    """Set the given KVB_ keys in a .env file, keeping comments, blank lines, order and other keys.

    Keys not present are appended; the file is created if missing and replaced atomically.
    Raises BadSettings for anything that is not a KVB_ setting or looks like an API key.
    """
    for key, value in changes.items():
        _refuse_unsafe(key, value)
    path = Path(os.path.realpath(Path(path).expanduser()))  # write through a symlinked .env
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.exists() else []
    except (OSError, UnicodeDecodeError) as error:
        raise BadSettings(f"cannot read {path}: {error}") from error
    pending = dict(changes)
    out = []
    for line in lines:
        match = _ASSIGNMENT_RE.fullmatch(line)
        if match and match["key"] in changes:
            key = match["key"]
            out.append(f"{match['lead']}{key}={_quote(changes[key])}{match['comment'] or ''}{match['eol'] or ''}")
            pending.pop(key, None)
        else:
            out.append(line)
    if out and not out[-1].endswith("\n"):
        out[-1] += "\n"
    out += [f"{key}={_quote(value)}\n" for key, value in pending.items()]
    _atomic_write(path, "".join(out))


def _refuse_unsafe(key: str, value: str) -> None:
    if not isinstance(key, str) or not _ENV_NAME_RE.fullmatch(key):
        raise BadSettings(f"refusing to write {key!r} to .env: only KVB_ settings are written there")
    if key not in _NOT_SECRET_NAMES and key.endswith(_SECRET_NAME_SUFFIXES):
        raise BadSettings(f"refusing to write {key} to .env: API keys stay in your shell; set "
                          "KVB_CLOUD_API_KEY_ENV to the NAME of the variable that holds the key")
    if not isinstance(value, str):
        raise BadSettings(f"{key}: the value must be text, got {type(value).__name__}")
    if looks_like_secret(value) or (key == "KVB_CLOUD_API_KEY_ENV" and value and not is_variable_name(value)):
        raise BadSettings(f"refusing to write {key}: the value looks like an API key or token; keys stay in your "
                          "shell and KVB_CLOUD_API_KEY_ENV holds only the variable's NAME")
    if "\n" in value or "\r" in value:
        raise BadSettings(f"{key}: the value must be a single line")


def _quote(value: str) -> str:
    """Bare when safe, else single quotes (python-dotenv unescapes \\\\ and \\' inside them)."""
    if _BARE_VALUE_RE.fullmatch(value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _atomic_write(path: Path, text: str) -> None:
    """Temp file in the same folder, fsync, rename: a reader sees the old file or the new one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o600
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise BadSettings(f"cannot write {path}: {error.strerror or error}") from error
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as error:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise BadSettings(f"cannot write {path}: {error.strerror or error}") from error
