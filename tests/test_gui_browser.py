"""End to end in a real headless Chromium at the default window size: start `python -m kvbridge gui`,
whose configured engine (the embedded llama.cpp) connects on its own, so the first click is Run: Document
Q&A in all three modes, stopped once and run again; while it streams, every engine's settings are
checked to be labelled in words with their KVB_ variable beneath and a bad one refused by name; then
charts and table, export, the store panel and the free prompt, a screenshot in the test's folder, and
SIGTERM stops the server.

Drives the Chromium browser_helpers finds through the PyPI `playwright` package. Kept small for its CPU:
one GUI process, one page load, a document of about 300 tokens, two requests per mode, and waits on
what the page shows, never fixed sleeps. README's picture comes from a real default run instead:
`python -m kvbridge.gui.screenshot`.
"""
from __future__ import annotations

import csv
import re
import signal
import socket

import pytest

from browser_helpers import (BROWSER_MARKS, CHROMIUM, CHROMIUM_ARGS, WINDOW, answers, check_headers_on_one_line,
                             check_setting_labels, clean_env, expect, free_port, start_kvbridge, stop,
                             sync_playwright, wait_for)
from kvbridge.backends import resolve_engine
from kvbridge.gui.handlers import engine_choices, fields_for_engine

# About 300 tokens (ten chunks of 32): the cold prefills stay short on 2 busy cores, yet the reuse is visible.
SHORT_DOC = "# Garden rota\n\n" + " ".join(
    f"Rule {i}: the {['north', 'south', 'east', 'west'][i % 4]} bed is watered on day {i % 7} by team {i % 5}."
    for i in range(18))
TINY_DOC = SHORT_DOC[:600]
N_REQUESTS = 2
FREE_PROMPT = TINY_DOC + "\n\nQuestion: which bed is watered on day 3?\nAnswer:"

pytestmark = BROWSER_MARKS


def nothing_listens(port: int) -> bool:
    """As scripts/stop.sh checks it: a connection is refused (TIME_WAIT sockets may linger, harmlessly)."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture
def gui_server(tmp_path):
    """The GUI as a person starts it, on a free port, with a private L2, input/ and output/."""
    port = free_port()
    (tmp_path / "input").mkdir()
    (tmp_path / "input" / "garden.md").write_text(SHORT_DOC, encoding="utf-8")
    log_path = tmp_path / "gui.log"
    proc = start_kvbridge(["gui"], clean_env(
        KVB_PORT=str(port), KVB_HOST="127.0.0.1", KVB_ENGINE="llamacpp", KVB_L2_DIR=str(tmp_path / "l2"),
        KVB_CHUNK_SIZE="32", KVB_CTX_SIZE="1024", KVB_N_PREDICT="4", KVB_L1_BYTES="256MiB", KVB_L2_BYTES="512MiB",
        KVB_INPUT_DIR=str(tmp_path / "input"), KVB_OUTPUT_DIR=str(tmp_path / "output")), log_path)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for(lambda: answers(url), f"the GUI did not answer on {url}", log_path, proc)
        yield {"url": url, "port": port, "proc": proc, "log": log_path, "output": tmp_path / "output",
               "screenshot": tmp_path / "screenshot-gui.png"}
    finally:
        stop(proc)


def test_gui_end_to_end(gui_server):
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=WINDOW)
            elsewhere: list[str] = []  # the page must work offline: nothing fetched from other hosts
            page.on("request", lambda request: None if request.url.startswith((gui_server["url"], "data:", "blob:"))
                    else elsewhere.append(request.url))
            page.goto(gui_server["url"])
            drive_the_page(page, gui_server)
            # A reload shows the server's engine and results again; nothing connects a second time.
            page.reload()
            expect(page.locator("#kvb-status")).to_contain_text("FULL", timeout=30_000)
            expect(page.locator("#kvb-results-table [role=row][data-index]")).to_have_count(3 * N_REQUESTS)
            assert gui_server["log"].read_text().count("Run is ready on the page") == 1   # main() says it once
            assert elsewhere == []
        finally:
            browser.close()

    # SIGTERM (what scripts/stop.sh sends): the run is stopped, the store flushed, the port freed.
    proc = gui_server["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert "Stopped." in gui_server["log"].read_text()
    assert nothing_listens(gui_server["port"])


def drive_the_page(page, server) -> None:
    long = 300_000  # ms: loading the model and a prefill on 2 busy cores can take a while
    status = page.locator("#kvb-status")
    # The engine the settings name connects on its own; the page says so while the model loads.
    expect(status).to_contain_text(re.compile("Connecting to|FULL"), timeout=30_000)
    expect(status).not_to_contain_text("Not connected")

    # Document Q&A on a short document from input/, N_REQUESTS in each of the three modes. Run is the first
    # button pressed: it waits for the connect if the model is still loading.
    page.click("#kvb-document input")
    page.get_by_role("option", name="input/garden.md").click()
    page.fill("#kvb-n-requests input", str(N_REQUESTS))
    rows = page.locator("#kvb-results-table [role=row][data-index]")
    run_msg = page.locator("#kvb-run-msg")

    # The page stays responsive while a run streams: Stop ends it after the current request.
    page.click("#kvb-run")
    expect(run_msg).to_contain_text("1 requests done", timeout=long)
    page.click("#kvb-stop")
    expect(run_msg).to_contain_text("Stopped", timeout=long)
    assert 1 <= rows.count() < 3 * N_REQUESTS
    expect(status).to_contain_text("FULL")
    expect(status).to_contain_text("Namespace")

    page.click("#kvb-run")
    check_the_engine_panel(page)   # while the run streams
    expect(run_msg).to_contain_text("Finished", timeout=long)
    expect(rows).to_have_count(3 * N_REQUESTS)
    modes = page.locator('#kvb-results-table [role=gridcell][data-col="0"]').all_inner_texts()
    assert sorted(m.strip() for m in modes) == sorted(["cold", "native", "lmcache"] * N_REQUESTS)
    expect(page.locator("#kvb-summary")).to_contain_text("faster than cold")
    assert "mode" in check_headers_on_one_line(page, "#kvb-results-table")

    ttft = page.locator("#kvb-plot-ttft")
    expect(ttft.locator(".scatterlayer .trace")).to_have_count(3)
    expect(ttft.locator(".scatterlayer .trace .points path")).to_have_count(3 * N_REQUESTS)
    assert [t.strip() for t in ttft.locator(".legendtext").all_text_contents()] == ["cold", "native", "lmcache"]
    speedup = page.locator("#kvb-plot-speedup")
    expect(speedup.locator(".barlayer .trace")).to_have_count(2)  # native and lmcache against cold
    expect(speedup).to_contain_text("×")
    expect(page.locator("#kvb-plot-hits .barlayer .trace")).to_have_count(3)
    expect(page.locator("#kvb-plot-store .barlayer .trace")).to_have_count(1)
    stages = page.locator("#kvb-plot-stages")   # a stacked bar per warm request, native's beside lmcache's
    expect(stages.locator(".legendtext").first).to_be_visible()
    legend = [t.strip() for t in stages.locator(".legendtext").all_text_contents()]
    assert {"tokenize", "suffix prefill", "first token"} <= set(legend)

    # Export: CSV, JSON and the HTML report land in KVB_OUTPUT_DIR.
    page.click("#kvb-export")
    expect(page.locator("#kvb-export-msg")).to_contain_text(f"Exported {3 * N_REQUESTS} requests", timeout=60_000)
    exported = {p.suffix: p for p in server["output"].iterdir()}
    assert set(exported) == {".csv", ".json", ".html"}
    with exported[".csv"].open(newline="", encoding="utf-8") as f:
        assert len(list(csv.DictReader(f))) == 3 * N_REQUESTS
    assert "Plotly" in exported[".html"].read_text(encoding="utf-8")

    # The RAG scenario asks about a corpus, not a document: the page swaps the pickers, and back again.
    page.click("#kvb-scenario input")
    page.get_by_role("option", name="RAG with shuffled passages").click()
    expect(page.locator("#kvb-corpus")).to_be_visible()
    expect(page.locator("#kvb-document")).to_be_hidden()
    page.click("#kvb-corpus input")
    expect(page.get_by_role("option", name="clinic")).to_be_visible()
    page.keyboard.press("Escape")
    page.click("#kvb-scenario input")
    page.get_by_role("option", name="Document Q&A").click()
    expect(page.locator("#kvb-document")).to_be_visible()
    expect(page.locator("#kvb-corpus")).to_be_hidden()

    # Store panel: the tier list is the store's own (L1 first); Clear asks first; Restart engine keeps the store.
    page.click("#kvb-clear")
    expect(page.get_by_text("Really clear L1?")).to_be_visible()
    page.click("#kvb-confirm-clear")
    expect(page.locator("#kvb-store-msg")).to_contain_text("L1 cleared", timeout=30_000)
    l1_row = page.locator("#kvb-store tbody tr").first.locator("td")
    expect(l1_row.nth(0)).to_have_text("L1")
    expect(l1_row.nth(1)).to_have_text("0")  # objects in L1 after the clear
    page.click("#kvb-restart")
    expect(page.locator("#kvb-store-msg")).to_contain_text("Engine restarted", timeout=long)

    # The free prompt: sent twice in lmcache mode, the second one is restored from L1.
    page.locator("#kvb-prompt").get_by_role("textbox").fill(FREE_PROMPT)
    page.click("#kvb-send")
    expect(page.locator("#kvb-prompt-msg")).to_contain_text("TTFT", timeout=long)
    page.click("#kvb-send")
    expect(page.locator("#kvb-prompt-msg")).to_contain_text("tier L1", timeout=long)
    assert page.locator("#kvb-answer").get_by_role("textbox").input_value().strip()

    check_headers_on_one_line(page, "#kvb-results-table")
    page.screenshot(path=str(server["screenshot"]), full_page=True)   # the test's own folder, never Docs/
    assert server["screenshot"].stat().st_size > 50_000


def check_the_engine_panel(page) -> None:
    """Every engine's settings read as words with the KVB_ variable beneath; switching engines needs no
    restart; a bad setting is refused by name and the connected engine stays."""
    engines = page.locator("#kvb-engine")
    page.get_by_text("Store and generation settings").click()   # the closed accordion opened
    expect(page.locator("#kvb-field-chunk_size")).to_be_visible()
    for label, key in engine_choices():
        engines.get_by_text(label, exact=True).click()
        own = [f"kvb-field-{name}" for name in sorted(fields_for_engine(key))]
        for field_id in own:
            expect(page.locator(f"#{field_id}")).to_be_visible()
        shown = {f["id"] for f in check_setting_labels(page)}
        assert set(own) <= shown, (key, shown)

    # the cloud engine warns that prompts leave the machine
    engines.get_by_text(resolve_engine("cloud").label).click()
    expect(page.locator("#kvb-notice")).to_contain_text("leave this machine")
    expect(page.locator("#kvb-field-cloud_api_key_env")).to_be_visible()
    engines.get_by_text(resolve_engine("llamacpp").label).click()
    expect(page.locator("#kvb-field-cloud_api_key_env")).to_be_hidden()
    expect(page.locator("#kvb-notice")).not_to_contain_text("leave this machine")
    expect(page.locator("#kvb-field-ctx_size")).to_contain_text("Context size (tokens)")
    expect(page.locator("#kvb-field-ctx_size")).to_contain_text("KVB_CTX_SIZE")

    # A bad setting is a readable message naming the variable, not a stack trace; nothing is disconnected.
    ctx = page.locator("#kvb-field-ctx_size").get_by_role("textbox")
    ctx.fill("lots")
    page.click("#kvb-connect")
    message = page.locator("#kvb-engine-msg")
    expect(message).to_contain_text("KVB_CTX_SIZE", timeout=30_000)
    expect(message).not_to_contain_text("Traceback")
    expect(page.locator("#kvb-status")).to_contain_text("FULL")
    ctx.fill("1024")
