"""Connection: one client's DEALER socket to the cache server, owned by a socket thread.

Place in the flow: CacheClient (the protocol: hello, shared memory, the calls) -> **Connection** ->
the server's ROUTER. A ZMQ socket belongs to one thread, so any thread hands its request to the
socket thread through an inproc socket of its own and waits on a Future: one connection, so a
client's requests reach the server in the order they were sent, whichever thread sent them. A
message that finds no connection waits up to CONNECT_GRACE_S for one (a server still starting),
then fails its caller with NotConnected; the socket thread blocks in poll otherwise (no busy waiting).

Every connection runs CURVE with the keys the client hands over (kvbridge.cache_server.curve), and
ZMQ_IMMEDIATE holds every message back until a handshake succeeded: nothing reaches a peer that did
not prove it holds the server's secret key. A failed handshake (read from the socket's monitor)
fails the waiting messages at once with NotAuthenticated, and any new one for REFUSAL_MEMORY_S,
instead of letting them wait for a connection that will not come. New keys (`use_keys`) rebuild
the socket; `use_keys(None)` stops connecting at all.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvbridge.cache_server import protocol
from kvbridge.errors import KVBridgeError
from kvbridge.store.objects import StoreFault

log = logging.getLogger("kvbridge.cache_server.client")
CONNECT_GRACE_S = 1.0    # a message waits this long for a connection before its call fails
CONNECT_RETRY_MS = 20
REFUSAL_MEMORY_S = 3.0   # after a failed handshake, new messages fail at once for this long (libzmq keeps retrying)
_HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                     zmq.EVENT_HANDSHAKE_FAILED_AUTH}
_MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | \
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH

if TYPE_CHECKING:
    from kvbridge.cache_server.curve import ClientKeys


class CacheServerUnavailable(StoreFault):
    """The cache server did not answer in time (down, restarting, unreachable): a cache miss for the engine."""


class NotConnected(Exception):
    """A message that found no connection within CONNECT_GRACE_S (the socket thread fails its call)."""


class NotAuthenticated(NotConnected):
    """The peer at the address failed the CURVE handshake: it does not hold the server key this client
    trusts (`by_server` False), or the server turned this client's key away (`by_server` True)."""

    def __init__(self, why: str, by_server: bool) -> None:
        super().__init__(why)
        self.by_server = by_server


class CacheServerRefused(KVBridgeError):
    """The server refused this client (wrong token, protocol version), or could not be authenticated
    (kvbridge.cache_server.curve.ServerNotAuthenticated): a person must change a setting, or a squatter
    holds the address."""


class CacheServerError(KVBridgeError):
    """The server answered a request with an error (bad request, lease not owned, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} ({code})")
        self.code = code


class Connection:
    def __init__(self, url: str, instance_id: str, keys: "ClientKeys | None") -> None:
        self.url = url
        self.instance_id = instance_id
        self._ctx = zmq.Context()
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._pending_lock = threading.Lock()
        self._local = threading.local()
        self._outbox_url = f"inproc://kvb-client-{instance_id}-{id(self)}"
        self._outbox = self._ctx.socket(zmq.PULL)
        self._outbox.bind(self._outbox_url)
        self._closing = threading.Event()
        self._keys = keys        # what the socket thread should connect with (set by any thread)
        # the socket thread's only:
        self._unsent: list = []  # (queued at, frames) waiting for a connection
        self._poller = zmq.Poller()
        self._dealer: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._dealer_keys: "ClientKeys | None" = None
        self._failed_handshake: tuple[float, str, bool] | None = None   # (when, why, by the server) since a success
        self._io = threading.Thread(target=self._io_loop, name="kvb-cache-client", daemon=True)
        self._io.start()

    @property
    def keys(self) -> "ClientKeys | None":
        return self._keys

    def use_keys(self, keys: "ClientKeys | None") -> None:
        """Connect with these keys from now on (a new socket when they differ); None: stop connecting."""
        self._keys = keys
        self._wake_io()

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
        try:
            self._push().send_multipart([frame, *data], copy=False)
        except zmq.ZMQError:   # closed meanwhile (the context is gone)
            self.forget(future)
            future.set_exception(NotConnected("the client was closed"))
        return future

    def _push(self) -> zmq.Socket:
        sock = getattr(self._local, "push", None)
        if sock is None:
            sock = self._local.push = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._outbox_url)
        return sock

    def _wake_io(self) -> None:
        try:
            self._push().send(b"", zmq.NOBLOCK)   # one empty frame: not a request, it only wakes the poll
        except zmq.ZMQError:
            pass

    # -- the socket thread -----------------------------------------------------------------------------
    def _io_loop(self) -> None:
        self._poller.register(self._outbox, zmq.POLLIN)
        try:
            while not self._closing.is_set():
                self._follow_keys()
                # block until something happens; poll briefly only while messages wait for a connection
                events = dict(self._poller.poll(CONNECT_RETRY_MS if self._unsent else None))
                if self._monitor is not None and self._monitor in events:
                    self._read_monitor()
                if self._unsent:
                    self._retry_unsent()
                if self._outbox in events:
                    self._forward()
                if self._dealer is not None and self._dealer in events:
                    self._deliver()
        finally:
            self._close_dealer()
            with self._pending_lock:
                pending, self._pending = self._pending, {}
            for future in pending.values():
                if not future.done():
                    future.set_exception(NotConnected("the client was closed"))

    def _follow_keys(self) -> None:
        """A socket for the wanted keys: the old one goes (its unanswered requests time out), a new one connects."""
        keys = self._keys
        if keys is self._dealer_keys or keys == self._dealer_keys:   # a socket exists exactly when there are keys
            return
        from kvbridge.cache_server.curve import apply_client   # late: curve imports this module's errors

        self._close_dealer()
        self._dealer_keys = keys
        if keys is None:
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IMMEDIATE, 1)        # nothing queued for a peer before its handshake succeeded
        dealer.setsockopt(zmq.RECONNECT_IVL, 100)
        dealer.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        apply_client(dealer, keys)
        self._monitor = dealer.get_monitor_socket(_MONITORED)
        dealer.connect(self.url)
        self._dealer = dealer
        self._poller.register(dealer, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def _close_dealer(self) -> None:
        self._failed_handshake = None
        if self._dealer is None:
            return
        self._poller.unregister(self._dealer)
        self._poller.unregister(self._monitor)
        self._dealer.disable_monitor()
        self._monitor.close(0)
        self._dealer.close(0)
        self._dealer = self._monitor = None

    def _read_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._failed_handshake = None
            elif kind in _HANDSHAKE_FAILED:
                self._failed_handshake = (time.monotonic(), self._describe(kind, event["value"]),
                                          kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH)
                while self._unsent:
                    self._fail(self._unsent.pop(0)[1], self._refusal())

    def _describe(self, kind: int, value: int) -> str:
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return f"the server at {self.url} turned this client's key away in the CURVE handshake (status {value})"
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            return (f"the peer at {self.url} broke off the CURVE handshake (ZMTP error {value:#x}: it does not "
                    "speak CURVE, or not with this key)")
        return (f"the peer at {self.url} closed the connection in the CURVE handshake: it does not hold the secret "
                "key that belongs to the public key this client trusts")

    def _refusal(self) -> NotAuthenticated | None:
        """The last failed handshake, while it is recent and no handshake succeeded since."""
        failed = self._failed_handshake
        if failed is None or time.monotonic() - failed[0] > REFUSAL_MEMORY_S:
            return None
        return NotAuthenticated(failed[1], failed[2])

    def _forward(self) -> None:
        while True:
            try:
                frames = self._outbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if self._closing.is_set():
                return
            if len(frames) == 1 and not len(frames[0]):   # a wake-up, not a request
                continue
            self._follow_keys()   # keys handed over before this message was sent are in effect for it
            if self._dealer is None:
                self._fail(frames, NotConnected(f"no key to connect to {self.url} with"))
                continue
            if self._unsent:
                self._unsent.append((time.monotonic(), frames))
                continue
            try:
                self._dealer.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:   # not connected (yet): held back for CONNECT_GRACE_S, then a miss
                refusal = self._refusal()
                if refusal is not None:
                    self._fail(frames, refusal)
                else:
                    self._unsent.append((time.monotonic(), frames))

    def _retry_unsent(self) -> None:
        """Send what waited for a connection; what waited longer than CONNECT_GRACE_S fails its caller now."""
        now = time.monotonic()
        while self._unsent:
            queued_at, frames = self._unsent[0]
            if self._dealer is None or now - queued_at > CONNECT_GRACE_S:
                self._unsent.pop(0)
                self._fail(frames, NotConnected(f"not connected to {self.url} (nothing listening there?)"))
                continue
            try:
                self._dealer.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._unsent.pop(0)

    def _fail(self, frames, exc: Exception) -> None:
        try:
            rid = protocol.decode_envelope(frames[0].buffer).request_id
        except Exception:   # our own envelope: cannot fail to decode; be safe anyway
            return
        with self._pending_lock:
            future = self._pending.pop(rid, None)
        if future is not None and not future.done():
            future.set_exception(exc)

    def _deliver(self) -> None:
        while True:
            try:
                frames = self._dealer.recv_multipart(zmq.NOBLOCK, copy=False)
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
