"""The RAG corpora (kvbridge/data/rag_corpus*.json) and how a run picks one, without a model: both registered
corpora load with 16 passages and 24 questions, each answer stands in its own passage's text and in no
other passage (holds_fact's rule, so a bench can judge a reply by it), an unknown name is refused naming
the known ones, and load_corpus refuses a file whose answer is missing from its passage or stands in two.
"""
from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest

from kvbridge.bench.common.report import holds_fact
from kvbridge.bench.common.runner import run_scenario
from kvbridge.bench.common.scenarios import ScenarioOptions
from kvbridge.bench.rag import CORPORA, CORPUS_PATH, DEFAULT_CORPUS, build_prompts, corpus_path, load_corpus
from kvbridge.cli.commands import build_parser
from kvbridge.engine.records import RequestRecord
from kvbridge.errors import BadSettings


def test_the_registry_keeps_the_railway_corpus_as_the_default():
    assert CORPORA["railway"] == CORPUS_PATH and DEFAULT_CORPUS == "railway"
    assert set(CORPORA) == {"railway", "clinic"}
    assert load_corpus() == load_corpus("railway") == load_corpus(CORPUS_PATH) == load_corpus(str(CORPUS_PATH))


@pytest.mark.parametrize("name", sorted(CORPORA))
def test_each_corpus_loads_with_16_passages_and_24_questions_each_on_one_passage(name):
    corpus = load_corpus(name)
    assert corpus["title"] and corpus["instruction"]
    passages, questions = corpus["passages"], corpus["questions"]
    assert len(passages) == 16 and len(questions) == 24
    assert len({p["id"] for p in passages}) == 16 and len({q["id"] for q in questions}) == 24
    assert {q["passage"] for q in questions} == {p["id"] for p in passages}   # at least one question a passage
    for q in questions:
        holding = [p["id"] for p in passages if holds_fact(f"{p['title']}. {p['text']}", q["answer"])]
        assert holding == [q["passage"]], (name, q["id"], q["answer"], holding)
        own = next(p for p in passages if p["id"] == q["passage"])
        assert holds_fact(own["text"], q["answer"]), (name, q["id"])


def test_the_clinic_corpus_is_not_the_railway_one():
    railway, clinic = load_corpus("railway"), load_corpus("clinic")
    assert railway["instruction"] == clinic["instruction"]
    assert "clinic" in clinic["title"].lower() and "railway" in railway["title"].lower()
    assert not {p["text"] for p in railway["passages"]} & {p["text"] for p in clinic["passages"]}
    prompt = build_prompts(clinic, "[SEP]", n_prompts=1, n_passages=4)[0]
    assert prompt.answer == clinic["questions"][0]["answer"] and len(prompt.passage_ids) == 4


def test_an_unknown_corpus_name_is_refused_naming_the_known_ones():
    with pytest.raises(BadSettings) as caught:
        load_corpus("hospital")
    assert "hospital" in str(caught.value) and all(name in str(caught.value) for name in CORPORA)
    with pytest.raises(BadSettings, match="railway, clinic"):
        corpus_path("airport")


def _write(tmp_path, corpus: dict):
    path = tmp_path / "broken_corpus.json"
    path.write_text(json.dumps(corpus), encoding="utf-8")
    return path


def test_a_corpus_whose_answer_is_missing_from_its_passage_is_refused_naming_the_question(tmp_path):
    corpus = copy.deepcopy(load_corpus("clinic"))
    question = corpus["questions"][6]
    question["answer"] = "57 crowns"   # in no passage
    with pytest.raises(BadSettings) as caught:
        load_corpus(_write(tmp_path, corpus))
    assert question["id"] in str(caught.value) and "57 crowns" in str(caught.value)
    with pytest.raises(BadSettings, match=question["id"]):
        load_corpus(str(_write(tmp_path, corpus)))   # a path given as a string works the same


def test_a_corpus_whose_answer_stands_in_another_passage_too_is_refused(tmp_path):
    corpus = copy.deepcopy(load_corpus("railway"))
    question = corpus["questions"][0]
    other = next(p for p in corpus["passages"] if p["id"] != question["passage"])
    other["text"] += f" Nobody remembers the number {question['answer']} here."
    with pytest.raises(BadSettings) as caught:
        load_corpus(_write(tmp_path, corpus))
    assert question["id"] in str(caught.value) and other["id"] in str(caught.value)


class _FakeEngine:
    """What run_rag asks of an engine, recording the prompts instead of running a model."""

    settings = SimpleNamespace(blend_separator="[SEP]")

    def __init__(self):
        self.prompts = []

    def start(self):
        pass

    def reset_native_cache(self):
        pass

    def infer(self, messages, mode, n_predict=None, **kw):
        self.prompts.append(messages[1]["content"])
        return RequestRecord(mode=mode, text="")


@pytest.mark.parametrize("corpus, passage_word", [(None, "Corvalen"), ("clinic", "Maribeck")])
def test_run_scenario_passes_the_corpus_to_the_rag_run(corpus, passage_word):
    engine = _FakeEngine()
    records = list(run_scenario(engine, "rag", ["cold"], n_requests=2, corpus=corpus))
    expected = load_corpus(corpus or DEFAULT_CORPUS)["questions"][:2]
    assert [r.expected for r in records] == [q["answer"] for q in expected]
    assert all(q["question"] in prompt for q, prompt in zip(expected, engine.prompts))
    assert passage_word in " ".join(engine.prompts)


def test_bench_takes_a_corpus_option():
    args = build_parser().parse_args(["bench", "--scenario", "rag", "--corpus", "clinic"])
    assert args.corpus == "clinic"
    assert build_parser().parse_args(["bench", "--scenario", "rag"]).corpus is None
    assert ScenarioOptions(corpus="clinic").corpus == "clinic" and ScenarioOptions().corpus is None


def test_the_blend_bench_refuses_an_unknown_corpus_by_name_before_loading_the_model():
    from kvbridge.bench.probes import blend_bench

    with pytest.raises(SystemExit) as exc:
        blend_bench.main(["--corpus", "nosuch"])
    assert "--corpus" in str(exc.value) and "railway, clinic" in str(exc.value)
