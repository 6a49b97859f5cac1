"""What the browser tests share: Debian's Chromium driven by the PyPI `playwright` package (never
`playwright install`) and the skips that name what is missing. The processes they drive come from
process_helpers.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.settings import EMBEDDED_MODEL_PATH
from process_helpers import answers, clean_env, free_port, start_kvbridge, stop, wait_for  # noqa: F401 (re-exported)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic"]

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # setup installs it; say so instead of failing at import
    expect = sync_playwright = None

BROWSER_MARKS = [
    pytest.mark.browser,
    pytest.mark.live,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="/usr/bin/chromium missing (apt-get install chromium)"),
    pytest.mark.skipif(sync_playwright is None, reason="the playwright package is not installed (requirements.txt)"),
    pytest.mark.skipif(not EMBEDDED_MODEL_PATH.is_file(), reason=f"embedded model {EMBEDDED_MODEL_PATH} missing"),
]
