"""`python -m kvbridge.gui.screenshot`: the README's picture of the GUI, taken from a real run.

Place in the flow: default Settings -> the GUI served in this process on a free loopback port, with a
private temporary L2, input/ and output/, the default engine connecting on start as `kvbridge gui` does ->
Chromium (tests/browser_helpers' lookup: apt's, playwright's own or the snap), driven by playwright at
the default window size, clicks Run on the default scenario in the default modes at once, as a newcomer
would (Run waits for the connect) -> waits for "Finished" -> one full-page PNG (Docs/screenshot-gui.png
unless --out says otherwise).

Deliberately not `python -m kvbridge gui` in a subprocess: that reads the project's `.env`, and the
picture must show what a new user gets, not this machine's settings. Needs the embedded model
(./scripts/setup.sh), the playwright package (requirements-test.txt) and a Chromium
(scripts/install_chromium.sh), as the browser tests do; it says which is missing instead of failing half way.
"""
from __future__ import annotations

import argparse
import re
import socket
import sys
import tempfile
import time
from pathlib import Path

from kvbridge.gui.chromium import APT_CHROMIUM, INSTALL_ADVICE, find_chromium
from kvbridge.settings import WORK_DIR, Settings
from kvbridge.settings.cmdline import Parser

CHROMIUM = find_chromium() or APT_CHROMIUM   # the default of --chromium; a missing one is named by main()
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic"]
WINDOW = {"width": 1280, "height": 800}   # the default window: the screenshot's and the browser tests'
SCREENSHOT = WORK_DIR / "Docs" / "screenshot-gui.png"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_default_scenario(page, timeout_s: float) -> str:
    """Run the preselected scenario as a newcomer would, the first click on the page (the default engine
    connects on start; Run waits for it); the run's last message."""
    from playwright.sync_api import expect

    expect(page.locator("#kvb-status")).to_contain_text(re.compile("Connecting to|Namespace"), timeout=60_000)
    page.click("#kvb-run")
    run_msg = page.locator("#kvb-run-msg")
    expect(run_msg).to_contain_text(re.compile("Finished|⚠️"), timeout=timeout_s * 1000)   # done, or an error
    message = run_msg.inner_text().strip()
    if not message.startswith("Finished"):
        raise RuntimeError(f"the run did not finish: {message}")
    page.wait_for_timeout(1000)   # the last update's plots finish drawing
    return message


def take_screenshot(out: Path, window: dict[str, int] = WINDOW, chromium: Path = CHROMIUM,
                    timeout_s: float = 1200) -> str:
    """Serve the GUI on default settings, run the default scenario in Chromium, save `out`; the run's message."""
    from playwright.sync_api import sync_playwright

    from kvbridge.gui.app import build_app, launch_app
    from kvbridge.gui.handlers import AppState, disconnect_engine, start_connect
    from kvbridge.gui.lab import LabSession

    with tempfile.TemporaryDirectory(prefix="kvb-screenshot-") as tmp:
        settings = Settings().replace(host="127.0.0.1", port=free_port(), l2_dir=f"{tmp}/l2",
                                      input_dir=f"{tmp}/input", output_dir=f"{tmp}/output")
        state, lab = AppState(settings, env_path=Path(tmp) / ".env"), LabSession(settings)   # Save writes there
        demo = build_app(settings, state, lab)
        try:
            url = launch_app(demo, settings)
            start_connect(state)   # as main() does: the default engine connects while the browser starts
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
                try:
                    page = browser.new_page(viewport=window)
                    page.goto(url)
                    message = run_default_scenario(page, timeout_s)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(out), full_page=True)
                finally:
                    browser.close()
        finally:
            lab.close()
            disconnect_engine(state)
            demo.close()
    return message


def html_to_png(html: Path, out: Path, window: dict[str, int] = WINDOW, chromium: Path = CHROMIUM) -> None:
    """A saved HTML page (a bench's plotly figure) drawn in Chromium and saved as a PNG."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=window)
            page.goto(html.resolve().as_uri())
            page.wait_for_selector(".main-svg", timeout=30_000)   # plotly has drawn
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()


def missing_prerequisites(chromium: Path) -> list[str]:
    """What must be installed first, in words; empty when everything is there."""
    missing = []
    if not chromium.exists():
        missing.append(f"{chromium} is missing ({INSTALL_ADVICE})")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright package is missing (.venv/bin/pip install -r requirements-test.txt)")
    model = Settings().resolved_model_path()
    if not model.is_file():
        missing.append(f"the embedded model {model} is missing (./scripts/setup.sh fetches it)")
    return missing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = Parser(
        prog="python -m kvbridge.gui.screenshot",
        description="Start the GUI with the default settings on the embedded model, run the default scenario "
                    "in a headless Chromium by clicking Run (the engine connects on start), and save a full-page screenshot.")
    parser.add_argument("--out", type=Path, default=SCREENSHOT, help=f"the PNG to write (default: {SCREENSHOT})")
    parser.add_argument("--width", type=int, default=WINDOW["width"],
                        help="window width in pixels (default: %(default)s)")
    parser.add_argument("--height", type=int, default=WINDOW["height"],
                        help="window height in pixels (default: %(default)s)")
    parser.add_argument("--chromium", type=Path, default=CHROMIUM, help="the browser to drive (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=1200,
                        help="seconds the connect and the run may each take (default: %(default)s)")
    parser.add_argument("--html", type=Path, default=None,
                        help="instead of the GUI, draw this saved HTML page (a bench's figure) and save it as --out")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.html is not None:
        if not args.html.is_file():
            print(f"--html: {args.html} is not a file", file=sys.stderr)
            return 2
        html_to_png(args.html, args.out, {"width": args.width, "height": args.height}, args.chromium)
        print(f"Saved {args.out}")
        return 0
    missing = missing_prerequisites(args.chromium)
    if missing:
        print("Cannot take the screenshot:\n" + "\n".join(f"- {m}" for m in missing), file=sys.stderr)
        return 2
    started = time.monotonic()
    message = take_screenshot(args.out, {"width": args.width, "height": args.height}, args.chromium, args.timeout)
    print(f"{message.splitlines()[0]}\nSaved {args.out} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
