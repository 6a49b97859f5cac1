"""CURVE: the cache server and its clients prove who they are in ZMQ's handshake, before any message moves.

Place in the flow: CacheClient -> Connection (a DEALER set up by `client_keys`) ══CURVE══> the
server's ROUTER (set up by `server_keys`), whose handshakes `ZapGate` judges. Everything after the
handshake is encrypted; a peer that fails it never gets one frame accepted, by either side.

The server proves itself with its key pair: made fresh at each start (or read from the variable
KVB_CACHE_SERVER_SECRET_KEY_ENV names, for clients on other hosts); its public key, never the secret
one, is written beside the token file (`key_file`: mode 0600, owner-only, removed at stop, and left
by a crash, which is why no secret goes there). A client trusts only the public key it is
configured with (KVB_CACHE_SERVER_PUBLIC_KEY) or the one in such a file that its own uid owns and no
one else can read; with neither it refuses (CacheServerRefused naming the file and the setting), so
a squatter on the port (another account, while the owner's server is down) learns nothing: it does
not hold the secret key, so the handshake fails before the first byte of a message.

The client proves itself with a key pair derived from the secret it already holds: the token (the
owner's token file by default, or the shared secret KVB_CACHE_SERVER_TOKEN_ENV names), hashed into a
Curve25519 secret key. The server knows the same secret, so it knows the one client public key to
admit, and `ZapGate` admits that key only: an account that cannot read the token file (or does not
know the shared secret) is turned away in the handshake, before any frame of a message is held in
memory, and no key list needs a file or a registration step. Why not keep CURVE for the server alone
and leave the client's proof to the hello (now encrypted)? Because until the hello is read every
peer could already send frames, and libzmq holds an unfinished multipart message until its last
frame. The hello still carries the token, checked again (defence in depth).

Deliberately left out: several client identities per server (every holder of the secret is one
principal, as with the token), and key rotation while running (a restart makes a new key; clients
reread the file when the handshake fails, so they follow by themselves).
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import zmq
from zmq.utils import z85

from kvbridge.cache_server.auth import (UntrustedFile, files_url, read_private_file, token_file, token_dir,
                                        write_private_file)
from kvbridge.cache_server.connection import CacheServerRefused
from kvbridge.errors import BadSettings
from kvbridge.settings import Settings
from kvbridge.settings.secrets import secret_from

log = logging.getLogger("kvbridge.cache_server")
KEY_FILE_MAGIC = "kvbridge cache-server key v2"   # v2: no secret key (v1 held it)
ZAP_DOMAIN = b"kvbridge-cache-server"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"   # fixed by the ZAP spec (RFC 27): libzmq asks whoever binds it
PUBLIC_KEY_SETTING = "KVB_CACHE_SERVER_PUBLIC_KEY"
SECRET_KEY_SETTING = "KVB_CACHE_SERVER_SECRET_KEY_ENV"
LOG_EVERY_S = 10.0   # refused handshakes are logged at most this often (with their count)


class ServerNotAuthenticated(CacheServerRefused):
    """The server could not be authenticated: no key to trust, or the peer at the address did not prove it
    holds that key. Nothing was sent to it."""


class NoServerKey(ServerNotAuthenticated):
    """Neither a configured key nor a key file: the server is not running (as this user) or not started yet."""


@dataclass(frozen=True)
class KeyPair:
    public: str   # Z85, 40 characters
    secret: str


@dataclass(frozen=True)
class ClientKeys:
    """What a client's DEALER needs: the server key it trusts (and where it found it) and its own pair."""

    server_public: str
    source: str    # the key file's path, or the setting, for messages a person reads
    client: KeyPair


def z85_key_problem(value: str) -> str | None:
    """Why `value` is not a Z85 CURVE key (40 characters for 32 bytes), or None."""
    if len(value) != 40:
        return f"is {len(value)} characters long; a Z85 CURVE key has 40"
    try:
        z85.decode(value.encode("ascii"))
    except (ValueError, UnicodeEncodeError, KeyError):
        return "is not Z85 text"
    return None


def pair_from_secret(secret: str) -> KeyPair:
    return KeyPair(zmq.curve_public(secret.encode()).decode(), secret)


def client_key_pair(token: str) -> KeyPair:
    """The client key pair every holder of `token` derives alike (X25519 clamps any 32 bytes into a secret key)."""
    digest = hashlib.blake2b(token.encode(), digest_size=32, person=b"kvb-cs-client").digest()
    return pair_from_secret(z85.encode(digest).decode())


# -- the server's side ----------------------------------------------------------------------------------
def server_keys(settings: Settings, environ: Mapping[str, str] | None = None) -> KeyPair:
    """The configured key pair (the variable KVB_CACHE_SERVER_SECRET_KEY_ENV names), else a fresh one."""
    name = settings.cache_server_secret_key_env
    if not name:
        public, secret = zmq.curve_keypair()
        return KeyPair(public.decode(), secret.decode())
    secret = secret_from(SECRET_KEY_SETTING, name, environ,
                         unset_hint=f"leave {SECRET_KEY_SETTING} empty for a new key pair at each start").strip()
    problem = z85_key_problem(secret)
    if problem:   # the value itself is never echoed: it is a secret
        raise BadSettings(f"the secret key in {name} (named by {SECRET_KEY_SETTING}) {problem}; make a pair with "
                          "python -c \"import zmq; print(*zmq.curve_keypair())\" (public first)")
    return pair_from_secret(secret)


def key_file(url: str) -> Path:
    """Where the server at `url` writes its public key: beside its token file, named alike."""
    return token_file(url).with_suffix(".key")


def write_key_file(url: str, keys: KeyPair, segment: str = "") -> Path:
    """The server's public key for this user's clients, with what a killed server leaves for
    kvbridge.cache_server.leftovers to find (its pid and L1 segment). Never the secret key: only the
    server's memory needs it, and a file outlives a crash."""
    lines = [KEY_FILE_MAGIC, f"public {keys.public}", f"pid {os.getpid()}"] + ([f"segment {segment}"] if segment else [])
    path = key_file(url)
    write_private_file(path, "\n".join(lines) + "\n")
    return path


def read_key_file(path: Path) -> dict[str, str] | None:
    """The key file's fields (public, pid, segment) when it is a trusted file of this format; None when it does
    not exist. UntrustedFile for a file this user must not trust, ValueError for one of another format."""
    text = read_private_file(path)
    if text is None:
        return None
    lines = text.splitlines()
    fields = dict(line.split(" ", 1) for line in lines[1:] if " " in line)
    if lines[:1] != [KEY_FILE_MAGIC] or z85_key_problem(fields.get("public", "")):
        raise ValueError(f"{path} is damaged or not a {KEY_FILE_MAGIC!r} file")
    return fields


def apply_server(sock: zmq.Socket, keys: KeyPair) -> None:
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public.encode())
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    # Without it libzmq treats a ZAP handler it cannot reach (its thread died) as "no authentication
    # wanted" and admits any CURVE key; with it, every handshake fails until the handler is back.
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


class ZapGate:
    """The server's ZAP handler: admits a CURVE handshake only from the client public keys given.

    One thread with a REP socket on ZAP_ENDPOINT in the server's context; it must run before the
    ROUTER binds. A request it cannot parse is denied, never fatal.
    """

    def __init__(self, ctx: zmq.Context, admitted: set[str]) -> None:
        self._admitted = {z85.decode(key.encode()) for key in admitted}
        self._ctx = ctx
        self.denied = 0
        self._logged_at = -LOG_EVERY_S
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._stop_url = f"inproc://kvb-zap-stop-{id(self)}"
        self._stop = ctx.socket(zmq.PAIR)
        self._stop.setsockopt(zmq.LINGER, 0)
        self._stop.bind(self._stop_url)
        self._thread = threading.Thread(target=self._run, name="kvb-cs-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        wake = self._ctx.socket(zmq.PAIR)
        wake.connect(self._stop_url)
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while wake not in dict(poller.poll()):
                self._sock.send_multipart(self._judge(self._sock.recv_multipart()))
        except zmq.ContextTerminated:
            pass
        except Exception:   # the server stays up but admits no one (ZAP_ENFORCE_DOMAIN): say so, loudly
            log.exception("the cache server's ZAP handler stopped: every CURVE handshake is refused from now on; "
                          "restart the cache server")
        finally:
            wake.close(0)
            self._sock.close(0)

    def _judge(self, frames: list[bytes]) -> list[bytes]:
        # RFC 27: version, request id, domain, address, identity, mechanism, credentials...
        request_id = frames[1] if len(frames) > 1 else b""
        admitted = (len(frames) >= 7 and frames[0] == b"1.0" and frames[2] == ZAP_DOMAIN and frames[5] == b"CURVE"
                    and frames[6] in self._admitted)
        if not admitted:
            self.denied += 1
            if time.monotonic() - self._logged_at >= LOG_EVERY_S:   # a peer retrying in a loop must not flood the log
                self._logged_at = time.monotonic()
                address = frames[3].decode(errors="replace") if len(frames) > 3 else "?"
                log.warning("refused a connection from %s in the CURVE handshake (%d refused so far): it does not "
                            "hold this server's token (the owner's token file, or the shared secret "
                            "KVB_CACHE_SERVER_TOKEN_ENV names)", address, self.denied)
            return [b"1.0", request_id, b"400", b"not a client of this cache server", b"", b""]
        return [b"1.0", request_id, b"200", b"OK", b"kvbridge-client", b""]

    def close(self) -> None:
        """Stop the thread (before the context is destroyed)."""
        try:
            self._stop.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._thread.join(timeout=5)
        self._stop.close(0)


# -- the client's side ----------------------------------------------------------------------------------
def trusted_server_key(url: str, configured: str = "") -> tuple[str, str]:
    """(the server's public key, where it came from): the configured key, else the owner's key file for `url`.

    Raises ServerNotAuthenticated naming the file and the setting when there is nothing to trust.
    """
    if configured:
        problem = z85_key_problem(configured)
        if problem:
            raise ServerNotAuthenticated(f"{PUBLIC_KEY_SETTING} {problem}; copy the server's public key from its "
                                         "log line 'public key ...' or its key file")
        return configured, PUBLIC_KEY_SETTING
    path = key_file(files_url(url))
    try:
        fields = read_key_file(path)
    except UntrustedFile as exc:
        raise ServerNotAuthenticated(f"not trusting the cache server at {url}: its key file {exc}") from None
    except ValueError as exc:
        raise ServerNotAuthenticated(f"not trusting the cache server at {url}: its key file {exc} (restart the "
                                     "server to write it again)") from None
    if fields is None:
        raise NoServerKey(
            f"no key to authenticate the cache server at {url}: {path} does not exist (the server is not running, "
            f"or runs as another OS user) and {PUBLIC_KEY_SETTING} is not set. Start the cache server as this user "
            f"(its key file appears in {token_dir()}), or set {PUBLIC_KEY_SETTING} to the key the server logs at start")
    return fields["public"], str(path)


def client_keys(url: str, token: str, configured_server_key: str = "") -> ClientKeys:
    """Everything a client's socket needs to authenticate the server at `url` and itself (with `token`)."""
    public, source = trusted_server_key(url, configured_server_key)
    return ClientKeys(public, source, client_key_pair(token))


def apply_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    """Make `sock` a CURVE client: it authenticates the server by keys.server_public and itself by keys.client."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client.public.encode())
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client.secret.encode())
