"""README's Python example runs as written: the first question prefills, the second restores the document;
and README's links work wherever it is rendered (PyPI, a wheel's metadata), not only in the repository.

The block is read out of README.md (the first ```python block under "## From Python") and run by the
real interpreter in the checkout, with the default settings on the embedded model and a private L2.
The links' base is pyproject.toml's `Source` URL (the one place the repository's address is written).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from kvbridge.settings import WORK_DIR
from kvbridge.settings.models import EMBEDDED_MODELS, DEFAULT_MODEL

README = WORK_DIR / "README.md"
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def readme_python_example() -> str:
    text = README.read_text()
    section = text[text.index("## From Python"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md's 'From Python' section has no python block"
    return match.group(1)


@pytest.mark.skipif(not EMBEDDED_MODELS[DEFAULT_MODEL].path.is_file(), reason="the embedded model is not fetched: run ./scripts/setup.sh")
def test_the_readme_example_restores_on_the_second_question(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVB_")}
    env.update(KVB_L2_DIR=str(tmp_path / "l2"), KVB_OUTPUT_DIR=str(tmp_path / "output"))
    done = subprocess.run([sys.executable, "-c", readme_python_example()], cwd=WORK_DIR, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = re.findall(r"(\d+) ms, (\d+) of (\d+) tokens restored from (\w+)", done.stdout)
    assert len(lines) == 2, done.stdout
    (_, first, _, first_tier), (_, second, prompt, second_tier) = lines
    assert int(first) == 0 and first_tier == "none"
    assert int(second) > int(prompt) // 2 and second_tier != "none", lines[1]


def repository_url() -> str:
    import tomllib
    return tomllib.loads((WORK_DIR / "pyproject.toml").read_text())["project"]["urls"]["Source"].rstrip("/")


def test_readme_links_are_absolute_and_name_files_of_this_checkout():
    targets = MARKDOWN_LINK.findall(README.read_text())
    assert len(targets) > 10, "no links found in README.md: has the link pattern stopped matching?"
    relative = [target for target in targets if not re.match(r"https?://", target)]
    assert not relative, (f"README.md links {relative} relatively; on PyPI or in a wheel's metadata they break. "
                          f"Write them as {repository_url()}/blob/main/PATH (images: /raw/main/PATH)")
    repository = repository_url()
    for target in targets:
        if target.startswith(repository + "/"):
            path = re.sub(r"^/(?:blob|raw)/main/", "", target[len(repository):]).split("#")[0]
            assert (WORK_DIR / path).exists(), f"README.md links {target}, but {path} is not in this checkout"
