"""Who may connect: only the OS user who started the cache server, unless a shared secret says otherwise.

By default (no KVB_CACHE_SERVER_TOKEN_ENV) the server makes a random token at start and writes it to a
file only its user can read (`token_file`: mode 0600 in a 0700 folder under ~/.cache/kvbridge/run),
as Jupyter does; that user's clients find it there by the server's address, with no configuration,
and another account cannot read it. The file is removed when the server stops. A configured secret
(read from the variable KVB_CACHE_SERVER_TOKEN_ENV names) is used instead and is never written
anywhere. The secret never crosses the wire in clear: a client's CURVE key pair is derived from it,
and the server admits only that key in the handshake (kvbridge.cache_server.curve, which also says
how the client authenticates the server); the hello, encrypted, carries it once more.

The files are named by the server's address (`endpoint_name`): a canonical host and the port, so that
127.0.0.1, localhost and ::1 meet while servers on 127.0.0.1:P and 127.0.0.2:P keep apart.

A client reads these files only when its own uid owns them, no one else can read or write them, and
they are not symbolic links (`read_private_file`): a file another account planted is never trusted,
and a token file that fails the check is refused naming the file and the fix (UntrustedTokenFile),
never sent on as a wrong token.

Binding: with CURVE on every connection the server may listen on any address (encrypted, and only
holders of the secret get past the handshake). Sockets without CURVE (a plugin's event stream) stay
on loopback or ipc://.
"""
from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
from pathlib import Path

from kvbridge.cache_server.connection import CacheServerRefused
from kvbridge.errors import BadSettings
from kvbridge.settings import Settings
from kvbridge.settings.checks import is_loopback_host
from kvbridge.settings.secrets import secret_from


REFUSED_TOKEN = ("the cache server refused the connection: wrong or missing token. By default only the OS user who "
                 "started the server can use it (its token is in that user's ~/.cache/kvbridge/run); with a shared "
                 "secret, set the variable KVB_CACHE_SERVER_TOKEN_ENV names to it")


class UntrustedFile(Exception):
    """A credential file this user must not trust (another owner, readable by others, a link); says which and why."""


def check_bind_url(url: str, token: str = "", *, encrypted: bool = False) -> None:
    """Refuse an address this socket must not listen on (BadSettings, saying why and what to bind instead).

    `encrypted`: the socket runs CURVE (the cache server's ROUTER) and may listen beyond loopback;
    a socket in clear may not, token or not.
    """
    scheme, _, rest = url.partition("://")
    if scheme == "ipc":
        return
    if scheme != "tcp" or ":" not in rest:
        raise BadSettings(f"--url {url!r}: the cache server listens on tcp://HOST:PORT or ipc:///path")
    host = rest.rpartition(":")[0].strip("[]")
    if not encrypted and not is_loopback_host(host):
        raise BadSettings(
            f"refusing to listen on {url}: this socket is not encrypted, so beyond this machine every host that can "
            "reach it would see its traffic in clear, with or without a token; bind tcp://127.0.0.1:PORT or "
            "ipc:///path")


def read_token(settings: Settings, environ=None) -> str:
    """The shared secret from the variable KVB_CACHE_SERVER_TOKEN_ENV names ('' when none is configured)."""
    return secret_from("KVB_CACHE_SERVER_TOKEN_ENV", settings.cache_server_token_env, environ,
                       unset_hint="leave KVB_CACHE_SERVER_TOKEN_ENV empty for the owner-only token file")


def token_dir() -> Path:
    """This user's folder of cache-server tokens and keys (created mode 0700 by the server)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(cache) / "kvbridge" / "run"


LOOPBACK_NAME = "loopback"
# The names under which a client reaches the one server listening on this host's loopback: a server bound on a
# wildcard address serves them too (and Linux refuses a second listener on 127.0.0.1:P beside one on 0.0.0.0:P).
_SAME_AS_LOOPBACK = {"127.0.0.1", "localhost", "::1", "ip6-localhost", "*", "0.0.0.0", "::"}


def endpoint_name(url: str) -> str:
    """The file name stem of the server at `url`: a canonical host and the port for TCP (127.0.0.1, localhost,
    ::1 and wildcard binds are one name, so they meet; 127.0.0.2 or a LAN address keeps its own, so two
    servers on one port of different addresses never share files), the socket's resolved path for ipc://."""
    scheme, _, rest = url.partition("://")
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        host = host.strip("[]").lower()
        host = LOOPBACK_NAME if host in _SAME_AS_LOOPBACK else re.sub(r"[^a-z0-9.-]", "_", host)
        return f"tcp-{host}-{port}"
    return f"ipc-{hashlib.blake2b(str(Path(rest).resolve()).encode(), digest_size=8).hexdigest()}"


def token_file(url: str) -> Path:
    """Where the server at `url` keeps its generated token (named by `endpoint_name`)."""
    return token_dir() / f"cache-server-{endpoint_name(url)}.token"


def files_url(url: str) -> str:
    """Whose files a client of `url` reads: `url`'s own when its server wrote them, else, for TCP, those of the
    server on this host's loopback at that port (a server bound on a wildcard address, reached by another of this
    host's addresses: 127.0.0.2, a LAN address). A key that belongs to another server only fails the handshake."""
    scheme, _, rest = url.partition("://")
    if scheme != "tcp" or (token_dir() / f"cache-server-{endpoint_name(url)}.key").exists():
        return url
    return f"tcp://127.0.0.1:{rest.rpartition(':')[2]}"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def write_private_file(path: Path, text: str) -> None:
    """Write `text` where only this user can read it (0600 in a 0700 folder), replacing the file atomically."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_token_file(url: str, token: str) -> Path:
    """Write the server's token for `url` where only this user can read it; its path."""
    path = token_file(url)
    write_private_file(path, token)
    return path


def read_private_file(path: Path) -> str | None:
    """The file's text when this user owns it and no one else can read or write it; None when it does not
    exist; UntrustedFile (saying why) for a link, another owner, loose permissions or not a file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if os.path.islink(path):
            raise UntrustedFile(f"{path} is a symbolic link") from None
        raise UntrustedFile(f"{path} cannot be read: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedFile(f"{path} is not a regular file")
        if st.st_uid != os.getuid():
            raise UntrustedFile(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise UntrustedFile(f"{path} has mode {st.st_mode & 0o777:04o}, so other accounts may read or write it; "
                                f"only its owner may: run chmod 600 {path} (or restart the server that writes it)")
        return os.read(fd, 1 << 16).decode(errors="replace")
    finally:
        os.close(fd)


class UntrustedTokenFile(CacheServerRefused):
    """The server's token file is there but this user must not trust it (loose mode, another owner, a link)."""


def client_token(url: str, configured: str = "") -> str:
    """What a client proves itself with: the configured secret, else the token file of the server at `url`
    ('' when there is none: the server will refuse, saying so). A token file this user must not trust is
    refused naming the file and what is wrong with it (UntrustedTokenFile), never sent as a wrong token."""
    if configured:
        return configured
    path = token_file(files_url(url))
    try:
        return (read_private_file(path) or "").strip()
    except UntrustedFile as exc:
        raise UntrustedTokenFile(f"not using the cache server token file for {url}: {exc}") from None
