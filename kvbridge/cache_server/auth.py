"""Who may connect: the shared secret (read from the variable KVB_CACHE_SERVER_TOKEN_ENV names) and the bind rule.

The secret is never a setting's value, never logged and never sent anywhere but in a client's hello.
A server refuses to listen on anything but loopback (or an ipc:// socket, mode 0600) without one.
"""
from __future__ import annotations

import ipaddress
import os

from kvbridge.errors import BadSettings
from kvbridge.settings import Settings


def check_bind_url(url: str, token: str) -> None:
    """Refuse to listen beyond this machine without a shared secret (BadSettings, naming the settings)."""
    scheme, _, rest = url.partition("://")
    if scheme == "ipc":
        return
    if scheme != "tcp":
        raise BadSettings(f"--url {url!r}: the cache server listens on tcp://HOST:PORT or ipc:///path")
    host = rest.rpartition(":")[0].strip("[]")
    loopback = host == "localhost"
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
    if not loopback and not token:
        raise BadSettings(
            f"refusing to listen on {url} without a token: every host that can reach it could read and write "
            "the cache. Set KVB_CACHE_SERVER_TOKEN_ENV to the name of a variable holding a shared secret, "
            "or bind tcp://127.0.0.1:PORT.")


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
