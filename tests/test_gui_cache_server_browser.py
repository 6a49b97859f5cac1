"""In a real headless Chromium: a real cache server (`python -m kvbridge cache-server` with kv_events),
the GUI started with KVB_STORE_URL pointing at it, the embedded engine connecting on its own: the store
panel shows the server's modules, the L1 pressure level, the page map and the event log.

Drives the Chromium browser_helpers finds through the PyPI `playwright` package, like test_gui_browser.py.
"""
from __future__ import annotations

import json

import pytest

from browser_helpers import (BROWSER_MARKS, CHROMIUM, CHROMIUM_ARGS, answers, clean_env, expect, free_port,
                             start_kvbridge, stop, sync_playwright, wait_for)

KV_EVENTS = json.dumps({"module_path": "kvbridge.cache_server.plugin_modules.kv_events"})
PROMPT = "# Garden rota\n\n" + " ".join(f"Rule {i}: the bed is watered on day {i % 7}." for i in range(10)) + \
    "\n\nQuestion: which day is rule 3?\nAnswer:"

pytestmark = [*BROWSER_MARKS, pytest.mark.timeout(300)]


@pytest.fixture
def cache_server(tmp_path):
    """The cache server as an operator starts it, with the kv_events module, on a free loopback port."""
    url = f"tcp://127.0.0.1:{free_port()}"
    log_path = tmp_path / "cache-server.log"
    proc = start_kvbridge(["cache-server", "--url", url, "--server-module", KV_EVENTS], clean_env(
        KVB_L2_DIR=str(tmp_path / "server-l2"), KVB_L1_BYTES="16MiB", KVB_CACHE_SERVER_PAGE_BYTES="64KiB"), log_path)
    try:
        wait_for(lambda: "cache server ready on" in log_path.read_text(), "the cache server was not ready",
                 log_path, proc, timeout_s=60)
        yield {"url": url, "proc": proc, "log": log_path}
    finally:
        stop(proc)


@pytest.fixture
def gui_server(tmp_path, cache_server):
    """The GUI as a person starts it, its engines pointed at the cache server by KVB_STORE_URL."""
    port = free_port()
    (tmp_path / "input").mkdir()
    log_path = tmp_path / "gui.log"
    proc = start_kvbridge(["gui"], clean_env(
        KVB_PORT=str(port), KVB_HOST="127.0.0.1", KVB_ENGINE="llamacpp", KVB_STORE_URL=cache_server["url"],
        KVB_L2_DIR=str(tmp_path / "gui-l2"), KVB_CHUNK_SIZE="32", KVB_CTX_SIZE="1024", KVB_N_PREDICT="4",
        KVB_INPUT_DIR=str(tmp_path / "input"), KVB_OUTPUT_DIR=str(tmp_path / "output")), log_path)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for(lambda: answers(url), f"the GUI did not answer on {url}", log_path, proc)
        yield {"url": url, "proc": proc, "log": log_path}
    finally:
        stop(proc)


def test_the_store_panel_shows_the_cache_server(gui_server, cache_server):
    long = 180_000   # ms: loading the model and a prefill on 2 busy cores
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(gui_server["url"])
            server = page.locator("#kvb-server")
            expect(server).to_contain_text(cache_server["url"], timeout=30_000)   # where it is, connected or not
            expect(page.locator("#kvb-status")).to_contain_text("FULL", timeout=long)   # connected on its own
            expect(server).to_contain_text("connected", timeout=30_000)
            for module in ("lookup", "storage", "management", "metrics", "kv_events"):
                expect(server.locator("table").first).to_contain_text(module)
            expect(server).to_contain_text("(this engine)")
            expect(server.locator(".kvb-level")).to_have_text("OK")
            expect(server.locator(".kvb-level")).to_have_css("background-color", "rgb(22, 163, 74)")   # highlighted

            pages = page.locator("#kvb-plot-pages")
            expect(pages.locator(".heatmaplayer image")).to_have_count(1)
            expect(pages.locator(".annotation-text")).to_contain_text("pressure OK")
            legend = [t.strip() for t in pages.locator(".legendtext").all_text_contents()]
            assert [t.split(" (")[0] for t in legend] == ["free", "object", "leased object", "pending write",
                                                          "quarantined"], legend

            # a prompt in lmcache mode stores its chunks on the server: the event log shows them
            page.locator("#kvb-prompt").get_by_role("textbox").fill(PROMPT)
            page.click("#kvb-send")
            expect(page.locator("#kvb-prompt-msg")).to_contain_text("TTFT", timeout=long)
            page.get_by_role("button", name="Refresh").click()   # stores finish after the answer is shown
            events = page.locator("#kvb-server-events")
            expect(events).to_contain_text("Event log", timeout=30_000)
            expect(events.locator("table")).to_contain_text("stored", timeout=30_000)
            expect(pages.locator(".legendtext").nth(1)).not_to_have_text("object (0)")
        finally:
            browser.close()

    assert stop(gui_server["proc"]) == 0
    assert "Stopped." in gui_server["log"].read_text()
    assert stop(cache_server["proc"]) == 0
