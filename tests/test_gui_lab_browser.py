"""The KV cache lab tab in a real headless Chromium at the default window size: `python -m kvbridge gui`
as a person starts it, the lab tab opened, its settings labelled in words with their KVB_ variable
beneath and its tables' headers each on one line, a bad KV budget refused with the setting named, then
the Priority burst run at its own defaults on the embedded model: the block map shows the low chats'
blocks while they run, the timeline's event table shows a preemption and a swap-in, every request
finishes (the filled tables' headers still on one line, a screenshot in the test's folder), and SIGTERM
stops the GUI (closing the lab's scheduler) cleanly.
"""
from __future__ import annotations

import pytest

from browser_helpers import (BROWSER_MARKS, CHROMIUM, CHROMIUM_ARGS, WINDOW, answers, check_headers_on_one_line,
                             check_setting_labels, clean_env, expect, free_port, start_kvbridge, stop,
                             sync_playwright, wait_for)
from kvbridge.gui.lab import EVENT_COLUMNS, REQUEST_COLUMNS, RESULT_COLUMNS

pytestmark = [*BROWSER_MARKS, pytest.mark.timeout(420)]
LONG = 240_000   # ms: the model loads and three document chats prefill on 2 busy cores


@pytest.fixture
def gui_server(tmp_path):
    port = free_port()
    log_path = tmp_path / "gui.log"
    proc = start_kvbridge(["gui"], clean_env(KVB_PORT=str(port), KVB_HOST="127.0.0.1", KVB_ENGINE="llamacpp",
                                             KVB_L2_DIR=str(tmp_path / "l2"), KVB_CHUNK_SIZE="32",
                                             KVB_CTX_SIZE="2048", KVB_OUTPUT_DIR=str(tmp_path / "output"),
                                             KVB_INPUT_DIR=str(tmp_path / "input")), log_path)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for(lambda: answers(url), f"the GUI did not answer on {url}", log_path, proc)
        yield {"url": url, "proc": proc, "log": log_path, "screenshot": tmp_path / "screenshot-lab.png"}
    finally:
        stop(proc)


def test_the_lab_shows_a_priority_burst_preempting_and_resuming(gui_server):
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=WINDOW)
            page.goto(gui_server["url"])
            page.get_by_role("tab", name="KV cache lab").click()
            expect(page.locator("#kvb-lab-about")).to_contain_text("preempted", timeout=30_000)
            expect(page.locator("#kvb-lab-requests")).to_contain_text("urgent 1")
            lab_fields = {f["id"] for f in check_setting_labels(page)}
            assert {"kvb-lab-cells", "kvb-lab-running", "kvb-lab-soft", "kvb-lab-hard",
                    "kvb-lab-critical"} <= lab_fields
            assert check_headers_on_one_line(page, "#kvb-lab-requests") == REQUEST_COLUMNS

            cells = page.locator("#kvb-lab-cells input")
            budget = cells.input_value()
            cells.fill("64")
            page.click("#kvb-lab-run")
            expect(page.locator("#kvb-lab-msg")).to_contain_text("KVB_SCHED_KV_CELLS", timeout=30_000)
            cells.fill(budget)

            page.click("#kvb-lab-run")
            expect(page.locator("#kvb-lab-msg")).to_contain_text("Started", timeout=30_000)
            blocks = page.locator("#kvb-lab-blocks")
            expect(blocks.locator(".legendtext").filter(has_text="doc chat").first).to_be_visible(timeout=LONG)
            expect(page.locator("#kvb-lab-status")).to_contain_text("Pressure")
            expect(page.locator("#kvb-lab-pressure")).to_contain_text("% free")
            events = page.locator("#kvb-lab-events")
            expect(events).to_contain_text("preempt", timeout=LONG)
            expect(events).to_contain_text("swap-in", timeout=LONG)
            expect(page.locator("#kvb-lab-timeline .legendtext").filter(has_text="preempt")).to_have_count(1)
            expect(page.locator("#kvb-lab-msg")).to_contain_text("finished in", timeout=LONG)
            expect(page.locator("#kvb-lab-msg")).to_contain_text("5 of 5 requests done")
            expect(page.locator("#kvb-lab-status")).to_contain_text("running (0)")
            assert check_headers_on_one_line(page, "#kvb-lab-results") == RESULT_COLUMNS
            assert check_headers_on_one_line(page, "#kvb-lab-events") == EVENT_COLUMNS
            page.screenshot(path=str(gui_server["screenshot"]), full_page=True)
            assert gui_server["screenshot"].stat().st_size > 50_000
        finally:
            browser.close()
    assert stop(gui_server["proc"]) == 0
    assert "Stopped." in gui_server["log"].read_text()


def test_gui_with_serve_shows_the_endpoints_requests_in_the_lab(tmp_path):
    """`gui --serve`: the OpenAI-compatible endpoint beside the GUI in one process; a request sent with
    the openai SDK shows up in the lab tab's events while the page watches."""
    import openai

    port, serve_port = free_port(), free_port()
    log_path = tmp_path / "gui.log"
    proc = start_kvbridge(["gui", "--serve"], clean_env(
        KVB_PORT=str(port), KVB_SERVE_PORT=str(serve_port), KVB_HOST="127.0.0.1", KVB_L2_DIR=str(tmp_path / "l2"),
        KVB_CHUNK_SIZE="32", KVB_CTX_SIZE="1024", KVB_SCHED_KV_CELLS="2048", KVB_OUTPUT_DIR=str(tmp_path / "output"),
        KVB_INPUT_DIR=str(tmp_path / "input")), log_path)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for(lambda: answers(url) and f"ready on http://127.0.0.1:{serve_port}" in log_path.read_text(),
                 "the GUI with serve did not start", log_path, proc, timeout_s=180)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport=WINDOW)
                page.goto(url)
                page.get_by_role("tab", name="KV cache lab").click()
                expect(page.locator("#kvb-lab-msg")).to_contain_text("Watching the serve endpoint", timeout=30_000)
                client = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port}/v1", api_key="x", max_retries=0)
                answer = client.chat.completions.create(model="x", temperature=0, max_tokens=16,
                                                        messages=[{"role": "user", "content": "Name a river."}])
                assert answer.choices[0].message.content
                events = page.locator("#kvb-lab-events")
                expect(events).to_contain_text("serve chat", timeout=30_000)
                expect(events).to_contain_text("finish", timeout=30_000)
            finally:
                browser.close()
    finally:
        assert stop(proc) == 0
    assert "Stopped." in log_path.read_text()
