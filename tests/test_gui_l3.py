"""The store panel with an L3 tier: a real TieredStore (L1, L2, L3) on a real redis-server on loopback,
read through the same handlers the GUI calls (store_census, store_stats, store_markdown, clear_question,
clear_tier). What is asserted is what a person reads: the L3 line up with the server's object count,
down with its reason after the server stopped, the clear control, a lossy codec labelled lossy.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from kvbridge.gui import charts
from kvbridge.gui import handlers as h
from kvbridge.gui import store_panel as sp
from kvbridge.store import ObjectMeta, TieredStore
from tests.redis_helpers import RedisServer, needs_redis

pytestmark = [needs_redis, pytest.mark.live, pytest.mark.timeout(60)]

PASSWORD = "s3cret-l3-pw"
BLOB = b"kv" * 4096


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


@pytest.fixture
def redis_server():
    with RedisServer(password=PASSWORD) as server:
        yield server


def l3_state(make_settings, monkeypatch, server: RedisServer, **changes) -> h.AppState:
    """An AppState whose engine holds a TieredStore with L3 on `server` (the panel reads only the store)."""
    monkeypatch.setenv("KVB_TEST_L3_PASSWORD", PASSWORD)
    settings = make_settings(**{"l3_url": server.url, "l3_password_env": "KVB_TEST_L3_PASSWORD", "l3_timeout": 1.0,
                                **changes})
    state = h.AppState(settings)
    state.engine = SimpleNamespace(store=TieredStore.from_settings(settings, namespace="ns"))
    return state


def panel(state: h.AppState) -> str:
    """The store panel's text as a refresh builds it (app.store_values: the census first, then stats)."""
    census = sp.store_census(state)
    return sp.store_markdown(sp.store_stats(state), census)


def l3_line(markdown: str) -> str:
    return next(line for line in markdown.splitlines() if line.startswith("**L3**"))


def put_objects(store: TieredStore, n: int) -> None:
    for i in range(n):
        assert store.put(key(i), BLOB, ObjectMeta("ns", 4, bytes(16)))
    assert store.drain(10)   # L3 is written behind the request


def test_l3_line_is_up_with_the_servers_objects_and_this_process_hits(make_settings, monkeypatch, redis_server):
    state = l3_state(make_settings, monkeypatch, redis_server)
    store = state.engine.store
    try:
        with redis_server.client() as c:
            c.set(b"app:thing", b"an application's key")
            c.set(b"other:obj:" + b"ab" * 32, b"another team's prefix")
        put_objects(store, 3)
        assert store.tier_names == ["L1", "L2", "L3"] == sp.store_tier_names(state)
        for tier in ("L1", "L2"):   # the next read of key 0 comes from L3
            assert sp.clear_tier(state, tier).ok
        assert store.get(key(0)).tier == "L3"

        markdown = panel(state)
        line = l3_line(markdown)
        assert f"`redis://127.0.0.1:{redis_server.port}/0`" in line and "prefix `kvb`" in line
        assert "**up** (reachable)" in line
        assert "under `kvb:obj:*` (every host's): **3 objects**" in line   # not app:thing, not other:obj:
        assert "this process: 1 hits" in line and "codec raw" in line
        assert "| L3 | 3 known here |" in markdown and "| L2 |" in markdown
        assert PASSWORD not in markdown

        fig = charts.store_figure(sp.store_stats(state))   # the occupancy bar: no % of a capacity L3 lacks
        at = list(fig.data[0].y).index("L3")
        assert fig.data[0].x[at] == 0 and "known here" in fig.data[0].text[at]
    finally:
        store.close()


def test_l3_line_says_down_with_reason_and_retry_after_the_server_stopped(make_settings, monkeypatch, redis_server):
    state = l3_state(make_settings, monkeypatch, redis_server)
    store = state.engine.store
    try:
        put_objects(store, 2)
        assert "**2 objects**" in l3_line(panel(state))
        redis_server.stop()

        line = l3_line(panel(state))
        assert "**down** (" in line and "next try in" in line
        assert "Connection" in line   # the reason: the refused connection
        assert "on the server under `kvb:obj:*` (every host's): unknown (L3 down)" in line
        assert f"`redis://127.0.0.1:{redis_server.port}/0`" in line

        refused = sp.clear_tier(state, "L3")
        assert not refused.ok
        assert refused.message.startswith("L3 was not cleared: L3 ") and "once it can be reached" in refused.message
        assert "Traceback" not in refused.message and "unexpectedly" not in refused.message
        assert sp.clear_tier(state, "L1").ok   # the rest of the store still works
    finally:
        store.close()


def test_clear_l3_removes_only_kvbridges_objects(make_settings, monkeypatch, redis_server):
    state = l3_state(make_settings, monkeypatch, redis_server)
    store = state.engine.store
    try:
        put_objects(store, 4)
        with redis_server.client() as c:
            c.set(b"app:thing", b"keep")
            c.set(b"other:obj:" + b"cd" * 32, b"keep")
        question = sp.clear_question(state, "L3")
        assert question.ok and "**Really clear L3?**" in question.message
        assert f"under `kvb:obj:*` on `redis://127.0.0.1:{redis_server.port}/0`" in question.message
        assert "every host's" in question.message and "L1, L2 are kept" in question.message

        outcome = sp.clear_tier(state, "L3")
        assert outcome.ok and outcome.message == "L3 cleared."
        with redis_server.client() as c:
            assert c.keys(b"kvb:*") == []
            assert c.get(b"app:thing") == b"keep" and c.get(b"other:obj:" + b"cd" * 32) == b"keep"
        assert "**0 objects**" in l3_line(panel(state))
        assert store.get(key(0)).tier == "L1"   # the other tiers kept theirs
    finally:
        store.close()


def test_a_slow_server_holds_the_refresh_no_longer_than_the_tiers_timeout(make_settings, monkeypatch, redis_server):
    state = l3_state(make_settings, monkeypatch, redis_server, l3_timeout=0.5)
    try:
        put_objects(state.engine.store, 1)
        redis_server.pause(3)
        began = time.monotonic()
        census = sp.store_census(state)
        assert time.monotonic() - began < 1.5
        assert "unknown" in census["L3"]
        assert "on the server under `kvb:obj:*` (every host's): unknown (" in l3_line(
            sp.store_markdown(sp.store_stats(state), census))
    finally:
        state.engine.store.close()


def test_a_lossy_codec_is_labelled_lossy(make_settings, monkeypatch, redis_server):
    state = l3_state(make_settings, monkeypatch, redis_server, l3_serde="int8", l2_serde="zstd")
    try:
        markdown = panel(state)
        assert "| **int8 (lossy)** |" in markdown and "codec **int8 (lossy)**" in l3_line(markdown)
        assert "| zstd |" in markdown   # L2's codec, lossless: no label
        assert "**Lossy codec:** L3 keeps KV as int8 (lossy)" in markdown
        assert "L2 keeps" not in markdown
    finally:
        state.engine.store.close()


def test_without_l3_the_panel_has_no_l3_line(make_settings):
    state = h.AppState(make_settings())
    state.engine = SimpleNamespace(store=TieredStore.from_settings(state.settings, namespace="ns"))
    try:
        assert sp.store_census(state) == {}
        markdown = panel(state)
        assert "**L3**" not in markdown and "| L1 | 0 |" in markdown and "Lossy" not in markdown
        assert "Every object in L2 is deleted; L1 is kept." in sp.clear_question(state, "L2").message
    finally:
        state.engine.store.close()


def test_the_cache_servers_l3_shows_in_the_panel_and_clears_through_it(make_settings, monkeypatch, redis_server, tmp_path):
    """KVB_STORE_URL: L3 is the server's tier. Its line arrives in the server's status; the count of the
    server's keys is not made from this process; Clear L3 goes through the cache server."""
    from kvbridge.cache_server.remote_store import RemoteStore
    from tests.cache_server_helpers import SMALL_POOL, running_server

    monkeypatch.setenv("KVB_TEST_L3_PASSWORD", PASSWORD)
    server_settings = make_settings(**SMALL_POOL, l3_url=redis_server.url, l3_password_env="KVB_TEST_L3_PASSWORD",
                                    l3_timeout=1.0)
    with running_server(server_settings) as srv:
        settings = make_settings(store_url=srv.url, cache_server_timeout=3.0, l2_dir=str(tmp_path / "engine-l2"))
        store = RemoteStore.from_settings(settings, namespace="ns")
        state = h.AppState(settings)
        state.engine = SimpleNamespace(store=store)
        try:
            assert store.put(key(1), BLOB, ObjectMeta("ns", 4, bytes(16)))
            store.flush()   # L1 (the pool) to the tiers below it; L3 is written behind that
            with redis_server.client() as c:
                deadline = time.monotonic() + 10
                while not c.keys(b"kvb:obj:*") and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert len(c.keys(b"kvb:obj:*")) == 1
            assert sp.store_census(state) == {}   # no tiers of its own here
            line = l3_line(panel(state))
            assert "**up** (reachable)" in line and f"`redis://127.0.0.1:{redis_server.port}/0`" in line
            assert "not counted from here (the cache server's tier)" in line
            assert sp.clear_tier(state, "L3").ok
            with redis_server.client() as c:
                assert c.keys(b"kvb:*") == []
        finally:
            store.close()
