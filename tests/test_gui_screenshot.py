"""`python -m kvbridge.gui.screenshot` without a browser: its options and defaults (the default window,
README's picture), and a missing prerequisite named before anything starts. The real run is what
regenerates Docs/screenshot-gui.png; it is not repeated here (minutes of CPU for a picture).
"""
from __future__ import annotations

import subprocess
import sys

from kvbridge.gui import screenshot
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
