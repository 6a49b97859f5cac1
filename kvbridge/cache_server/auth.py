"""Who may connect: only the OS user who started the cache server, unless a shared secret says otherwise.

By default (no KVB_CACHE_SERVER_TOKEN_ENV) the server makes a random token at start and writes it to a
file only its user can read (`token_file`: mode 0600 in a 0700 folder under ~/.cache/kvbridge/run),
as Jupyter does; that user's clients find it there by the server's address, with no configuration,
and another account cannot read it, so its hello is refused. The file is removed when the server
stops. A configured secret (read from the variable KVB_CACHE_SERVER_TOKEN_ENV names) is used instead
and is never written anywhere. Either way the secret travels only in a client's hello.

Binding: loopback TCP or an ipc:// socket (mode 0600). Beyond loopback the traffic would cross the
network in clear (no encryption is implemented yet), so such a bind is refused, token or not.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import stat
from pathlib import Path

from kvbridge.errors import BadSettings
from kvbridge.settings import Settings
from kvbridge.settings.checks import is_loopback_host


def check_bind_url(url: str, token: str = "") -> None:
    """Refuse to listen beyond this machine (BadSettings, saying why and what to bind instead)."""
    scheme, _, rest = url.partition("://")
    if scheme == "ipc":
        return
    if scheme != "tcp":
        raise BadSettings(f"--url {url!r}: the cache server listens on tcp://HOST:PORT or ipc:///path")
    host = rest.rpartition(":")[0].strip("[]")
    if not is_loopback_host(host):
        raise BadSettings(
            f"refusing to listen on {url}: beyond this machine every host that can reach it would see the KV "
            "(prompts) in clear, with or without a token; bind tcp://127.0.0.1:PORT or ipc:///path, and reach "
            "it from other hosts through an encrypted tunnel (ssh -L) if you must")


def read_token(settings: Settings, environ=None) -> str:
    """The shared secret from the variable KVB_CACHE_SERVER_TOKEN_ENV names ('' when none is configured)."""
    environ = os.environ if environ is None else environ
    name = settings.cache_server_token_env
    if not name:
        return ""
    token = environ.get(name, "")
    if not token:
        raise BadSettings(f"KVB_CACHE_SERVER_TOKEN_ENV names {name}, but {name} is not set or empty")
    return token


def token_dir() -> Path:
    """This user's folder of cache-server tokens (created mode 0700 by the server)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(cache) / "kvbridge" / "run"


def token_file(url: str) -> Path:
    """Where the server at `url` keeps its generated token: by port for TCP (loopback only, so
    127.0.0.1, localhost and ::1 name one server), by the socket's path for ipc://."""
    scheme, _, rest = url.partition("://")
    if scheme == "tcp":
        name = f"tcp-{rest.rpartition(':')[2]}"
    else:
        name = f"ipc-{hashlib.blake2b(str(Path(rest).resolve()).encode(), digest_size=8).hexdigest()}"
    return token_dir() / f"cache-server-{name}.token"


def write_token_file(url: str) -> tuple[str, Path]:
    """A new random token for the server at `url`, written where only this user can read it."""
    folder = token_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    token = secrets.token_urlsafe(32)
    path = token_file(url)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token, path


def client_token(url: str, configured: str = "") -> str:
    """What a client sends at hello: the configured secret, else the token file of the server at `url`
    when this user owns it and no one else can read it ('' otherwise: the server will refuse, saying so)."""
    if configured:
        return configured
    path = token_file(url)
    try:
        st = path.stat()
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            return ""
        return path.read_text().strip()
    except OSError:
        return ""
