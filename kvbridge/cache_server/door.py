"""The cache server's door: how many connections it holds at once, and how long one may take to authenticate.

Place in the flow: a peer connects -> libzmq accepts it (one descriptor) -> the CURVE handshake,
which must finish within KVB_CACHE_SERVER_HANDSHAKE_S (ZMQ_HANDSHAKE_IVL: libzmq hangs up on a peer
that has not finished by then, one that sends nothing at all included) -> ZAP (curve.ZapGate) ->
messages (server.CacheServer).

libzmq has no limit on the connections a ROUTER accepts, so idle peers could hold descriptors until
the process runs out. ConnectionCap reads the ROUTER's own monitor (accepted: a descriptor; gone:
that descriptor) and, while more than KVB_CACHE_SERVER_MAX_CONNECTIONS are open, shuts the newest
down: shutdown(2) through a duplicate of the descriptor, so libzmq reads end-of-file and closes it
itself (no descriptor is closed under libzmq's feet). The monitor's events arrive late and a number
may have been reused meanwhile, so a descriptor is touched only while it is still a socket on the
server's own address (one of its connections, then, and a new one).

Deliberately left out: unbinding while full (another account could take the port before the rebind)
and telling authenticated connections from the rest (libzmq's handshake events do not say which
descriptor they are about). A peer that fills the cap holds it for one handshake interval at a time:
clients are delayed meanwhile (they retry), but the server's descriptors are never exhausted.
"""
from __future__ import annotations

import logging
import os
import socket
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvbridge.errors import BadSettings
from kvbridge.settings import Settings

log = logging.getLogger("kvbridge.cache_server")
LOG_EVERY_S = 10.0
MIN_HANDSHAKE_S = 0.1


def check_door_settings(settings: Settings) -> None:
    """BadSettings naming the setting when the handshake interval or the connection cap cannot work."""
    if not settings.cache_server_handshake_s >= MIN_HANDSHAKE_S:   # 0 would be libzmq's "no limit"
        raise BadSettings(f"KVB_CACHE_SERVER_HANDSHAKE_S={settings.cache_server_handshake_s} must be at least "
                          f"{MIN_HANDSHAKE_S} seconds (a peer that has not authenticated by then is dropped)")
    if settings.cache_server_max_connections < 1:
        raise BadSettings(f"KVB_CACHE_SERVER_MAX_CONNECTIONS={settings.cache_server_max_connections} must be at "
                          "least 1 (connections the cache server holds at once, authenticated or not)")


def apply_handshake_interval(sock: zmq.Socket, settings: Settings) -> None:
    sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, round(settings.cache_server_handshake_s * 1000)))


class ConnectionCap:
    """Keeps at most `limit` connections open on a ROUTER; poll `socket`, then call `drain()` from the loop."""

    def __init__(self, router: zmq.Socket, limit: int) -> None:
        self.limit = limit
        self.refused = 0
        self.socket = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._router = router
        self._open: dict[int, int] = {}   # descriptor -> the order it was accepted in
        self._accepted = 0
        self._shut_down: set[int] = set()   # shut down, their disconnect event not read yet
        self._address: object = None      # the listener's local address, set by watch()
        self._logged_at = -LOG_EVERY_S

    def watch(self) -> None:
        """After the bind: learn the address accepted connections carry (what a descriptor is checked against)."""
        endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        scheme, _, rest = endpoint.partition("://")
        self._address = int(rest.rpartition(":")[2]) if scheme == "tcp" else rest

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def drain(self) -> None:
        """Read every pending event, then shut the newest connections down while over the limit."""
        while True:
            try:
                event = recv_monitor_message(self.socket, zmq.NOBLOCK)
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted += 1
                self._open[event["value"]] = self._accepted
            else:
                self._open.pop(event["value"], None)
                self._shut_down.discard(event["value"])
        if len(self._open) <= self.limit:
            return
        self._open = {fd: n for fd, n in self._open.items() if self._still_ours(fd)}   # events lost: recount
        self._shut_down &= self._open.keys()
        excess = [fd for fd in sorted(self._open, key=self._open.get)[self.limit:] if fd not in self._shut_down]
        for fd in excess:
            if self._shut(fd):
                self._shut_down.add(fd)
                self.refused += 1
        if excess and time.monotonic() - self._logged_at >= LOG_EVERY_S:
            self._logged_at = time.monotonic()
            log.warning("closed %d connection(s) over KVB_CACHE_SERVER_MAX_CONNECTIONS=%d (%d so far); a peer "
                        "holding many open connections delays clients until its handshakes time out "
                        "(KVB_CACHE_SERVER_HANDSHAKE_S)", len(excess), self.limit, self.refused)

    def _ours(self, fd: int) -> socket.socket | None:
        """A duplicate of `fd` when it is still a connection on the server's address (the caller closes it)."""
        try:
            dup = socket.socket(fileno=os.dup(fd))
        except OSError:
            return None   # closed meanwhile, or reused by something that is not a socket
        try:
            local = dup.getsockname()
            same = (local[1] if isinstance(local, tuple) else local) == self._address
        except OSError:
            same = False
        if not same:
            dup.close()
            return None
        return dup

    def _still_ours(self, fd: int) -> bool:
        dup = self._ours(fd)
        if dup is not None:
            dup.close()
        return dup is not None

    def _shut(self, fd: int) -> bool:
        dup = self._ours(fd)
        if dup is None:
            self._open.pop(fd, None)
            return False
        try:
            dup.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:   # already shut down (ENOTCONN): its disconnect event is on its way
            return False
        finally:
            dup.close()

    def close(self) -> None:
        try:
            self._router.disable_monitor()
        except zmq.ZMQError:
            pass
        self.socket.close(0)
