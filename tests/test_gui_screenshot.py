"""`python -m kvbridge.gui.screenshot` without a browser: its options and defaults (the default window,
README's picture), and a missing prerequisite named before anything starts; which Chromium the browser
tests and the screenshot drive (the lookup's order) and which one scripts/install_chromium.sh installs
(its decision from an os-release file, as a dry run). The real run is what regenerates
Docs/screenshot-gui.png; it is not repeated here (minutes of CPU for a picture).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.gui import chromium, screenshot
from kvbridge.settings import WORK_DIR


def test_help_names_the_options():
    result = subprocess.run([sys.executable, "-m", "kvbridge.gui.screenshot", "--help"], cwd=WORK_DIR,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert all(option in result.stdout for option in ("--out", "--width", "--height", "--chromium", "--timeout"))
    assert "default settings" in result.stdout


def test_defaults_are_the_default_window_and_readmes_picture(tmp_path):
    args = screenshot.parse_args([])
    assert args.out == WORK_DIR / "Docs" / "screenshot-gui.png"
    assert {"width": args.width, "height": args.height} == screenshot.WINDOW == {"width": 1280, "height": 800}
    args = screenshot.parse_args(["--out", str(tmp_path / "x.png"), "--width", "1024", "--timeout", "60"])
    assert (args.out, args.width, args.height, args.timeout) == (tmp_path / "x.png", 1024, 800, 60)


def test_a_missing_browser_is_named_before_anything_starts(tmp_path, capsys):
    out = tmp_path / "x.png"
    assert screenshot.main(["--chromium", str(tmp_path / "no-chromium"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'no-chromium'} is missing" in err and "apt-get install chromium" in err
    assert not out.exists()


# -- which Chromium: kvbridge.gui.chromium's lookup and scripts/install_chromium.sh's choice -------
SNAP_STUB = '#!/bin/sh\nif ! [ -x /snap/bin/chromium ]; then echo "requires the chromium snap" >&2; exit 1; fi\n' \
            'exec /snap/bin/chromium "$@"\n'


def executable(path: Path, text: str = "\x7fELF") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_the_lookup_takes_apt_then_playwrights_own_then_the_snap(tmp_path):
    apt, snap, builds = tmp_path / "usr/bin/chromium", tmp_path / "snap/bin/chromium", tmp_path / "ms-playwright"
    older = executable(builds / "chromium-1100/chrome-linux/chrome")
    newer = executable(builds / "chromium-1300/chrome-linux64/chrome")
    driven = executable(builds / "chromium-1255/chrome-linux64/chrome")   # the revision this playwright drives
    executable(builds / "chromium_headless_shell-1255/chrome-linux64/headless_shell")   # never picked
    executable(snap)

    def found() -> Path | None:
        return chromium.find_chromium(apt=apt, browsers_dir=builds, snap=snap, revision="1255")

    executable(apt)
    assert found() == apt
    executable(apt, SNAP_STUB)   # Ubuntu's /usr/bin/chromium runs the snap: passed over
    assert chromium.is_snap_wrapper(apt) and found() == driven
    driven.unlink()
    assert found() == newer
    newer.unlink(), older.unlink()
    assert found() == snap
    snap.unlink()
    assert found() is None
    assert "apt-get install chromium" in chromium.MISSING and "playwright install --with-deps chromium" in chromium.MISSING


@pytest.mark.parametrize("os_release, decision", [
    ('NAME="Debian GNU/Linux"\nID=debian\n', "apt"),
    ('NAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\n', "playwright"),
    ('NAME="Linux Mint"\nID=linuxmint\nID_LIKE="ubuntu debian"\n', "playwright"),
    ('NAME="Fedora Linux"\nID=fedora\n', "manual"),
])
def test_install_chromium_chooses_by_distribution(tmp_path, os_release, decision):
    (tmp_path / "os-release").write_text(os_release)
    out = install_chromium_dry_run(tmp_path, APT_CHROMIUM=str(tmp_path / "no-chromium"))
    assert f"decision: {decision}\n" in out
    if decision == "playwright":
        assert "-m playwright install --with-deps chromium" in out
    if decision == "apt":
        assert "apt-get install -y chromium" in out


def test_install_chromium_takes_playwrights_own_when_apts_is_the_snap_wrapper(tmp_path):
    (tmp_path / "os-release").write_text("ID=debian\n")
    out = install_chromium_dry_run(tmp_path, APT_CHROMIUM=str(executable(tmp_path / "chromium", SNAP_STUB)))
    assert "decision: playwright\n" in out


def install_chromium_dry_run(tmp_path: Path, **env: str) -> str:
    result = subprocess.run(["bash", str(WORK_DIR / "scripts" / "install_chromium.sh"), "--dry-run"],
                            env={**os.environ, "OS_RELEASE_FILE": str(tmp_path / "os-release"), **env},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout
