"""Docs/Python.md holds: every python block in it runs from an installed wheel, outside the checkout, on the
embedded model, and prints what the guide says it does; its RequestRecord table is the dataclass's own.

The wheel is built from this checkout (build/wheelhouse/ gives pip its build tools offline, as in
tests/test_packaging.py) and installed with `pip install --no-deps --target`; the examples run with this venv's
interpreter (it has llama-cpp-python, which the packaging test's clean venv does not) with only that target on
PYTHONPATH and a folder outside the checkout as the working folder, and each checks that `kvbridge` came from
the wheel. So a guide example that reads a file by a checkout path, or a package file the wheel lacks, fails.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.settings import WORK_DIR
from kvbridge.settings.models import DEFAULT_MODEL, EMBEDDED_MODELS

GUIDE = WORK_DIR / "Docs" / "Python.md"
WHEELHOUSE = WORK_DIR / "build" / "wheelhouse"
MODEL = EMBEDDED_MODELS[DEFAULT_MODEL].path
FROM_WHEEL = "import kvbridge, sys; assert '{target}' in kvbridge.__file__, kvbridge.__file__\n"


def guide_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)


def test_the_record_table_is_the_dataclass():
    from kvbridge.engine.record_fields import FIELD_DOCS, fields_table
    from kvbridge.engine.records import RECORD_FIELDS

    assert set(FIELD_DOCS) == set(RECORD_FIELDS), "every RequestRecord field needs its line in record_fields.FIELD_DOCS"
    found = re.search(r"<!-- record-fields: begin -->\n(.*?)\n<!-- record-fields: end -->", GUIDE.read_text(), re.S)
    assert found, "Docs/Python.md lost its record-fields markers"
    assert found.group(1) == fields_table(), ("Docs/Python.md's RequestRecord table differs from the dataclass: "
                                              "paste `python -m kvbridge.engine.record_fields` between the markers")


def test_raise_for_error_returns_the_record_or_raises_its_error():
    from kvbridge.engine.records import RequestRecord
    from kvbridge.errors import KVBridgeError, RequestFailed

    ok = RequestRecord(mode="cold")
    assert ok.raise_for_error() is ok
    failed = RequestRecord(mode="lmcache", error="The prompt is empty")
    with pytest.raises(RequestFailed, match="The prompt is empty") as caught:
        failed.raise_for_error()
    assert isinstance(caught.value, KVBridgeError) and caught.value.record is failed


@pytest.fixture(scope="module")
def installed_package(tmp_path_factory):
    if not (WHEELHOUSE / "FILLED_FROM").is_file():
        pytest.skip("build/wheelhouse/ is not filled: run scripts/wheelhouse.sh (scripts/setup.sh --test runs it)")
    if not MODEL.is_file():
        pytest.skip("the embedded model is not fetched: run ./scripts/setup.sh")
    tmp = tmp_path_factory.mktemp("guide")
    wheels, target, work = tmp / "wheels", tmp / "site", tmp / "work"
    work.mkdir()
    quiet = ["--quiet", "--disable-pip-version-check", "--no-index", "--find-links", str(WHEELHOUSE)]
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", *quiet, "--no-deps", "-w", str(wheels),
                            str(WORK_DIR)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("kvbridge-*.whl")
    done = subprocess.run([sys.executable, "-m", "pip", "install", *quiet, "--no-deps", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (target / "kvbridge" / "py.typed").is_file(), "the wheel lacks py.typed"
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVB_")}
    env.update(PYTHONPATH=str(target), KVB_MODEL_PATH=str(MODEL), KVB_L2_DIR=str(tmp / "l2"),
               KVB_OUTPUT_DIR=str(tmp / "output"), KVB_CHUNK_SIZE="128", KVB_THREADS="1",
               XDG_DATA_HOME=str(tmp / "data"), HOME=str(tmp / "home"))
    return target, work, env


def run_block(installed_package, index: int) -> str:
    target, work, env = installed_package
    code = FROM_WHEEL.format(target=target) + guide_blocks()[index]
    done = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"Docs/Python.md block {index + 1} failed:\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_guide_has_the_four_examples():
    assert len(guide_blocks()) == 4


def test_the_engine_example_restores_the_document_on_the_second_question(installed_package):
    out = run_block(installed_package, 0)
    lines = re.findall(r"(\d+) ms, (\d+) of (\d+) tokens restored from (\w+)", out)
    assert len(lines) == 2, out
    (_, first, _, first_tier), (_, second, prompt, second_tier) = lines
    assert int(first) == 0 and first_tier == "none"
    assert int(second) > int(prompt) // 2 and second_tier == "L1", lines
    assert "L1" in out.splitlines()[-1]   # the tiers' stats


def test_the_error_example_shows_the_error_then_raises_it(installed_package):
    out = run_block(installed_package, 1)
    assert re.search(r"record\.error: The prompt is empty", out), out
    assert re.search(r"raised: The prompt is empty", out), out


def test_the_settings_example_names_the_bad_variable(installed_package):
    out = run_block(installed_package, 2)
    first, second = out.splitlines()[:2]
    assert first == "settings are valid"
    assert "KVB_CHUNK_SIZE" in second


def test_the_scheduler_example_answers_both_requests(installed_package):
    out = run_block(installed_package, 3)
    rows = re.findall(r"^(\d) (\d+) ms queued: (.+)$", out, re.M)
    assert [int(priority) for priority, _, _ in rows] == [9, 2], out
    assert all(text.strip() for _, _, text in rows)
