"""Where settings come from: an installed package reads `.env` only from the user's own config folder
or a file named by KVB_ENV_FILE, never from whatever folder it runs in (a cloned repository's `.env`
could otherwise name the llama-server binary to run, or where prompts go). A checkout reads its own.
Real processes: the package is copied out of the checkout, as a wheel installs it, and run from a
folder that holds a `.env`.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from kvbridge.settings import DEFAULT_ENV_FILE, WORK_DIR, SOURCE_CHECKOUT, Settings


INSTALLED_SETTINGS = """
import json, sys
sys.path.insert(0, sys.argv[1])            # the copied package: no checkout around it
import kvbridge
from kvbridge.settings import DEFAULT_ENV_FILE, SOURCE_CHECKOUT, Settings
settings = Settings.from_env()
print(json.dumps({"package": kvbridge.__file__, "checkout": str(SOURCE_CHECKOUT), "env_file": str(DEFAULT_ENV_FILE),
                  "chunk_size": settings.chunk_size, "problems": settings.validate()}))
"""


def test_an_installed_package_never_reads_the_current_folders_env_file(tmp_path):
    """The package copied out of the checkout (as a wheel installs it), run in a folder holding a
    `.env`: that file is not read; the user's ~/.config/kvbridge/.env is, and KVB_ENV_FILE names any."""
    site, work, home = tmp_path / "site", tmp_path / "work", tmp_path / "home"
    shutil.copytree(WORK_DIR / "kvbridge", site / "kvbridge", ignore=shutil.ignore_patterns("__pycache__"))
    work.mkdir()
    (work / ".env").write_text("KVB_CHUNK_SIZE=64\n")          # a folder's .env, e.g. a cloned repository's
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVB_", "XDG_")) and k != "PYTHONPATH"}
    env["HOME"] = str(home)

    def run(**extra) -> dict:
        done = subprocess.run([sys.executable, "-c", INSTALLED_SETTINGS, str(site)], cwd=work, env={**env, **extra},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    seen = run()
    assert seen["package"].startswith(str(site)) and seen["checkout"] == "None"
    assert seen["chunk_size"] == Settings().chunk_size                     # the folder's .env was not read
    assert seen["env_file"] == str(home / ".config" / "kvbridge" / ".env")
    (home / ".config" / "kvbridge").mkdir(parents=True)
    (home / ".config" / "kvbridge" / ".env").write_text("KVB_CHUNK_SIZE=96\n")
    assert run()["chunk_size"] == 96                                        # the user's own settings file is
    assert run(KVB_ENV_FILE=str(work / ".env"))["chunk_size"] == 64         # and a file named explicitly
    missing = run(KVB_ENV_FILE=str(work / "nope.env"))
    assert any("nope.env (KVB_ENV_FILE) does not exist" in p for p in missing["problems"]), missing["problems"]


def test_a_checkout_reads_its_own_env_file():
    assert SOURCE_CHECKOUT is not None and DEFAULT_ENV_FILE == SOURCE_CHECKOUT / ".env"
