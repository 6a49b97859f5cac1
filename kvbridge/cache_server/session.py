"""Session: one client's standing with the cache server: the keys it trusts, its hello, its back-off.

Place in the flow: CacheClient (the calls, shared memory) -> **Session** -> Connection (the socket
thread) -> the server's ROUTER. Every call goes through `call`: say hello first when there is no
session (the keys read again then: a restarted server has a new token and key), send, wait at most
`timeout_s`, decode. Faults become the errors a caller acts on:

- no answer in time, or nothing listening: CacheServerUnavailable, and a back-off (1 s doubling to
  30 s) during which calls fail at once with the same error;
- the CURVE handshake failed: ServerNotAuthenticated (a CacheServerRefused) naming where the trusted
  key came from, or CacheServerRefused when the server turned this client's key away; the same
  back-off, the socket stops knocking, and calls during it raise the same refusal. A failed handshake
  while the key file now holds another key is a restarted server: once, the session says hello to it;
- the server does not know this client (restarted, reaped): hello again, once per call.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from kvbridge.cache_server import protocol
from kvbridge.cache_server.auth import REFUSED_TOKEN, client_token
from kvbridge.cache_server.connection import (CacheServerError, CacheServerRefused, CacheServerUnavailable, Connection,
                                              NotAuthenticated, NotConnected)
from kvbridge.cache_server.curve import ClientKeys, ServerNotAuthenticated, client_keys
from kvbridge.cache_server.protocol import Code, Kind

DOWN_BACKOFF_S = 1.0     # after a timeout, calls fail at once for this long before trying again,
DOWN_BACKOFF_MAX_S = 30.0   # doubling after each further timeout up to this (a hung server costs one
                            # request one timeout per back-off period, not one every second)


class Session:
    def __init__(self, url: str, instance_id: str, *, priority: int, label: str, token: str, server_key: str,
                 timeout_s: float, counters: dict, on_hello: Callable[[protocol.HelloReply], None]) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.conn = Connection(url, instance_id, keys=None)   # keys come with the first hello
        self.hello: protocol.HelloReply | None = None
        self._priority = priority
        self._label = label
        self._token = token   # configured; '' -> this user's token file for `url`, read at every hello
        self._server_key = server_key   # configured; '' -> this user's key file for `url`, read alike
        self._counters = counters
        self._on_hello = on_hello
        self._hello_lock = threading.Lock()
        self._said_hello = False
        self._refusal: CacheServerRefused | None = None   # the last refusal, raised again during its back-off
        self._down_until = 0.0
        self._backoff_s = DOWN_BACKOFF_S

    @property
    def connected(self) -> bool:
        return self.hello is not None and time.monotonic() >= self._down_until

    def send(self, kind: str, body: Any, data: tuple = ()) -> Future:
        """Hand a request to the connection; a caller that wants the answer waits on the Future (see call)."""
        return self.conn.send(kind, body, data)

    def call(self, kind: str, body: Any, reply_type: Any, data: tuple = (), with_data: bool = False):
        """Send, wait, decode; says hello again once when the server does not know us (restarted, or new key)."""
        why = ""
        for attempt in (1, 2):
            self.ensure_hello()
            future = self.send(kind, body, data=data)
            try:
                reply, frames = self._wait(future, kind, may_rekey=attempt == 1)
            except _NewServerKey:
                continue
            if reply.code == Code.HELLO_REQUIRED:
                self.hello = None   # the next call says hello again
                why = reply.error
                if attempt == 1:
                    continue
                break
            if not reply.success:
                if reply.code in (Code.UNAUTHORIZED, Code.VERSION):
                    raise CacheServerRefused(reply.error)
                raise CacheServerError(reply.code, reply.error)
            result = protocol.decode_reply_body(reply, reply_type)
            return (result, frames) if with_data else result
        raise CacheServerError(Code.HELLO_REQUIRED, _forgot_us(self.url, kind, why))

    def _wait(self, future: Future, kind: str, may_rekey: bool = False):
        try:
            return future.result(timeout=self.timeout_s)
        except NotAuthenticated as exc:
            self.hello = None
            if may_rekey and not exc.by_server and self._keys_changed():
                raise _NewServerKey() from None   # a restarted server wrote a new key: hello to it
            self._refuse(exc)
        except NotConnected as exc:
            self._mark_down(str(exc))
        except TimeoutError:
            self.conn.forget(future)
            self._mark_down(f"no answer to {kind} within {self.timeout_s:g} s (KVB_CACHE_SERVER_TIMEOUT)")

    def _mark_down(self, why: str):
        self._counters["timeouts"] += 1
        self.hello = None
        self._refusal = None
        self._back_off()
        raise CacheServerUnavailable(f"cache server {self.url}: {why}")

    def _refuse(self, exc: NotAuthenticated):
        """A failed handshake: stop connecting, remember why for the back-off, raise it for a person."""
        self._counters["refusals"] += 1
        keys = self.conn.keys
        self.conn.use_keys(None)   # libzmq would keep knocking otherwise
        self._back_off()
        if exc.by_server:
            self._refusal = CacheServerRefused(f"cache server {self.url}: {REFUSED_TOKEN}")
        else:
            self._refusal = ServerNotAuthenticated(
                f"cache server {self.url} not authenticated, nothing sent to it: {exc}. The key came from "
                f"{keys.source if keys else '?'}; another program may hold the address (the owner's server is "
                "down?), or the server runs with another key")
        raise type(self._refusal)(str(self._refusal))

    def _back_off(self) -> None:
        self._down_until = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, DOWN_BACKOFF_MAX_S)

    def _current_keys(self) -> ClientKeys:
        """The keys to use now: the token and server key read again (a restarted server wrote new files).
        NoServerKey / ServerNotAuthenticated when there is no server key this client may trust."""
        return client_keys(self.url, client_token(self.url, self._token), self._server_key)

    def _keys_changed(self) -> bool:
        """Does the key file now hold another server key than the one this connection trusted?"""
        trusted = self.conn.keys
        try:
            return trusted is not None and self._current_keys().server_public != trusted.server_public
        except CacheServerRefused:
            return False

    def ensure_hello(self) -> None:
        if self.hello is not None:
            return
        if time.monotonic() < self._down_until:
            if self._refusal is not None:
                raise type(self._refusal)(str(self._refusal))
            raise CacheServerUnavailable(f"cache server {self.url} did not answer recently; retrying shortly")
        with self._hello_lock:
            if self.hello is None:
                self._say_hello()

    def _say_hello(self) -> None:
        try:
            token = client_token(self.url, self._token)   # a token file it must not trust: refused, named
            keys = client_keys(self.url, token, self._server_key)
        except CacheServerRefused:
            self.conn.use_keys(None)
            raise
        self.conn.use_keys(keys)
        hello = protocol.Hello(protocol.PROTOCOL_VERSION, token, self._priority, os.getpid(), socket.gethostname(),
                               self._label)
        reply, _ = self._wait(self.send(Kind.HELLO, hello), Kind.HELLO)
        if not reply.success:
            if reply.code in (Code.UNAUTHORIZED, Code.VERSION, Code.BAD_REQUEST):
                raise CacheServerRefused(f"cache server {self.url}: {reply.error}")
            raise CacheServerError(reply.code, reply.error)
        answer = protocol.decode_reply_body(reply, protocol.HelloReply)
        if answer.protocol_version != protocol.PROTOCOL_VERSION:
            raise CacheServerRefused(
                f"protocol version mismatch: this client speaks version {protocol.PROTOCOL_VERSION}, the server at "
                f"{self.url} speaks version {answer.protocol_version}")
        if self._said_hello:   # every hello after the first: a restarted server, a new key, a reap
            self._counters["reconnects"] += 1
        self._said_hello = True
        self._on_hello(answer)
        self.hello = answer
        self._refusal = None
        self._down_until = 0.0
        self._backoff_s = DOWN_BACKOFF_S


class _NewServerKey(Exception):
    """Internal: a failed handshake, and the key file now holds another key (a restarted server)."""


def _forgot_us(url: str, kind: str, why: str) -> str:
    """Why a request was refused right after a hello the server accepted, and what to look at."""
    return (f"cache server {url} forgot this client again right after accepting its hello, so the {kind} request "
            f"was not served ({why or 'hello_required twice'}). Either the server restarts or reaps clients between "
            "a hello and the next request (is it restarting in a loop? see its log; is its "
            "KVB_CACHE_SERVER_REAP_TIMEOUT only a second or two?), or another process sends with this client's "
            "identity (a CacheClient shared across fork: make one per process). The next call says hello again")
