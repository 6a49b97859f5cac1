"""Secrets read from a variable a setting *names* (KVB_SERVE_API_KEY_ENV, KVB_SERVE_ADMIN_KEY_ENV, ...), or from
a key file a setting names (KVB_SERVE_API_KEY_FILE, serve's --api-key-file).

Settings and `.env` hold only the name of the variable or the file's path; the secret itself is read here,
from the process environment or the file, when the part that needs it starts. One home, so every such
setting refuses an empty variable with the same message naming both the setting and the variable (the variable
only when shaped like a variable's name: kvbridge.settings.redact), and a key file is held to ssh's rule for
private keys: yours, and no one else may read or write it, judged on the file opened (a systemd credential too).
No message here ever holds a secret's text, nor the name of a key file that does not exist.
"""
from __future__ import annotations

import os
import shlex
import stat
from pathlib import Path
from typing import Mapping

from kvbridge.errors import BadSettings
from kvbridge.settings.redact import may_show, shown


def secret_from(setting: str, variable: str, environ: Mapping[str, str] | None = None, *,
                unset_hint: str = "") -> str:
    """The value of `variable` (named by the setting `setting`); '' when `variable` is empty (no secret
    asked for). BadSettings naming both when the variable is unset or empty; `unset_hint` says how to
    need no secret instead."""
    if not variable:
        return ""
    value = (os.environ if environ is None else environ).get(variable, "")
    if not value:
        hint = f" or {unset_hint}" if unset_hint else ""
        if may_show(setting, variable):
            raise BadSettings(f"{setting} names {variable}, but that variable is empty or not set; set it "
                              f"(export {variable}=...){hint}")
        raise BadSettings(f"{setting} names a variable that is empty or not set (its name is not shown: it is not "
                          f"shaped like one, and may be the secret itself); put the variable's NAME in {setting} "
                          f"and the secret in that variable{hint}")
    return value


def _systemd_credential(path: str, status: os.stat_result) -> bool:
    """The file with `status` (the opened file's fstat) is a credential systemd placed for this service
    (LoadCredential=, deploy/systemd/): an entry of the directory $CREDENTIALS_DIRECTORY names. systemd makes that
    copy readable by the service alone, often owned by root with an ACL for the service's user, so its owner and
    mode bits say nothing about who can read it.

    Decided by the file itself, not by its name: `path` only says which entry of the directory to compare, and
    the entry must be the very file opened (same device and inode, the entry not a link). Resolving the name
    alone would let whoever can write the folder `path` lies in open one file and then point the name into the
    credentials directory before it is looked at."""
    directory = os.environ.get("CREDENTIALS_DIRECTORY", "")   # set by systemd for the service, not a setting
    if not directory:
        return False
    credentials = Path(directory).resolve()
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_relative_to(credentials):
        return False
    try:
        entry = os.lstat(resolved)
    except OSError:
        return False
    return stat.S_ISREG(entry.st_mode) and (entry.st_dev, entry.st_ino) == (status.st_dev, status.st_ino)


def _status_problem(setting: str, path: str, status: os.stat_result) -> str | None:
    """Why a key file with this status cannot hold a secret: not a file, someone else's, open to others."""
    chmod = f"chmod 600 {shlex.quote(path)}"
    if not stat.S_ISREG(status.st_mode):
        return f"{setting}={path} is not a file; point it at a file holding the key alone"
    if _systemd_credential(path, status):
        return None
    if status.st_uid != os.getuid():
        return (f"{setting}={path} belongs to another user (uid {status.st_uid}, you are {os.getuid()}); a key "
                f"file must be yours: copy the key into a file of your own, then {chmod}")
    if status.st_mode & 0o077:
        return (f"{setting}={path} is open to others (mode {stat.S_IMODE(status.st_mode):04o}): anyone who can "
                f"read it has the key. Make it yours alone: {chmod}")
    return None


def key_file_problem(setting: str, path: str) -> str | None:
    """Why the key file `setting` names cannot be used (missing, not a file, someone else's, readable or writable
    by others), else None. Looks at the file's status only, never at its content (what validate() runs)."""
    try:
        status = Path(path).expanduser().stat()
    except FileNotFoundError:   # no file: its name is not shown, in case the key itself was typed where it goes
        return (f"{setting} names a file that does not exist (the name is not shown: it may be the key itself); "
                "write the key into a file of yours (one line), chmod 600 it, and name that file")
    except OSError as error:
        return f"{setting}={shown(setting, path)} cannot be read: {error.strerror or error}"
    return _status_problem(setting, path, status)


def secret_from_file(setting: str, path: str, *, per_line: bool = False) -> str:
    """The key in the file `setting` names: checked as key_file_problem() does on the open file, read once,
    surrounding whitespace stripped. BadSettings naming the setting and the file (never the key) when the file
    is unusable, empty, or holds more than one word. `per_line`: llama-server's --api-key-file, a key a line and
    `#` lines comments: the keys, one a line (a line of more than one word is still refused)."""
    try:
        fd = os.open(Path(path).expanduser(), os.O_RDONLY | os.O_NONBLOCK)   # a FIFO must not hang the start
    except OSError as error:
        raise BadSettings(key_file_problem(setting, path) or f"{setting}={shown(setting, path)} cannot be read: "
                                                             f"{error.strerror or error}") from None
    with os.fdopen(fd, "rb") as handle:
        problem = _status_problem(setting, path, os.fstat(handle.fileno()))   # the file read, not the name's
        if problem:
            raise BadSettings(problem)
        data = handle.read(64 << 10)
    try:
        key = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise BadSettings(f"{setting}={path} is not text; write the key into it as one line") from None
    if per_line:
        key = "\n".join(line.strip() for line in key.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    if not key:
        raise BadSettings(f"{setting}={path} is empty; write the key clients must send into it (one line)")
    if per_line and all(len(line.split()) == 1 for line in key.splitlines()):
        return key
    if len(key.split()) != 1:
        raise BadSettings(f"{setting}={path} holds more than one word or line; a key file holds the key alone")
    return key
