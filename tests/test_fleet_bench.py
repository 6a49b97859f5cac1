"""`kvbridge bench-fleet` end to end at its --quick size, and the workload it asks: no timing thresholds.

The real fleets (kvbridge.fleet: serve workers, the cache server, vllm-router on loopback) on the
embedded model, asked through the openai SDK as a user runs it. What is checked is what a reader takes
from the JSON: every request answered, each answer equal to its cold run under a fresh cache_salt,
the figures the Targets name present, and no child process left behind. The workload's own contract
(documents that share no first chunk, a seeded interleaving that keeps each document's order) is
checked without a model.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from conftest import needs_model
from kvbridge.bench.fleet_workload import QUESTIONS, documents, interleaved, messages
from kvbridge.cli.bench_fleet import main

needs_router = pytest.mark.skipif(
    not (Path(sys.executable).parent / "vllm-router").is_file() and shutil.which("vllm-router") is None,
    reason="vllm-router is not installed (./scripts/setup.sh, or pip install vllm-router==0.1.17)")


def descendants(pid: int) -> list[str]:
    """Every live process below `pid` (from /proc): 'pid command' each."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue    # it exited while we looked
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(parents.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            command = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ")
            found.append(f"{child} {command.decode(errors='replace')}")
        except OSError:
            continue
        todo += parents.get(child, [])
    return found


# -- the workload, without a model ------------------------------------------------------------------------
def test_documents_are_distinct_from_their_first_words_and_sized():
    docs = documents(6, 2400)
    firsts = [d.text.split()[:3] for d in docs]
    assert len({tuple(f) for f in firsts}) == 6, firsts
    assert all(2000 <= len(d.text) <= 2600 for d in docs), [len(d.text) for d in docs]
    # the document opens the system message: prompts of two documents part after the template's first tokens
    assert all(messages(d, 0)[0]["content"].startswith(d.title) for d in docs)


def test_more_documents_than_the_manual_holds_are_refused_naming_the_option():
    with pytest.raises(ValueError, match="--documents 40"):
        documents(40, 2400)


def test_the_interleaving_is_seeded_and_keeps_each_documents_order():
    order = interleaved(5, 4, seed=34)
    assert order == interleaved(5, 4, seed=34) and order != interleaved(5, 4, seed=35)
    assert sorted(q.key for q in order) == sorted(f"d{d}q{n}" for d in range(5) for n in range(4))
    for doc in range(5):
        assert [q.number for q in order if q.doc == doc] == [0, 1, 2, 3]
    # not a plain cycle over the documents (which would line documents up with round_robin's turn)
    assert [q.doc for q in order[:5]] != list(range(5))
    with pytest.raises(ValueError, match="--questions-per-document"):
        interleaved(2, len(QUESTIONS) + 1, seed=1)


def test_bad_options_are_refused_before_anything_starts(capsys):
    with pytest.raises(SystemExit, match="--policies: least_loaded"):
        main(["--policies", "kv_aware,least_loaded"])
    with pytest.raises(SystemExit, match="--workers must be from 2 to 8, got 1"):
        main(["--quick", "--workers", "1"])


# -- one quick run ---------------------------------------------------------------------------------------
@needs_model
@needs_router
@pytest.mark.live
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_quick_run_answers_as_cold_and_writes_its_figures(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVB_CHUNK_SIZE", "32")
    monkeypatch.setenv("KVB_OUTPUT_DIR", str(tmp_path / "output"))
    # a user reads an answer for 0.5 s (2 s by default): each workload waits once, on both users at a time
    assert main(["--quick", "--think-s", "0.5"]) == 0, capsys.readouterr().err[-3000:]
    out = capsys.readouterr().out
    assert "Targets, as ratios of this one run:" in out and "kv_aware hit rate / one instance" in out

    [path] = (tmp_path / "output").glob("kvbridge-bench-fleet-*.json")
    result = json.loads(path.read_text())
    assert "| fleet |" in path.with_suffix(".md").read_text()
    assert result["command"] == "bench-fleet" and result["quick"] is True
    assert sorted(result["runs"]) == ["kv_aware/shared", "single"]
    assert len(result["order"]) == 4 and sorted(result["cold"]) == sorted(result["order"])
    for key, cold in result["cold"].items():
        assert not cold["error"] and cold["text"] and cold["cached_tokens"] == 0, (key, cold)
    setup = result["setup"]
    assert setup["workers"] == 2 and setup["single_kv_cells"] == 3 * setup["worker_kv_cells"]
    assert setup["single_l1_bytes"] == 3 * setup["worker_l1_bytes"] and result["think_s"] == 0.5
    for name, fig in result["figures"].items():
        run = result["runs"][name]
        assert not run["error"] and fig["completed"] == fig["requests"] == 4, (name, run["error"])
        assert fig["answers_compared"] == 4 and fig["answers_differ"] == [], name
        assert fig["prompt_tokens"] > 0 and 0 <= fig["hit_rate"] <= 1
        assert fig["mean_ttft_ms"] > 0 and fig["median_ttft_ms"] > 0
        assert fig["completion_tokens_per_s"] > 0 and fig["requests_per_s"] > 0
        assert set(fig["by_instance"]) <= set(run["instances"]) and sum(fig["by_instance"].values()) == 4
        for answer in run["answers"]:
            assert answer["text"] == result["cold"][answer["key"]]["text"]
    assert len(result["runs"]["kv_aware/shared"]["instances"]) == 2
    assert set(result["ratios"]) >= {"kv_aware_hit_vs_single", "round_robin_no_shared_ttft_vs_kv_aware",
                                     "round_robin_hit_rate", "pd_ttft_vs_colocated"}
    assert result["ratios"]["kv_aware_hit_vs_single"]["shared"] is not None
    assert descendants(os.getpid()) == []


def test_exact_runs_each_fleet_beside_its_mode_off_twin(tmp_path):
    """--exact (issue 47): the fleets run at the defaults that decide an answer, in exact mode, and each policy's
    fleet again with the mode off on its default kernels (flash attention on); the ratio of the two is one of the
    run's figures, and only the exact fleet's answers must equal cold (the mode off makes no such promise)."""
    from kvbridge.bench.fleet_bench import OFF_SUFFIX, FleetRun, Sizing, failed, fleet_settings, ratios
    from kvbridge.settings import Settings

    size, base = Sizing(600, 2048, 1 << 20, 1024, 1), Settings()
    answers = lambda s: (s.cache_type_k, s.cache_type_v, s.sched_max_running, s.sched_exact, s.flash_attn)  # noqa: E731
    assert answers(fleet_settings(base, size, tmp_path)) == ("f32", "f32", 1, False, False)
    assert answers(fleet_settings(base, size, tmp_path, exact=True)) == ("f16", "f16", base.sched_max_running,
                                                                          True, False)
    assert answers(fleet_settings(base, size, tmp_path, exact=False)) == ("f16", "f16", base.sched_max_running,
                                                                           False, True)
    name = "kv_aware/shared"
    figure = dict.fromkeys(("hit_rate", "mean_ttft_ms", "median_ttft_ms", "median_time_per_output_token_ms"), 1.0)
    figures = {name: {**figure, "completion_tokens_per_s": 8.0, "answers_differ": []},
               name + OFF_SUFFIX: {**figure, "completion_tokens_per_s": 10.0, "answers_differ": ["d0 q1"]}}
    assert ratios(figures)["exact_vs_off_tokens_per_s"] == {name: 0.8}
    runs = {name: FleetRun(name, "kv_aware", 3, True, exact=True),
            name + OFF_SUFFIX: FleetRun(name + OFF_SUFFIX, "kv_aware", 3, True, exact=False)}
    assert failed({"cold": {}, "runs": runs, "figures": figures}) == []
    figures[name]["answers_differ"] = ["d1 q2"]
    assert failed({"cold": {}, "runs": runs, "figures": figures}) == [f"{name}, d1 q2: the answer differs from its "
                                                                      "cold run"]
