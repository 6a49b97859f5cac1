"""The blend quality bench (kvbridge.bench.probes.blend_quality): its verdicts on hand-made rows (which setting
it recommends, whether the target is met, what the gate's table says) and one real prompt through every row
kind, on the embedded model."""
from __future__ import annotations

import pytest

from conftest import as_fresh, needs_model
from kvbridge.backends.llamacpp import LlamaCppBackend
from kvbridge.bench.probes.blend_quality import (Answer, PromptRun, QualityRow, curve_figure, gate_table,
                                                 measure_corpus, meets_target, recommend, summarise)
from kvbridge.engine.cached_engine import CachedEngine


def row(corpus, setting, facts, speedup, share=0.15, cold=12, prompts=24):
    rule, _, rest = setting.partition(" ")
    return QualityRow(corpus, setting, rule if rest else "", float(rest or 0), prompts, 1000 / speedup, speedup,
                      facts, cold, 0, share, 0.0, 0)


def test_recommend_takes_the_most_facts_among_settings_fast_enough_everywhere():
    rows = [row("a", "end 0.05", 9, 12.0), row("b", "end 0.05", 9, 11.0),
            row("a", "deviation 0.3", 12, 2.5, 0.3), row("b", "deviation 0.3", 12, 2.6, 0.3),   # too slow
            row("a", "start 0.15", 11, 5.0), row("b", "start 0.15", 10, 6.0),
            row("a", "cold", 12, 1.0, 1.0), row("b", "cold", 12, 1.0, 1.0)]
    best, met = recommend(rows)
    assert best == "start 0.15" and met          # 11 and 10 against 12: within 2 in 24 on both
    rows[4] = row("a", "start 0.15", 9, 5.0)       # 19 facts against end 0.05's 18: one answer is noise
    best, met = recommend(rows)
    assert best == "end 0.05" and not met          # the faster one, 3 below cold's 12 on both corpora
    rows[4] = row("a", "start 0.15", 10, 5.0)      # 20 against 18: worth the wait
    assert recommend(rows) == ("start 0.15", True)
    assert not meets_target(row("a", "end 0.3", 12, 4.0, share=0.4))   # too much recomputed


def test_gate_table_counts_fallbacks_and_the_facts_of_the_prompts_let_through():
    def run(drift, fact, cold_fact, prefix_fact):
        return PromptRun("q", {"cold": Answer(1000, cold_fact, True, 1.0), "prefix": Answer(800, prefix_fact, False, 1.0),
                               "deviation 0.15": Answer(200, fact, False, 0.15, 50.0, drift)})
    runs = [run(0.05, True, True, True), run(0.09, False, True, True), run(0.07, True, False, False)]
    table = {t["gate"]: t for t in gate_table(runs, "deviation 0.15", gates=(0.06, 0.08, 0.10))}
    assert table[0.06]["fall_back"] == 2 and table[0.06]["gated_facts"] == 2       # the 0.09 prompt falls back
    assert table[0.08]["fall_back"] == 1 and table[0.08]["passed_facts"] == 2 and table[0.08]["passed_cold_facts"] == 1
    assert table[0.10]["fall_back"] == 0 and table[0.10]["gated_facts"] == 2


@needs_model
def test_one_real_prompt_through_every_row(make_module_settings):
    settings = make_module_settings(ctx_size=4096, n_predict=4)
    with CachedEngine(settings, LlamaCppBackend(settings)) as engine:
        as_fresh(engine)
        runs = measure_corpus(engine, "clinic", n_prompts=1, rules=("deviation",), ratios=(0.3,), gate=1e-6,
                              n_predict=4, progress=lambda _: None)
    answers = runs[0].answers
    assert set(answers) == {"cold", "prefix", "shift", "settings", "deviation 0.3", "deviation 0.3 gate 1e-06"}
    assert answers["shift"].recomputed_share == 0.0
    assert abs(answers["deviation 0.3"].recomputed_share - 0.3) < 0.01
    assert answers["deviation 0.3"].drift > 0 and answers["deviation 0.3"].selection_ms > 0
    gated = answers["deviation 0.3 gate 1e-06"]
    assert gated.fell_back and gated.recomputed_share == pytest.approx(1.0)   # prefix reuse: every shifted token computed
    rows = summarise("clinic", runs)
    assert [r.setting for r in rows][:3] == ["cold", "prefix", "shift"]
    assert rows[0].speedup == 1.0
    assert len(curve_figure(rows).data) >= 4


def test_the_screenshot_tool_names_a_missing_html_page(tmp_path, capsys):
    from kvbridge.gui.screenshot import main

    assert main(["--html", str(tmp_path / "absent.html"), "--out", str(tmp_path / "x.png")]) == 2
    assert "absent.html is not a file" in capsys.readouterr().err
