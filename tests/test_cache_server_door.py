"""The cache server's door, over real sockets on loopback: a ZAP handler that is gone admits no one
(ZMQ_ZAP_ENFORCE_DOMAIN), an idle unauthenticated TCP connection is dropped after
KVB_CACHE_SERVER_HANDSHAKE_S, connections past KVB_CACHE_SERVER_MAX_CONNECTIONS are closed at once,
and through all of it the server keeps serving its own client.
"""
from __future__ import annotations

import select
import socket
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from cache_server_helpers import SMALL_POOL, running_server
from kvbridge.cache_server.client import CacheClient
from kvbridge.cache_server.curve import ClientKeys, apply_client, client_key_pair
from kvbridge.errors import BadSettings

pytestmark = [pytest.mark.live, pytest.mark.timeout(120)]


@pytest.fixture
def settings(make_settings):
    return make_settings(**SMALL_POOL)


def handshake_outcome(url: str, server_public: str, token: str, wait_s: float = 3.0) -> str:
    """'succeeded' or 'failed': the CURVE handshake of a DEALER holding `token`'s client keys, seen by its monitor."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        apply_client(sock, ClientKeys(server_public, "test", client_key_pair(token)))
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        sock.connect(url)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if monitor.poll(100):
                event = recv_monitor_message(monitor)["event"]
                return "succeeded" if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else "failed"
        return "no answer"
    finally:
        ctx.destroy(linger=0)


def test_with_its_zap_handler_gone_the_server_admits_no_key(settings):
    with running_server(settings) as srv:
        assert handshake_outcome(srv.url, srv.keys.public, srv.token) == "succeeded"
        assert handshake_outcome(srv.url, srv.keys.public, "not-the-token") == "failed"
        srv._zap.close()   # the handler's thread is gone: libzmq finds no one on the ZAP endpoint
        srv._zap = None
        assert handshake_outcome(srv.url, srv.keys.public, "not-the-token") == "failed", \
            "a wrong key passed the handshake once the ZAP handler was gone"
        assert handshake_outcome(srv.url, srv.keys.public, srv.token) == "failed"   # fails closed, for everyone


def open_idle(port: int, n: int) -> list[socket.socket]:
    """`n` raw TCP connections to the server that never send a byte (a peer that never authenticates)."""
    conns = []
    for _ in range(n):
        conn = socket.create_connection(("127.0.0.1", port), timeout=5)
        conn.setblocking(False)
        conns.append(conn)
    return conns


def closed_by_server(conns: list[socket.socket], within_s: float) -> list[bool]:
    """Which connections the server hung up on (end of file or reset) within `within_s`; the greeting it sends is read and dropped."""
    closed = [False] * len(conns)
    deadline = time.monotonic() + within_s
    while not all(closed) and time.monotonic() < deadline:
        readable, _, _ = select.select([c for c, done in zip(conns, closed) if not done], [], [], 0.05)
        for conn in readable:
            try:
                data = conn.recv(4096)
            except (ConnectionResetError, BlockingIOError) as exc:
                data = b"" if isinstance(exc, ConnectionResetError) else None
            if data == b"":
                closed[conns.index(conn)] = True
    return closed


def port_of(url: str) -> int:
    return int(url.rpartition(":")[2])


def test_an_idle_connection_that_never_authenticates_is_dropped_after_the_handshake_interval(settings):
    settings = settings.replace(cache_server_handshake_s=1.0)
    with running_server(settings) as srv:
        conns = open_idle(port_of(srv.url), 6)
        try:
            started = time.monotonic()
            assert all(closed_by_server(conns, within_s=4.0)), "idle connections outlived KVB_CACHE_SERVER_HANDSHAKE_S"
            assert time.monotonic() - started >= 0.5   # dropped by the interval, not at once
        finally:
            for conn in conns:
                conn.close()
        with CacheClient(srv.url, timeout_s=5) as client:
            assert client.ping().server_id == srv.server_id


def test_connections_past_the_cap_are_closed_at_once_and_the_client_gets_in_after(settings):
    settings = settings.replace(cache_server_max_connections=4, cache_server_handshake_s=2.0)
    with running_server(settings) as srv:
        conns = open_idle(port_of(srv.url), 10)
        try:
            closed = closed_by_server(conns, within_s=1.0)   # well inside the handshake interval
            assert closed.count(True) == 6 and not any(closed[:4]), closed   # the newest six, the first four held
            assert all(closed_by_server(conns[:4], within_s=4.0))   # then the interval drops the rest
        finally:
            for conn in conns:
                conn.close()
        with CacheClient(srv.url, timeout_s=5) as client:
            assert client.ping().server_id == srv.server_id
            deadline = time.monotonic() + 5
            while srv._door.open_connections != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert srv._door.open_connections == 1   # the count followed every close


@pytest.mark.parametrize("change, setting", [(dict(cache_server_handshake_s=0), "KVB_CACHE_SERVER_HANDSHAKE_S"),
                                             (dict(cache_server_max_connections=0), "KVB_CACHE_SERVER_MAX_CONNECTIONS")])
def test_a_door_setting_that_cannot_work_is_refused_naming_it(settings, change, setting):
    from kvbridge.cache_server.server import CacheServer

    with pytest.raises(BadSettings, match=setting):
        CacheServer(settings.replace(**change), url="tcp://127.0.0.1:1")
