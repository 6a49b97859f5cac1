"""Where KVBridge finds its files: a source checkout, or a package installed with pip.

Read once, at import, before any Settings exist (the `.env` file is one of the places). Imports
nothing from kvbridge.

    what                                   source checkout          installed package
    input/, output/ (WORK_DIR)             the checkout             the current directory
    .env (DEFAULT_ENV_FILE)                the checkout             $XDG_CONFIG_HOME/kvbridge/.env
                                                                    (~/.config/kvbridge/.env)
    models/, .llama-server/, .lmcache-hasher/ (DATA_HOME)
                                           the checkout             $XDG_DATA_HOME/kvbridge
                                                                    (~/.local/share/kvbridge)
    the llama.cpp build record             .venv/kvbridge-build.json <sys.prefix>/kvbridge-build.json
    the setup command                      ./scripts/setup.sh       kvbridge setup

A checkout is recognised by its own scripts/setup.sh beside the package; `pip install -e .` keeps the
package in the checkout, so an editable install behaves as a checkout. An installed package never
reads the current directory's `.env`: settings would then come from whatever folder it runs in (a
cloned repository's `.env` could name the llama-server binary to run, or where prompts are sent).
KVB_ENV_FILE names another settings file explicitly (kvbridge.settings.core). Deliberately left out:
a KVB_ variable for the other places (XDG_DATA_HOME already moves the data, `cd` moves the work folder).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

_PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def _is_checkout(root: Path) -> bool:
    return (root / "scripts" / "setup.sh").is_file() and (root / "kvbridge" / "__init__.py").is_file()


def user_data_dir(env: os._Environ | dict = os.environ) -> Path:
    """$XDG_DATA_HOME/kvbridge, else ~/.local/share/kvbridge (the XDG base directory rule)."""
    base = env.get("XDG_DATA_HOME", "").strip()
    return (Path(base) if base and Path(base).is_absolute() else Path.home() / ".local" / "share") / "kvbridge"


def user_config_dir(env: os._Environ | dict = os.environ) -> Path:
    """$XDG_CONFIG_HOME/kvbridge, else ~/.config/kvbridge (the XDG base directory rule)."""
    base = env.get("XDG_CONFIG_HOME", "").strip()
    return (Path(base) if base and Path(base).is_absolute() else Path.home() / ".config") / "kvbridge"


SOURCE_CHECKOUT: Path | None = _PACKAGE_PARENT if _is_checkout(_PACKAGE_PARENT) else None
WORK_DIR: Path = SOURCE_CHECKOUT or Path.cwd()
DEFAULT_ENV_FILE: Path = (SOURCE_CHECKOUT or user_config_dir()) / ".env"
DATA_HOME: Path = SOURCE_CHECKOUT or user_data_dir()
BUILD_RECORD: Path = (SOURCE_CHECKOUT / ".venv" if SOURCE_CHECKOUT else Path(sys.prefix)) / "kvbridge-build.json"
SETUP_COMMAND = "./scripts/setup.sh" if SOURCE_CHECKOUT else "kvbridge setup"


def setup_command(*args: str) -> str:
    """The command that sets KVBridge up here, with arguments: './scripts/setup.sh --model X' or 'kvbridge setup --model X'."""
    return " ".join([SETUP_COMMAND, *args])
