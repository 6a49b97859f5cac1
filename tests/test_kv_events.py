"""The opt-in kv_events module on a real cache server: a real SUB socket sees stores, evictions and
clears as they happen, `kv_events.recent` returns them, and nothing is composed unless it is named.
"""
from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from kvbridge.cache_server.client import CacheClient
from kvbridge.cache_server.module import ModuleSpec, ModuleStartupError
from kvbridge.cache_server.plugin_modules import kv_events
from kvbridge.cache_server.protocol import ServerModuleCallRequest
from kvbridge.cache_server.server import CacheServer
from kvbridge.store import ObjectMeta

KV_EVENTS = "kvbridge.cache_server.plugin_modules.kv_events"
WAIT_S = 10.0
pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(settings, specs):
    server = CacheServer(settings, url=f"tcp://127.0.0.1:{free_port()}", module_specs=specs)
    server.bind()
    thread = threading.Thread(target=server.serve_forever, name="test-cache-server", daemon=True)
    thread.start()
    return server, thread


def stop_server(server, thread) -> None:
    server.stop()
    thread.join(timeout=10)
    server.close()


@pytest.fixture
def small_settings(make_settings):
    return make_settings(l1_bytes=8 << 20, cache_server_page_bytes=64 << 10)


@pytest.fixture
def server(small_settings):
    server, thread = start_server(small_settings, [ModuleSpec(KV_EVENTS, {"history": 50})])
    yield server
    stop_server(server, thread)


@pytest.fixture
def client(server):
    with CacheClient(server.url, label="kv_events test", timeout_s=5) as client:
        yield client


def call(client, method: str, payload: dict | None = None) -> dict:
    body = msgspec.msgpack.encode(payload) if payload is not None else b""
    response = client.server_module_call(ServerModuleCallRequest(method, body)).result(timeout=5)
    assert response.success, response.error
    return msgspec.msgpack.decode(response.payload)


def meta() -> ObjectMeta:
    return ObjectMeta("ns", 1, bytes(16))


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


@pytest.fixture
def subscriber(client):
    """A SUB socket on the endpoint kv_events.info gives, past ZMQ's slow-joiner window."""
    info = call(client, "kv_events.info")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv.")
    sub.connect(info["endpoint"])
    # A subscription reaches the publisher asynchronously: store throwaway objects until one is heard.
    deadline, i = time.monotonic() + WAIT_S, 1_000_000
    while not sub.poll(100):
        assert time.monotonic() < deadline, "no event reached the subscriber"
        i += 1
        assert client.store(key(i), b"w" * 100, meta())[0]
    while sub.poll(200):   # drain the warm-up events
        sub.recv_multipart()
    yield sub
    sub.close(0)
    ctx.term()


def next_event(sub, wanted: str, key_hex: str) -> dict:
    """The first event `wanted` about `key_hex` (others are skipped), within WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if sub.poll(200):
            topic, payload = sub.recv_multipart()
            event = msgspec.msgpack.decode(payload)
            assert topic == b"kv." + event["event"].encode()
            if event["event"] == wanted and event["key"] == key_hex:
                return event
    raise AssertionError(f"no {wanted!r} event for {key_hex[:16]} within {WAIT_S} s")


def test_info_says_where_and_what(client, server):
    info = call(client, "kv_events.info")
    assert info["endpoint"].startswith("tcp://127.0.0.1:") and not info["endpoint"].endswith(":0")
    assert info["topics"] == ["kv.stored", "kv.evicted", "kv.removed"]
    assert "msgpack" in info["format"] and info["format_version"] == 1
    status = client.status()
    assert status["kv_events"]["endpoint"] == info["endpoint"]
    rows = {row["name"]: row for row in status["server"]["modules"]}
    assert rows["kv_events"]["dependencies"] == ["storage"] and rows["kv_events"]["external"] is True


def test_a_store_and_a_clear_reach_a_subscriber_and_the_history(client, subscriber):
    blob = b"x" * 70_000   # two 64 KiB pages
    assert client.store(key(1), blob, meta()) == (True, "")
    stored = next_event(subscriber, "stored", key(1).hex())
    assert (stored["tier"], stored["size"]) == ("L1", len(blob))
    assert abs(stored["time"] - time.time()) < 30 and stored["seq"] >= 1

    client.clear("L1")
    removed = next_event(subscriber, "removed", key(1).hex())
    assert removed["tier"] == "L1" and removed["seq"] > stored["seq"]

    recent = call(client, "kv_events.recent", {"since_seq": stored["seq"] - 1})
    seen = [(e["event"], e["key"], e["tier"]) for e in recent["events"]]
    assert ("stored", key(1).hex(), "L1") in seen and ("removed", key(1).hex(), "L1") in seen
    assert seen.index(("stored", key(1).hex(), "L1")) < seen.index(("removed", key(1).hex(), "L1"))
    assert all(e["seq"] > stored["seq"] - 1 for e in recent["events"])
    assert recent["last_seq"] >= removed["seq"] and recent["dropped"] == 0

    newest = call(client, "kv_events.recent", {"limit": 1})   # the L2 write-through may have added one since
    assert len(newest["events"]) == 1 and newest["events"][0]["seq"] == newest["last_seq"] >= recent["last_seq"]
    status = client.status()["kv_events"]
    assert status["published"] >= 2 and status["dropped"] == 0 and status["publishing"] is True


def test_eviction_under_pressure_is_published(client, subscriber):
    """Fill L1 (128 pages) past the SOFT watermark; the storage loop evicts the coldest objects."""
    blob = b"e" * (8 * 64 << 10)   # 8 pages each
    stored = []
    for i in range(100, 116):
        ok, reason = client.store(key(i), blob, meta())
        if ok:
            stored.append(key(i).hex())
        elif reason != "pressure":
            pytest.fail(f"store refused: {reason}")
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if subscriber.poll(200):
            event = msgspec.msgpack.decode(subscriber.recv_multipart()[1])
            if event["event"] == "evicted":
                assert event["tier"] == "L1" and event["size"] > 0
                if event["key"] in stored:   # the coldest go first: the subscriber's warm-up objects
                    assert event["size"] == len(blob)
                    return
    pytest.fail("no eviction event although L1 was filled past its SOFT watermark")


def test_a_bad_recent_request_is_an_error_reply(client):
    response = client.server_module_call(
        ServerModuleCallRequest("kv_events.recent", msgspec.msgpack.encode({"since": 3}))).result(timeout=5)
    assert not response.success and "since" in response.error


def test_not_composed_unless_named(small_settings):
    server, thread = start_server(small_settings, [])
    try:
        with CacheClient(server.url, timeout_s=5) as client:
            status = client.status()
            assert "kv_events" not in status
            assert "kv_events" not in [row["name"] for row in status["server"]["modules"]]
            response = client.server_module_call(ServerModuleCallRequest("kv_events.info")).result(timeout=5)
            assert not response.success
    finally:
        stop_server(server, thread)


def test_close_stops_the_publisher_and_frees_the_endpoint(small_settings):
    server, thread = start_server(small_settings, [ModuleSpec(KV_EVENTS, {})])
    module = server.modules.by_name["kv_events"]
    endpoint = module.endpoint
    assert module._publisher.is_alive()
    stop_server(server, thread)
    assert not module._publisher.is_alive()
    assert "kvb-cs-kv-events" not in [t.name for t in threading.enumerate()]
    ctx = zmq.Context()   # the port can be bound again: the socket is closed
    try:
        pub = ctx.socket(zmq.PUB)
        pub.bind(endpoint)
        pub.close(0)
    finally:
        ctx.term()


@pytest.mark.parametrize("config, says", [
    ({"history": 0}, "history"),
    ({"history": "ten"}, "history"),
    ({"url": "http://127.0.0.1:1"}, "tcp://"),
    ({"topic": "x"}, "unknown config"),
])
def test_bad_config_fails_startup_naming_it(small_settings, config, says):
    with pytest.raises(ModuleStartupError, match=says):
        CacheServer(small_settings, url=f"tcp://127.0.0.1:{free_port()}", module_specs=[ModuleSpec(KV_EVENTS, config)])


def test_a_full_queue_drops_and_counts_without_blocking_the_store(monkeypatch):
    """No publisher draining (no ZMQ server yet): the listener must still return at once."""
    monkeypatch.setattr(kv_events, "QUEUE_CAPACITY", 2)
    listeners = []
    store = SimpleNamespace(add_listener=listeners.append, remove_listener=listeners.remove)
    module = kv_events.KvEventsModule(SimpleNamespace(store=store))
    started = time.monotonic()
    for i in range(5):
        listeners[0]("stored", key(i), "L1", 10)
    assert time.monotonic() - started < 1
    status = module.report_status()
    assert (status["dropped"], status["last_seq"], status["queued"]) == (3, 5, 2)
    listener = listeners[0]
    module.close()
    assert listeners == [], "the module left its listener on the store"
    listener("stored", key(9), "L1", 10)   # a call already under way at close: ignored, not counted
    assert module.report_status()["last_seq"] == 5
