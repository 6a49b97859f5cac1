"""What the browser tests share: a Chromium found by kvbridge.gui.chromium.find_chromium (apt's
/usr/bin/chromium, else playwright's own build, else the snap) driven by the PyPI `playwright` package at
the default window size, the skips that name what is missing and the command that installs it, and the
checks every page must pass: settings labelled in words with their KVB_ variable beneath, table headers
on one line. The processes they drive come from process_helpers.
"""
from __future__ import annotations

import re

import pytest

from kvbridge.gui.labels import SETTING_CLASS
from kvbridge.gui.chromium import MISSING as CHROMIUM_MISSING, find_chromium
from kvbridge.gui.screenshot import CHROMIUM_ARGS, WINDOW  # noqa: F401 (re-exported: one home)
from kvbridge.settings import EMBEDDED_MODEL_PATH, env_name
from process_helpers import clean_env, free_port, start_kvbridge, stop, wait_for  # noqa: F401 (re-exported)

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # setup installs it; say so instead of failing at import
    expect = sync_playwright = None

CHROMIUM = find_chromium()   # None: every browser test skips, saying what to install
BROWSER_MARKS = [
    pytest.mark.browser,
    pytest.mark.live,
    pytest.mark.skipif(CHROMIUM is None, reason=CHROMIUM_MISSING),
    pytest.mark.skipif(sync_playwright is None,
                       reason="the playwright package is not installed (requirements-test.txt)"),
    pytest.mark.skipif(not EMBEDDED_MODEL_PATH.is_file(), reason=f"embedded model {EMBEDDED_MODEL_PATH} missing"),
]
VARIABLE = re.compile(r"^KVB_[A-Z0-9_]+")


def answers(url: str) -> bool:
    """Whether the page is served yet; a server still starting may also answer slowly (a read timeout)."""
    import requests

    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False

# Each visible settings input as drawn: its id, the label text above it and the hint beneath (Gradio's info).
_SETTINGS_JS = """(els) => els.filter(e => e.checkVisibility()).map(e => {
    const text = (sel) => { const n = e.querySelector(sel); return n ? n.textContent.trim() : ""; };
    return {id: e.id, label: text('[data-testid="block-info"], .label-text'), hint: text('.info-text')};
})"""
# Every visible label on the page, settings or not.
_LABELS_JS = """(els) => els.filter(e => e.checkVisibility()).map(e => e.textContent.trim())"""
# A table's header cells whose text is clipped or drawn on more than one line.
_WRAPPED_HEADERS_JS = """(table) => [...table.querySelectorAll('th')].map(th => {
    const text = th.querySelector('.header') || th;
    const style = getComputedStyle(text);
    const line = parseFloat(style.lineHeight) || 1.5 * parseFloat(style.fontSize);
    return {name: text.textContent.trim(), height: text.getBoundingClientRect().height, line: line,
            clipped: text.scrollWidth > text.clientWidth};
}).filter(h => h.clipped || h.height > 1.5 * h.line)"""


def check_setting_labels(page) -> list[dict]:
    """Every visible settings input has a label in words (not a KVB_ name) and its KVB_ variable as the hint;
    no other visible label on the page is a variable name either. Returns the inputs checked."""
    fields = page.locator(f".{SETTING_CLASS}").evaluate_all(_SETTINGS_JS)
    assert fields, "no settings input is visible"
    for field in fields:
        assert field["label"] and not VARIABLE.match(field["label"]), field
        assert VARIABLE.match(field["hint"]), field
        name = field["id"].removeprefix("kvb-field-")
        if name != field["id"]:   # the engine panel's fields: the hint names the field's own variable
            assert field["hint"].startswith(env_name(name)), field
    labels = page.locator('[data-testid="block-info"], .label-text').evaluate_all(_LABELS_JS)
    assert not [label for label in labels if VARIABLE.match(label)], labels
    return fields


def check_headers_on_one_line(page, table_selector: str) -> list[str]:
    """Each header of the table is drawn on one line, nothing clipped (a narrow table scrolls sideways);
    returns the header names."""
    table = page.locator(table_selector)
    expect(table.locator("th").first).to_be_visible()
    wrapped = table.evaluate(_WRAPPED_HEADERS_JS)
    assert wrapped == [], f"headers of {table_selector} wrapped or clipped: {wrapped}"
    return [name.strip() for name in table.locator("th .header").all_text_contents()]
