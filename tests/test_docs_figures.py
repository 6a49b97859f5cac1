"""Every figure README.md and Docs/Quickstart.md quote stands in the current-results table at the top of Docs/Research.md.

A figure is a number (or a range of numbers) followed by ×, x, % or ms: "19.4×", "0.85-1.01×",
"92–100 %", "214.8 ms". README and the table are read with the same rule, so a README figure is
found only where the table states the same value with the same unit; the table is the lines from
its header to the first line after it that is not a table row, under "## Current results". Left
out on purpose: judging whether a figure is right (Research.md's history does that) and figures in
the reference pages (Architecture, CacheServer), which cite the section that measured them.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
QUICKSTART = ROOT / "Docs" / "Quickstart.md"
HELD_PAGES = (README, QUICKSTART)   # the pages a newcomer reads first
RESEARCH = ROOT / "Docs" / "Research.md"
TABLE_HEADING = "## Current results"

_NUMBER = r"\d[\d,]*(?:\.\d+)?"
# A number, optionally "-" or "–" and a second number, then the unit. The look-behind keeps
# "v0.3" or "x86" from yielding a figure; "x" counts only as a word of its own ("14x", not "0x1f").
FIGURE = re.compile(rf"(?<![\w.]){_NUMBER}(?:\s*[-–]\s*{_NUMBER})?\s*(?:×|x(?![\w])|%|ms\b)")


def canonical(figure: str) -> str:
    """One spelling per value: no spaces, "-" for a range, "×" for "x"; "1,771" stays as written."""
    figure = re.sub(r"\s+", "", figure).replace("–", "-")
    return figure[:-1] + "×" if figure.endswith("x") else figure


def figures(text: str) -> list[str]:
    return [canonical(m.group(0)) for m in FIGURE.finditer(text)]


def current_results_table(research: str) -> list[str]:
    """The lines of the first table under TABLE_HEADING: its header row to its last row."""
    lines = research.splitlines()
    start = lines.index(TABLE_HEADING)
    header = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("|"))
    end = header
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return lines[header:end]


def readme_figures() -> list[tuple[str, int, str, str]]:
    """(page, line number, canonical figure, the line) for every figure README and Quickstart quote; a code
    span is left out: it quotes what a command prints (a progress line's "40%"), not a measured claim."""
    found = []
    for page in HELD_PAGES:
        text = page.read_text(encoding="utf-8")
        # a code span may run over a line break: blank it out, keeping the line numbers
        prose = re.sub(r"(?<!`)`(?!`)[^`\n]*\n?[^`\n]*(?<!`)`(?!`)", lambda span: "\n" * span.group(0).count("\n"), text)
        found += [(page.relative_to(ROOT).as_posix(), number, figure, line.strip())
                  for number, (line, prose_line) in enumerate(zip(text.splitlines(), prose.splitlines()), start=1)
                  for figure in figures(prose_line)]
    return found


def test_the_table_opens_research_md_and_every_row_has_its_command_date_and_machine():
    table = current_results_table(RESEARCH.read_text(encoding="utf-8"))
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header[:2] == ["claim: what is measured, against which baseline", "figure"], header
    assert {"target", "met", "command", "run", "machine"} <= set(header), header
    rows = table[2:]
    assert len(rows) >= 10, "the current-results table has fewer rows than the claims it should hold"
    column = {name: header.index(name) for name in ("command", "run", "machine")}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == len(header), f"a row of the table has {len(cells)} cells, not {len(header)}: {row}"
        assert cells[column["command"]], f"a row of the table names no command: {row}"
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", cells[column["run"]]), f"a row of the table has no date: {row}"
        assert cells[column["machine"]], f"a row of the table names no machine: {row}"


def test_readme_quotes_figures_at_all():
    # Guards the figure rule itself: README has quoted figures since the scheduler section.
    assert readme_figures(), "no figure found in README.md: has the figure pattern stopped matching?"


@pytest.mark.parametrize("page, number, figure, line", readme_figures(),
                         ids=[f"{p}:{n}:{f}".replace("×", "x") for p, n, f, _ in readme_figures()])
def test_every_readme_figure_is_in_the_current_results_table(page, number, figure, line):
    table = "\n".join(current_results_table(RESEARCH.read_text(encoding="utf-8")))
    assert figure in figures(table), (
        f"{page} line {number} quotes {figure!r}, which is not in the current-results table at the top "
        f"of Docs/Research.md. Quote the table's figure, or add the run that measured it to the table.\n"
        f"  {page}:{number}: {line}")


def test_the_figure_rule_on_hand_written_cases():
    assert figures("first token 19.4× sooner at 0.85-1.01× its throughput") == ["19.4×", "0.85-1.01×"]
    assert figures("about 14x cold, 92–100 % equal, 214.8 ms, 1,771 ms") == ["14×", "92-100%", "214.8ms", "1,771ms"]
    assert figures("x86-64, v0.3.36, 0x1f, 8 users, 5 min, 12 msgs") == []
