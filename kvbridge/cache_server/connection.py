"""Connection: one client's DEALER socket to the cache server, owned by a socket thread.

Place in the flow: CacheClient (the protocol: hello, shared memory, the calls) -> **Connection** ->
the server's ROUTER. A ZMQ socket belongs to one thread, so any thread hands its request to the
socket thread through an inproc socket of its own and waits on a Future: one connection, so a
client's requests reach the server in the order they were sent, whichever thread sent them. A
message that finds no connection waits up to CONNECT_GRACE_S for one (a server still starting),
then fails its caller with NotConnected; the socket thread blocks in poll otherwise (no busy waiting).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import zmq

from kvbridge.cache_server import protocol
from kvbridge.cache_server.protocol import Kind
from kvbridge.errors import KVBridgeError
from kvbridge.store.objects import StoreFault

log = logging.getLogger("kvbridge.cache_server.client")
CONNECT_GRACE_S = 1.0    # a message waits this long for a connection before its call fails
CONNECT_RETRY_MS = 20


class CacheServerUnavailable(StoreFault):
    """The cache server did not answer in time (down, restarting, unreachable): a cache miss for the engine."""


class NotConnected(Exception):
    """A message that found no connection within CONNECT_GRACE_S (the socket thread fails its call)."""


class CacheServerRefused(KVBridgeError):
    """The server refused this client (wrong token, protocol version): a person must change a setting."""


class CacheServerError(KVBridgeError):
    """The server answered a request with an error (bad request, lease not owned, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} ({code})")
        self.code = code


class Connection:
    def __init__(self, url: str, instance_id: str) -> None:
        self.url = url
        self.instance_id = instance_id
        self._ctx = zmq.Context()
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._pending_lock = threading.Lock()
        self._local = threading.local()
        self._outbox_url = f"inproc://kvb-client-{instance_id}"
        self._outbox = self._ctx.socket(zmq.PULL)
        self._outbox.bind(self._outbox_url)
        self._closing = threading.Event()
        self._unsent: list = []   # (queued at, frames) waiting for a connection; the socket thread's only
        self._io = threading.Thread(target=self._io_loop, name="kvb-cache-client", daemon=True)
        self._io.start()

    def forget(self, future: Future) -> None:
        """Stop waiting for an answer (its caller timed out); a late answer is dropped."""
        with self._pending_lock:
            for rid, pending in list(self._pending.items()):
                if pending is future:
                    del self._pending[rid]

    def settle(self, timeout_s: float, still_up: Callable[[], bool] = lambda: True) -> None:
        """Wait (bounded) until every request sent has its answer, or still_up() says the server is gone."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and still_up():
            with self._pending_lock:
                if not self._pending:
                    return
            time.sleep(0.002)

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        self._wake_io()
        self._io.join(timeout=5)
        self._outbox.close(0)
        self._ctx.destroy(linger=0)   # also closes other threads' send sockets

    def send(self, kind: str, body: Any, data: tuple = ()) -> Future:
        """Queue a request from any thread; the Future gets (reply, data frames) or NotConnected."""
        rid = next(self._ids)
        future: Future = Future()
        with self._pending_lock:
            self._pending[rid] = future
        frame = protocol.encode_request(rid, self.instance_id, kind, body)
        sock = getattr(self._local, "push", None)
        if sock is None:
            sock = self._local.push = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._outbox_url)
        sock.send_multipart([frame, *data], copy=False)
        return future

    def _wake_io(self) -> None:
        try:
            self.send(Kind.PING, None)   # any message wakes the poll; its answer is dropped
        except zmq.ZMQError:
            pass

    def _io_loop(self) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IMMEDIATE, 1)        # no queueing for a server that is not connected
        dealer.setsockopt(zmq.RECONNECT_IVL, 100)
        dealer.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        dealer.connect(self.url)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._outbox, zmq.POLLIN)
        try:
            while not self._closing.is_set():
                # block until something happens; poll briefly only while messages wait for a connection
                events = dict(poller.poll(CONNECT_RETRY_MS if self._unsent else None))
                if self._unsent:
                    self._retry_unsent(dealer)
                if self._outbox in events:
                    self._forward(dealer)
                if dealer in events:
                    self._deliver(dealer)
        finally:
            dealer.close(0)
            with self._pending_lock:
                pending, self._pending = self._pending, {}
            for future in pending.values():
                if not future.done():
                    future.set_exception(NotConnected("the client was closed"))

    def _forward(self, dealer) -> None:
        while True:
            try:
                frames = self._outbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if self._closing.is_set():
                return
            if self._unsent:
                self._unsent.append((time.monotonic(), frames))
                continue
            try:
                dealer.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:   # not connected (yet): held back for CONNECT_GRACE_S, then a miss
                self._unsent.append((time.monotonic(), frames))

    def _retry_unsent(self, dealer) -> None:
        """Send what waited for a connection; what waited longer than CONNECT_GRACE_S fails its caller now."""
        now = time.monotonic()
        while self._unsent:
            queued_at, frames = self._unsent[0]
            if now - queued_at > CONNECT_GRACE_S:
                self._unsent.pop(0)
                self._fail(frames, f"not connected to {self.url} (nothing listening there?)")
                continue
            try:
                dealer.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._unsent.pop(0)

    def _fail(self, frames, why: str) -> None:
        try:
            rid = protocol.decode_envelope(frames[0].buffer).request_id
        except Exception:   # our own envelope: cannot fail to decode; be safe anyway
            return
        with self._pending_lock:
            future = self._pending.pop(rid, None)
        if future is not None and not future.done():
            future.set_exception(NotConnected(why))

    def _deliver(self, dealer) -> None:
        while True:
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                reply = protocol.decode_reply(frames[0].buffer)
            except Exception as exc:   # a garbled reply: dropped; its caller times out
                log.warning("unreadable reply from the cache server dropped: %s", exc)
                continue
            with self._pending_lock:
                future = self._pending.pop(reply.request_id, None)
            if future is not None and not future.done():
                future.set_result((reply, [f.buffer for f in frames[1:]]))
