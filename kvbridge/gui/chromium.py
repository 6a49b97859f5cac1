"""Which Chromium the browser tests and the screenshot drive: one lookup over the three places one lives.

Place in the flow: scripts/install_chromium.sh installs one (Debian: apt's chromium; Ubuntu: playwright's
own build, because Ubuntu's apt chromium is a snap whose confinement playwright often cannot drive, and
which does not run in most containers) -> **find_chromium** -> kvbridge.gui.screenshot and
tests/browser_helpers launch it through playwright.

The order: apt's /usr/bin/chromium unless it is the snap's wrapper; then playwright's own build, the
revision this playwright package drives first; the snap itself last (it may still refuse playwright).
`python -m kvbridge.gui.chromium` prints the one found (install_chromium.sh asks it), or what to run.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

APT_CHROMIUM = Path("/usr/bin/chromium")
SNAP_CHROMIUM = Path("/snap/bin/chromium")
INSTALL_ADVICE = ("./scripts/install_chromium.sh installs the right one (Debian: sudo apt-get install chromium; "
                  "Ubuntu: .venv/bin/python -m playwright install --with-deps chromium)")
MISSING = (f"no Chromium for playwright: neither {APT_CHROMIUM} (apt's, not the snap's wrapper), playwright's own "
           f"build, nor {SNAP_CHROMIUM}. {INSTALL_ADVICE}")


def is_snap_wrapper(path: Path) -> bool:
    """Whether `path` leads to the snap: a link into /snap, or Ubuntu's stub script that runs (or asks for) it."""
    try:
        resolved = path.resolve()   # /snap/bin/chromium itself is a link to /usr/bin/snap
        if resolved.name == "snap" or resolved.parts[1:2] == ("snap",):
            return True
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return head.startswith(b"#!") and b"/snap/" in head


def playwright_browsers_dir() -> Path:
    """Where `playwright install` puts browsers (playwright's own rule, read from its own variable)."""
    chosen = os.environ.get("PLAYWRIGHT_BROWSERS_PATH", "")
    if chosen == "0":   # inside the package
        return _playwright_package() / "driver" / "package" / ".local-browsers"
    if chosen:
        return Path(chosen).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ms-playwright"


def _playwright_package() -> Path:
    try:
        import playwright
    except ImportError:
        return Path("/nonexistent")
    return Path(playwright.__file__).parent


def playwright_chromium_revision() -> str:
    """The chromium revision this playwright package drives ('' when it cannot tell)."""
    try:
        table = json.loads((_playwright_package() / "driver" / "package" / "browsers.json").read_text())
    except (OSError, ValueError):
        return ""
    return next((b.get("revision", "") for b in table.get("browsers", []) if b.get("name") == "chromium"), "")


def playwright_chromiums(browsers_dir: Path | None = None, revision: str | None = None) -> list[Path]:
    """Playwright's own chromium builds under `browsers_dir`: `revision` first, then newest first."""
    root = browsers_dir or playwright_browsers_dir()
    wanted = playwright_chromium_revision() if revision is None else revision

    def number(path: Path) -> int:
        found = re.search(r"chromium-(\d+)", str(path.relative_to(root)))
        return int(found.group(1)) if found else -1

    builds = sorted(root.glob("chromium-*/chrome-linux*/chrome"), key=number, reverse=True)
    return sorted(builds, key=lambda p: str(number(p)) != wanted)   # stable: the rest stay newest first


def _runs(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_chromium(apt: Path = APT_CHROMIUM, browsers_dir: Path | None = None, snap: Path = SNAP_CHROMIUM,
                  revision: str | None = None) -> Path | None:
    """The Chromium to drive, in the order the module docstring gives; None when there is none."""
    if _runs(apt) and not is_snap_wrapper(apt):
        return apt
    for build in playwright_chromiums(browsers_dir, revision):
        if _runs(build):
            return build
    return snap if _runs(snap) else None


def main() -> int:
    found = find_chromium()
    if found is None:
        print(MISSING, file=sys.stderr)
        return 1
    print(found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
