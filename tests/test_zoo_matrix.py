"""The compatibility matrix (kvbridge.models.matrix): its rows are what issue 33 demands, and what ships is
what the command writes.

The shipped JSON (kvbridge/models/compatibility.json) and page (Docs/Compatibility.md) are checked
without running anything: every zoo architecture has a row on every path, the demanded rows hold, the
page is the JSON rendered. Then the oracle itself runs on real zoo models at the test size: the six
architectures that must restore from chunks in-process do; a hybrid model's llama-server row is
refused with the engine's reason; one sliding-window and one hybrid architecture are exact through
the cache server and through L3 (Debian's redis-server); `--json` writes the verdicts the shipped
JSON holds; `kvbridge namespace` names the loaded model's row.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import needs_llama_server_and_model, needs_model
from kvbridge.models import ZOO_ARCHITECTURES, zoo_model
from kvbridge.models.matrix import main as matrix_main
from kvbridge.models.matrix_oracle import Oracle, Row
from kvbridge.models.matrix_paths import PATHS, run_path
from kvbridge.models.matrix_report import generated_part, render_markdown
from kvbridge.models.matrix_rows import COMPATIBILITY_JSON, FORMAT, load_matrix, matrix_line
from kvbridge.settings import WORK_DIR
from tests.redis_helpers import needs_redis

CHUNKED_IN_PROCESS = ("gemma2", "gpt-oss", "lfm2", "granitehybrid", "qwen35", "mamba2")   # the issue's oracle
SHIPPED = json.loads(COMPATIBILITY_JSON.read_text())
PAGE = WORK_DIR / "Docs" / "Compatibility.md"
REGENERATE = ("python -m kvbridge.models.matrix --size test --json kvbridge/models/compatibility.json "
              "--out Docs/Compatibility.md")


def verdict(arch: str, path: str) -> str:
    return SHIPPED["architectures"][arch]["paths"][path]["verdict"]


# -- what ships ---------------------------------------------------------------------------------------------

def test_the_shipped_matrix_has_every_zoo_architecture_on_every_path():
    assert SHIPPED["format"] == FORMAT and SHIPPED["size"] == "test"
    missing = [(a.name, p) for a in ZOO_ARCHITECTURES for p in PATHS
               if p not in SHIPPED["architectures"].get(a.name, {}).get("paths", {})]
    assert missing == [], f"rows missing from the shipped matrix; regenerate with: {REGENERATE}"
    for arch, row in SHIPPED["architectures"].items():
        for path, cell in row["paths"].items():
            assert cell["verdict"] in ("exact", "exact (as native)", "refused", "differs"), (arch, path)
            assert cell["verdict"].startswith("exact") or cell["reason"], f"{arch} on {path}: no reason written down"


def test_the_shipped_rows_are_what_the_issue_demands():
    assert {arch: verdict(arch, "in-process") for arch in CHUNKED_IN_PROCESS} == dict.fromkeys(CHUNKED_IN_PROCESS, "exact")
    for arch in ("gemma2", "lfm2"):   # one sliding-window and one hybrid architecture off this process
        assert (verdict(arch, "cache-server"), verdict(arch, "l3")) == ("exact", "exact"), arch
    hybrid = SHIPPED["architectures"]["lfm2"]["paths"]["llama-server"]
    assert hybrid["verdict"] == "refused" and "recurrent state must be captured" in hybrid["reason"]


def test_the_page_is_the_shipped_json_rendered():
    # (the hand-written sections after KEPT_MARK are the page's own: the matrix keeps them as they are)
    assert generated_part(PAGE.read_text()) == render_markdown(SHIPPED), (
        f"Docs/Compatibility.md is stale; regenerate: {REGENERATE}")
    assert "| gemma2 | sliding-window | exact |" in PAGE.read_text()


def test_a_regenerated_page_keeps_its_hand_written_sections(tmp_path):
    import copy

    from kvbridge.models.matrix import write
    from kvbridge.models.matrix_report import KEPT_MARK

    page = tmp_path / "Compatibility.md"
    by_hand = KEPT_MARK + "\n\n## Written by hand\n\nkept as it is\n"
    page.write_text("a stale generated part\n" + by_hand)
    write(copy.deepcopy(SHIPPED), SimpleNamespace(json=None, out=page))
    assert page.read_text() == render_markdown(SHIPPED) + by_hand


def test_a_models_line_names_its_row_and_every_refusal(tmp_path):
    line = matrix_line("lfm2")
    assert line.startswith("lfm2 (hybrid): exact on in-process") and "refused on llama-server (" in line
    assert "no row" in matrix_line("bert")
    broken = tmp_path / "matrix.json"
    broken.write_text("{not json")
    assert load_matrix(broken) == {} and "no row" in matrix_line("lfm2", broken)


# -- the oracle's rules, on records made by hand ----------------------------------------------------------

def record(text="The bridge.", matched=200, notes="", error="", tier="L1"):
    return SimpleNamespace(text=text, matched_tokens=matched, prompt_tokens=233, tier=tier, notes=notes, error=error)


@pytest.mark.parametrize("warm, expected", [
    (record(), "exact"),
    (record(text="The bridg."), "differs"),
    (record(matched=0), "refused"),                                   # nothing restored: not exact, even if equal
    (record(notes="KV caching refused: the x architecture ..."), "refused"),
    (record(notes="restored a whole-state snapshot"), "refused"),     # a fallback named in the notes
    (record(error="EngineUnavailable: gone"), "refused"),
])
def test_the_oracle_counts_only_chunked_restores_equal_to_cold(warm, expected):
    oracle = Oracle(Row("x", "in-process"))
    oracle.set_cold("p", record())
    oracle.check("restore", "p", warm)
    assert oracle.decide().verdict == expected


def test_a_warm_answer_equal_to_natives_is_exact_as_native():
    oracle = Oracle(Row("x", "in-process"))
    oracle.set_cold("p", record(text="cold"))
    oracle.check("restore", "p", record(text="native"))
    assert oracle.decide(native_of=lambda prompt: "native").verdict == "exact (as native)"


# -- the oracle on real zoo models ------------------------------------------------------------------------

@needs_model
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", CHUNKED_IN_PROCESS)
def test_chunked_architectures_restore_exactly_in_process(arch, tmp_path):
    row = run_path(arch, "in-process", zoo_model(arch), tmp_path, "test")
    assert row.verdict == "exact", (row.reason, row.steps)
    assert [s.tier for s in row.steps] == ["L1", "L1", "L2", "L2"]   # L1, L2 after a restart, a fresh engine's L2


@needs_model
@needs_redis
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("path", ["cache-server", "l3"])
@pytest.mark.parametrize("arch", ["gemma2", "lfm2"])
def test_a_window_and_a_hybrid_model_are_exact_off_this_process(arch, path, tmp_path):
    row = run_path(arch, path, zoo_model(arch), tmp_path, "test")
    assert row.verdict == "exact", (row.reason, row.steps)
    assert {s.tier for s in row.steps} == ({"L3"} if path == "l3" else {"L1"})


def marked(marks):
    def apply(test):
        for mark in marks:
            test = mark(test)
        return test
    return apply


@marked(needs_llama_server_and_model())
@pytest.mark.timeout(300)
def test_json_writes_the_verdicts_that_ship(tmp_path):
    """The command itself, for a hybrid model on llama-server (refused at start: a few seconds)."""
    out = tmp_path / "matrix.json"
    assert matrix_main(["--archs", "lfm2", "--paths", "llama-server", "--json", str(out),
                        "--workdir", str(tmp_path / "work")]) == 0
    written = json.loads(out.read_text())
    cell = written["architectures"]["lfm2"]["paths"]["llama-server"]
    shipped = SHIPPED["architectures"]["lfm2"]["paths"]["llama-server"]
    assert (cell["verdict"], cell["reason"]) == (shipped["verdict"], shipped["reason"])
    assert written["architectures"]["lfm2"]["layout"]["test"] == SHIPPED["architectures"]["lfm2"]["layout"]["test"]


@needs_model
@pytest.mark.timeout(120)
def test_namespace_names_the_loaded_models_row(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVB_")},
           "KVB_MODEL_PATH": str(zoo_model("lfm2")), "KVB_L2_DIR": str(tmp_path / "l2"), "KVB_CTX_SIZE": "512"}
    out = subprocess.run([sys.executable, "-m", "kvbridge", "namespace"], cwd=WORK_DIR, capture_output=True,
                         text=True, env=env, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "matrix:    lfm2 (hybrid): exact on in-process" in out.stdout
