"""Docs/Settings.md, .env.example and the code agree: every KVB_ variable documented once, none undocumented."""
from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

from kvbridge.settings import SETTING_NAMES, env_name, reference
from kvbridge.settings.reference import (BUILD_TIME, ENV_EXAMPLE, NOT_VARIABLES, SOURCE_ROOT, REFERENCE_PAGE,
                                         REGENERATE, generate, read_env_example)

FIELD_VARIABLES = {env_name(name) for name in SETTING_NAMES}
BUILD_VARIABLES = {b.name for b in BUILD_TIME}
# greedy, so a prefix the code builds names from ("KVB_L3_" in a message filter) keeps its underscore
KVB_WORD = re.compile(r"KVB_[A-Z0-9_]+")


def source_files():
    """What runs: the package and the scripts (shell and Python), but not the reference module, which names
    every build-time variable itself."""
    files = [*(SOURCE_ROOT / "kvbridge").rglob("*.py"), *(SOURCE_ROOT / "scripts").glob("*.sh"),
             *(SOURCE_ROOT / "scripts").glob("*.py")]
    return [path for path in files if path.resolve() != Path(reference.__file__).resolve()]


def kvb_words_in_sources() -> dict[str, str]:
    """Every KVB_ word in the sources -> the first file naming it."""
    found: dict[str, str] = {}
    for path in sorted(source_files()):
        for word in KVB_WORD.findall(path.read_text(encoding="utf-8")):
            found.setdefault(word, str(path.relative_to(SOURCE_ROOT)))
    return found


def test_the_committed_page_is_what_the_module_generates():
    expected = generate()
    committed = REFERENCE_PAGE.read_text(encoding="utf-8") if REFERENCE_PAGE.is_file() else ""
    if committed != expected:
        diff = "".join(list(difflib.unified_diff(committed.splitlines(True), expected.splitlines(True),
                                                 "Docs/Settings.md (committed)", "generated", n=1))[:40])
        raise AssertionError(f"Docs/Settings.md is out of date with Settings and .env.example. "
                             f"Regenerate it: {REGENERATE}\n{diff}")


def test_every_setting_is_in_env_example_with_a_comment():
    example = read_env_example(ENV_EXAMPLE.read_text(encoding="utf-8"))
    missing = sorted(v for v in FIELD_VARIABLES if example.meaning(v) is None)
    assert not missing, f"Settings fields not set in .env.example (add each with a comment above it): {missing}"
    silent = sorted(v for v in FIELD_VARIABLES if not example.meaning(v))
    assert not silent, f"no comment above these in .env.example (write what each does): {silent}"


def test_env_example_sets_no_variable_kvbridge_does_not_read():
    example = read_env_example(ENV_EXAMPLE.read_text(encoding="utf-8"))
    stale = sorted(v for s in example.sections for v in s.meanings if v not in FIELD_VARIABLES | BUILD_VARIABLES)
    assert not stale, f".env.example sets variables that are neither Settings fields nor build-time ones: {stale}"


def test_every_kvb_name_in_the_code_is_a_setting_or_a_listed_build_time_variable():
    known = FIELD_VARIABLES | BUILD_VARIABLES
    undocumented = {}
    for word, where in kvb_words_in_sources().items():
        if word in known or word in NOT_VARIABLES:
            continue
        if word.endswith("_") and any(name.startswith(word) for name in FIELD_VARIABLES):
            continue   # a prefix, as in `"KVB_L3_" in problem`
        undocumented[word] = where
    assert not undocumented, (
        f"KVB_ variables in the code that are neither Settings fields nor in BUILD_TIME "
        f"(kvbridge/settings/reference.py; then {REGENERATE}): {undocumented}")


def test_the_build_time_list_holds_only_live_variables_that_are_not_settings():
    words = kvb_words_in_sources()
    assert not BUILD_VARIABLES & FIELD_VARIABLES, "a build-time variable is also a Settings field"
    assert sorted(BUILD_VARIABLES - set(words)) == [], "BUILD_TIME lists a variable nothing reads any more"
    assert len(BUILD_VARIABLES) == len(BUILD_TIME) and all(b.read_by and b.meaning for b in BUILD_TIME)
    named = {path for b in BUILD_TIME for path in re.findall(r"[\w./-]+\.(?:py|sh)\b", b.read_by)}
    assert named and sorted(p for p in named if not (SOURCE_ROOT / p).is_file()) == [], "read_by names a file that is gone"


def test_the_page_lists_every_variable_once():
    page = generate()
    rows = re.findall(r"^\| `(KVB_[A-Z0-9_]+)` \|", page, flags=re.MULTILINE)
    assert sorted(rows) == sorted(FIELD_VARIABLES | BUILD_VARIABLES)
    assert "Not yet described" not in page


def test_the_page_is_the_same_on_every_machine_and_shows_no_secret(tmp_path):
    """Another home folder, a .env-like environment with a secret behind a *_ENV setting: the same page."""
    secret = "s3cr3t-VALUE-never-shown-0123456789"
    env = {**os.environ, "HOME": str(tmp_path), "KVB_L2_DIR": str(tmp_path / "l2"), "KVB_CTX_SIZE": "777",
           "KVB_L3_PASSWORD_ENV": "KVB_TEST_L3_PASSWORD", "KVB_TEST_L3_PASSWORD": secret,
           "KVB_CLOUD_API_KEY_ENV": "KVB_TEST_CLOUD_KEY", "KVB_TEST_CLOUD_KEY": secret}
    done = subprocess.run([sys.executable, "-m", "kvbridge.settings.reference"], cwd=SOURCE_ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == generate()
    assert secret not in done.stdout and str(tmp_path) not in done.stdout and "777" not in done.stdout


def test_check_says_how_to_regenerate(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "Settings.md"
    stale.write_text(generate() + "edited by hand\n", encoding="utf-8")
    monkeypatch.setattr(reference, "REFERENCE_PAGE", stale)
    assert reference.main(["--check"]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert reference.main(["--write"]) == 0 and reference.main(["--check"]) == 0
    assert stale.read_text(encoding="utf-8") == generate()


def test_reading_env_example_golden_case():
    """Hand-worked: a two-line comment, a variable without one, a note that belongs to no variable, the
    examples below ignored."""
    text = "\n".join([
        "# Opening note.",
        "#   KVB_A=1 ./run",
        "",
        "# ---- First part ----------",
        "# What A does,",
        "# over two lines.",
        "KVB_A=1",
        "# What B does.",
        "KVB_B=",
        "KVB_C=x",
        "",
        "# A note on a commented-out variable.",
        "# KVB_D=2",
        "",
        "# ---- Second part ---------",
        "KVB_E=",
        "# =====================",
        "# What A does in an example.",
        "# KVB_A=2",
        "KVB_F=1",
    ])
    example = read_env_example(text)
    assert example.preamble == ["Opening note.", "  KVB_A=1 ./run"]
    assert [(s.title, s.meanings) for s in example.sections] == [
        ("First part", {"KVB_A": "What A does, over two lines.", "KVB_B": "What B does.", "KVB_C": ""}),
        ("Second part", {"KVB_E": ""}),
    ]
    assert example.meaning("KVB_D") is None and example.meaning("KVB_F") is None
