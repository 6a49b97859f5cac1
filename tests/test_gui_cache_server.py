"""The store panel's cache-server section against a real in-process cache server and a real RemoteStore:
server line, modules, clients, pressure, page map, event log; an unreachable server is one line;
an embedded store shows nothing new.
"""
from __future__ import annotations

import dataclasses
import socket
import threading
from types import SimpleNamespace

import pytest

from kvbridge.cache_server.module import ModuleSpec
from kvbridge.cache_server.remote_store import RemoteStore
from kvbridge.cache_server.server import CacheServer
from kvbridge.gui import handlers as h
from kvbridge.gui import store_panel as sp
from kvbridge.gui.page_map_chart import PAGE_MAP_MAX_CELLS, PAGE_STATES, page_map_figure
from kvbridge.gui.server_panel import ENABLE_EVENTS, KV_EVENTS_MODULE, pressure_line, server_view
from kvbridge.store import ObjectMeta, TieredStore

pytestmark = pytest.mark.timeout(60)
BLOB = b"k" * 70_000   # two 64 KiB pages


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def meta() -> ObjectMeta:
    return ObjectMeta("ns", 1, bytes(16))


class RunningServer:
    """An in-process CacheServer on a free loopback port, serving on a thread until stop()."""

    def __init__(self, settings, specs) -> None:
        self.server = CacheServer(settings, url=f"tcp://127.0.0.1:{free_port()}", module_specs=specs)
        self.url = self.server.bind()
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(timeout=10)
        self.server.close()


@pytest.fixture
def server_settings(make_settings):
    return make_settings(l1_bytes=8 << 20, cache_server_page_bytes=64 << 10)


def engine_state(settings, store) -> h.AppState:
    """An AppState whose engine holds `store`; the panel only reads the engine's store."""
    state = h.AppState(settings)
    state.engine = SimpleNamespace(store=store)
    return state


@pytest.fixture
def connected(server_settings, make_settings, tmp_path):
    """(state, server) with the kv_events module loaded and a real RemoteStore as the engine's store."""
    running = RunningServer(server_settings, [ModuleSpec(KV_EVENTS_MODULE, {})])
    settings = make_settings(store_url=running.url, cache_server_timeout=3.0, l2_dir=str(tmp_path / "engine-l2"))
    store = RemoteStore.from_settings(settings, namespace="ns")
    yield engine_state(settings, store), running
    store.close()
    running.stop()


def test_the_section_shows_server_modules_clients_pressure_and_page_map(connected):
    state, running = connected
    assert state.engine.store.put(key(1), BLOB, meta())
    state.engine.store.flush()   # its commit and the disk writer's short lease are over: a plain object page
    view = server_view(state, sp.store_stats(state))
    assert view.shown
    text = view.summary
    assert f"`{running.url}`" in text and "connected" in text and "shared memory" in text
    assert running.server.server_id[:8] in text and "tiers L1 → L2" in text
    assert "| kv_events | storage | --server-module |" in text
    for builtin in ("lookup", "storage", "management", "metrics"):
        assert f"| {builtin} |" in text and "built-in" in text
    assert "(this engine)" in text and "engine, pid" in text and "dropped after 2 min 0 s without a request" in text
    assert '<span class="kvb-level kvb-level-ok">OK</span>' in text and "of 128 pages" in text

    heatmap, *legend = view.page_map.data
    assert heatmap.type == "heatmap" and sum(len(row) for row in heatmap.z) == 128
    cells = [c for row in heatmap.z for c in row]
    # one object of two pages, two pages lent ahead of the engine's next lone store (a grant), the rest free
    assert cells.count(1) == 2 and cells.count(3) == 2 and cells.count(0) == 124
    assert [t.name for t in legend] == ["free (124)", "object (2)", "leased object (0)", "pending write (2)",
                                        "quarantined (0)"]
    assert any("pressure OK" in a.text for a in view.page_map.layout.annotations)


def test_the_event_log_lists_stores_and_removals_newest_first(connected):
    state, _ = connected
    assert state.engine.store.put(key(7), BLOB, meta())
    state.engine.store.clear("L1")
    stats = sp.store_stats(state)
    events = server_view(state, stats).events
    for _ in range(50):   # the publisher thread records an event a moment after the store reports it
        if "| removed |" in events:
            break
        threading.Event().wait(0.05)
        events = server_view(state, stats).events
    assert "**Event log** (kv_events:" in events and "subscribe to `tcp://127.0.0.1:" in events
    rows = [line for line in events.splitlines() if f"`{key(7).hex()[:16]}`" in line]
    seen = [(row.split("|")[3].strip(), row.split("|")[4].strip()) for row in rows]
    # newest first; the background writer also stores the object in L2, before or after the clear
    assert seen.index(("removed", "L1")) < seen.index(("stored", "L1"))
    assert "68.4 KiB" in rows[0]


def test_without_kv_events_the_log_says_how_to_turn_it_on(server_settings, make_settings, tmp_path):
    running = RunningServer(server_settings, [])
    store = RemoteStore.from_settings(make_settings(store_url=running.url, l2_dir=str(tmp_path / "e")))
    try:
        state = engine_state(make_settings(store_url=running.url), store)
        view = server_view(state, sp.store_stats(state))
        assert view.shown and "| kv_events |" not in view.summary
        assert "Event log:** off" in view.events
        assert ENABLE_EVENTS == '--server-module \'{"module_path": "kvbridge.cache_server.plugin_modules.kv_events"}\''
        assert f"python -m kvbridge cache-server {ENABLE_EVENTS}" in view.events
    finally:
        store.close()
        running.stop()


def test_a_server_that_went_away_is_one_line_and_the_panel_still_works(server_settings, make_settings, tmp_path):
    running = RunningServer(server_settings, [ModuleSpec(KV_EVENTS_MODULE, {})])
    settings = make_settings(store_url=running.url, cache_server_timeout=2.0, l2_dir=str(tmp_path / "e"))
    store = RemoteStore.from_settings(settings)
    state = engine_state(settings, store)
    try:
        assert "cannot be reached" not in server_view(state, sp.store_stats(state)).summary
        running.stop()
        stats = sp.store_stats(state)
        view = server_view(state, stats)
        assert view.shown and "cannot be reached" in view.summary and running.url in view.summary
        assert f"python -m kvbridge cache-server --url {running.url}" in view.summary
        assert f"./scripts/cache_server.sh start --url {running.url}" in view.summary
        assert "| kv_events |" not in view.summary and view.events == ""
        assert not view.page_map.data   # the empty figure with its hint
        assert "| L1 | 0 |" in sp.store_markdown(stats)   # the tier table still renders
    finally:
        store.close()


def test_nothing_listening_is_the_same_line(make_settings):
    url = f"tcp://127.0.0.1:{free_port()}"
    settings = make_settings(store_url=url, cache_server_timeout=1.0)
    store = RemoteStore.from_settings(settings)
    try:
        view = server_view(engine_state(settings, store), store.stats())
        assert "cannot be reached" in view.summary and url in view.summary
    finally:
        store.close()


def test_an_embedded_store_shows_no_server_section(make_settings):
    settings = make_settings()
    store = TieredStore.from_settings(settings)
    try:
        state = engine_state(settings, store)
        assert server_view(state, sp.store_stats(state)).shown is False
    finally:
        store.close()
    assert server_view(h.AppState(settings), None).shown is False   # no engine, no KVB_STORE_URL
    waiting = server_view(h.AppState(dataclasses.replace(settings, store_url="tcp://127.0.0.1:5555")), None)
    assert waiting.shown and "tcp://127.0.0.1:5555" in waiting.summary and "Connect an engine" in waiting.summary


@pytest.mark.parametrize("level", ["SOFT", "HARD", "CRITICAL"])
def test_a_pressure_level_is_highlighted(level):
    line = pressure_line({"level": level, "total_pages": 10, "page_bytes": 1024, "usage_ratio": 0.95,
                          "refused": {"pressure": 2, "no_space": 1}})
    assert f'kvb-level-{level.lower()}">{level}</span>' in line and "95.0 %" in line and "refused 3" in line
    fig = page_map_figure(bytes(10), level)
    assert fig.layout.annotations[0].text == f"<b>pressure {level}</b>"


def test_the_page_map_golden_case_and_a_large_pool():
    fig = page_map_figure(bytes([0, 1, 2, 3, 4, 0]), "OK", 65536)
    assert fig.data[0].z == ((0, 1, 2, 3, 4, 0),) or [list(r) for r in fig.data[0].z] == [[0, 1, 2, 3, 4, 0]]
    assert [t.name for t in fig.data[1:]] == ["free (2)", "object (1)", "leased object (1)", "pending write (1)",
                                              "quarantined (1)"]
    assert "6 pages of 64.0 KiB" in fig.layout.title.text and fig.data[0].text[0][2] == "page 2: leased object"

    pages = bytearray(3 * PAGE_MAP_MAX_CELLS)   # three pages per cell; a cell shows its busiest page
    pages[4] = 1
    pages[5] = 4
    fig = page_map_figure(bytes(pages))
    cells = [c for row in fig.data[0].z for c in row]
    assert len(cells) == PAGE_MAP_MAX_CELLS and cells[:3] == [0, 4, 0] and cells.count(0) == PAGE_MAP_MAX_CELLS - 1
    assert "a cell is 3 pages" in fig.layout.title.text and fig.data[0].text[0][1] == "pages 3–5: quarantined"
    assert len(PAGE_STATES) == 5 and not page_map_figure(None).data


def test_the_page_builds_with_the_section_before_an_engine_connects(make_settings):
    from kvbridge.gui.app import build_app

    state = h.AppState(make_settings(store_url="tcp://127.0.0.1:5555"))
    demo = build_app(state.settings, state)
    blocks = {getattr(block, "elem_id", None): block for block in demo.blocks.values()}
    assert {"kvb-server-panel", "kvb-server", "kvb-plot-pages", "kvb-server-events"} <= set(blocks)
    assert blocks["kvb-server-panel"].visible and "tcp://127.0.0.1:5555" in blocks["kvb-server"].value
