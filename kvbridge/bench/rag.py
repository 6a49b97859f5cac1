"""RAG with shuffled passages: the scenario where a prefix cache stops helping and blend mode should not.

Place in the flow: `bench --scenario rag` (or the GUI's scenario list) -> run_scenario -> **run_rag**
-> CachedEngine.infer per request (cold, lmcache, blend) -> the bench's table and summary, whose
"answers = cold" line is the agreement of each mode with the cold answer to the same prompt, and
"answers stating the expected fact" the task's own quality: the question's answer from the corpus
appears in the reply (kvbridge.bench.common.report.holds_fact), for cold as for the modes that reuse.

The corpus (kvbridge/data/rag_corpus.json, written for the project) is an operations handbook of an
invented mountain railway cut into 16 passages of ~250 tokens, and 24 questions whose answer sits in
exactly one passage. A prompt is the instruction (system message), then `passages` passages - the
one holding the answer and others drawn at random - in a random order, then the question: cut by
the engine's blend separator, so every mode runs the same token ids and each passage keeps its ids
wherever it stands.

A second corpus of the same shape, the patient and staff handbook of an invented small-town clinic
(kvbridge/data/rag_corpus_clinic.json), is picked by its name in CORPORA (`bench --scenario rag
--corpus clinic`); a path to a file of the same schema works too. load_corpus refuses a corpus in
which a question's answer is missing from its passage's text or stands in another passage as well.

Order of a run: a warm-up in which every passage is seen once (prompts of `passages` passages each,
run in lmcache and in blend mode, so both the exact store and the passage store have seen them),
then each mode over the same measured prompts. A measured prompt shares with the warm-up and with
the others at most the instruction and, by chance, its first passage: what a prefix cache can
reuse. Seeded: the same seed gives the same prompts.
"""
from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from kvbridge.bench.common.report import holds_fact
from kvbridge.engine.records import RequestRecord
from kvbridge.errors import BadSettings

CORPUS_PATH = Path(__file__).resolve().parents[1] / "data" / "rag_corpus.json"
CORPORA = {   # name -> file: the corpora `bench --scenario rag --corpus NAME` knows
    "railway": CORPUS_PATH,
    "clinic": CORPUS_PATH.with_name("rag_corpus_clinic.json"),
}
DEFAULT_CORPUS = "railway"
CORPUS_SCHEMA = "kvbridge-rag-corpus"
DEFAULT_PROMPTS = 12
DEFAULT_PASSAGES = 4
DEFAULT_SEED = 23

ProgressFn = Callable[[int, int, str], None]


@dataclass(frozen=True)
class RagPrompt:
    messages: tuple[dict, ...]
    label: str
    question_id: str
    passage_ids: tuple[str, ...]   # in the prompt's order
    answer: str
    completion: str = ""           # the prompt as plain text, for a model without a chat template

    @property
    def request(self) -> str | tuple[dict, ...]:
        """What the engine is asked: the completion text when there is one, else the chat messages."""
        return self.completion or self.messages


def wants_completion(engine) -> bool:
    """True when the engine's model carries no chat template (a base model: it continues a chat prompt rather
    than answering it), so RAG prompts are plain text ending in "Answer:"."""
    return getattr(getattr(engine, "backend", None), "has_chat_template", True) is False


def corpus_path(path_or_name: str | Path = DEFAULT_CORPUS) -> Path:
    """The file of a registered corpus (CORPORA), or the path given: a Path, or a string that names a
    .json file or holds a path separator. Any other string is an unknown name."""
    if isinstance(path_or_name, Path):
        return path_or_name
    if path_or_name in CORPORA:
        return CORPORA[path_or_name]
    if path_or_name.lower().endswith(".json") or "/" in path_or_name or "\\" in path_or_name:
        return Path(path_or_name).expanduser()
    raise BadSettings(f"Unknown RAG corpus {path_or_name!r}; known corpora: {', '.join(CORPORA)} "
                      "(or the path to a .json file of the same schema).")


def load_corpus(path_or_name: str | Path = DEFAULT_CORPUS) -> dict:
    """The corpus (a name in CORPORA, or a path), checked: schema and version, passages and questions that
    refer to them, and every question's answer in its own passage's text and in no other passage (title
    or text; holds_fact's rule, case and spacing ignored), so that a bench can judge a reply by it."""
    path = corpus_path(path_or_name)
    try:
        corpus = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadSettings(f"cannot read the RAG corpus {path}: {exc}") from exc
    if not isinstance(corpus, dict) or corpus.get("schema") != CORPUS_SCHEMA or corpus.get("version") != 1:
        raise BadSettings(f"{path} is not a version-1 {CORPUS_SCHEMA} file")
    ids = {p["id"] for p in corpus["passages"]}
    unknown = [q["id"] for q in corpus["questions"] if q["passage"] not in ids]
    if unknown:
        raise BadSettings(f"{path}: questions {', '.join(unknown)} name passages that are not in the corpus")
    for q in corpus["questions"]:
        answer = q["answer"] if isinstance(q.get("answer"), str) else ""
        own = next(p for p in corpus["passages"] if p["id"] == q["passage"])
        if not holds_fact(own["text"], answer):
            raise BadSettings(f"{path}: the answer {answer!r} of question {q['id']} is not in the text of its "
                              f"passage {q['passage']}, so no reply could be judged by it")
        others = [p["id"] for p in corpus["passages"]
                  if p["id"] != q["passage"] and holds_fact(f"{p['title']}. {p['text']}", answer)]
        if others:
            raise BadSettings(f"{path}: the answer {answer!r} of question {q['id']} stands in passage(s) "
                              f"{', '.join(others)} as well as in its own {q['passage']}: a reply could hold "
                              "it without the right passage")
    return corpus


def rag_messages(corpus: dict, passage_ids: Sequence[str], question: str, separator: str) -> tuple[dict, ...]:
    """System: the instruction. User: each passage, then the question, each after the separator."""
    by_id = {p["id"]: p for p in corpus["passages"]}
    parts = [f"{by_id[pid]['title']}. {by_id[pid]['text']}\n\n" for pid in passage_ids]
    user = separator + separator.join(parts) + separator + f"Question: {question}"
    return ({"role": "system", "content": corpus["instruction"]}, {"role": "user", "content": user})


def rag_completion(corpus: dict, passage_ids: Sequence[str], question: str, separator: str) -> str:
    """The same prompt as plain text for a base model: the instruction, the passages, the question and
    "Answer:", cut by the separator where the chat form is."""
    system, user = rag_messages(corpus, passage_ids, question, separator)
    return f"{system['content']}\n\n{user['content']}\nAnswer:"


def _prompt(corpus: dict, chosen: Sequence[str], q: dict, separator: str, label: str, completion: bool) -> RagPrompt:
    return RagPrompt(rag_messages(corpus, chosen, q["question"], separator), label, q["id"], tuple(chosen),
                     q["answer"], rag_completion(corpus, chosen, q["question"], separator) if completion else "")


def build_prompts(corpus: dict, separator: str, *, n_prompts: int = DEFAULT_PROMPTS,
                  n_passages: int = DEFAULT_PASSAGES, seed: int = DEFAULT_SEED,
                  completion: bool = False) -> list[RagPrompt]:
    """Measured prompts: question i with its passage and n_passages - 1 others, shuffled (completion: each
    also as plain text, RagPrompt.request, for a model without a chat template)."""
    passages = [p["id"] for p in corpus["passages"]]
    if not 1 <= n_passages <= len(passages):
        raise BadSettings(f"a RAG prompt holds 1 to {len(passages)} passages, not {n_passages}")
    if n_prompts < 1:
        raise BadSettings(f"The number of requests must be at least 1, got {n_prompts}.")
    rng = random.Random(seed)
    questions = corpus["questions"]
    prompts = []
    for i in range(n_prompts):
        q = questions[i % len(questions)]
        others = rng.sample([p for p in passages if p != q["passage"]], n_passages - 1)
        chosen = others + [q["passage"]]
        rng.shuffle(chosen)
        prompts.append(_prompt(corpus, chosen, q, separator, f"{q['id']}: {q['question']}", completion))
    return prompts


def warmup_prompts(corpus: dict, separator: str, n_passages: int = DEFAULT_PASSAGES,
                   seed: int = DEFAULT_SEED, completion: bool = False) -> list[RagPrompt]:
    """Prompts that together hold every passage once (the last one topped up from the start)."""
    passages = [p["id"] for p in corpus["passages"]]
    order = passages[:]
    random.Random(seed + 1).shuffle(order)
    question = corpus["questions"][0]
    out = []
    for lo in range(0, len(order), n_passages):
        group = order[lo: lo + n_passages]
        group += [p for p in order if p not in group][: n_passages - len(group)]
        out.append(_prompt(corpus, group, question, separator, f"warm-up {lo // n_passages + 1}", completion))
    return out


def run_rag(engine, modes: Sequence[str], *, n_prompts: int | None = None, n_passages: int = DEFAULT_PASSAGES,
            seed: int = DEFAULT_SEED, n_predict: int | None = None, progress: ProgressFn | None = None,
            stop_event: threading.Event | None = None,
            corpus: str | Path = DEFAULT_CORPUS) -> Iterator[RequestRecord]:
    """Warm up (not yielded), then every mode over the same prompts of `corpus` (a name in CORPORA, or a
    path); records carry scenario "rag"."""
    texts = load_corpus(corpus)
    separator = engine.settings.blend_separator
    engine.start()
    completion = wants_completion(engine)
    prompts = build_prompts(texts, separator, n_prompts=n_prompts or DEFAULT_PROMPTS, n_passages=n_passages,
                            seed=seed, completion=completion)
    warm = warmup_prompts(texts, separator, n_passages, seed, completion)
    warm_modes = [m for m in ("lmcache", "blend") if m in modes]
    total = len(warm) * len(warm_modes) + len(prompts) * len(modes)
    done = 0
    for mode in warm_modes:
        for prompt in warm:
            if stop_event is not None and stop_event.is_set():
                return
            if progress is not None:
                progress(done, total, f"{mode}: {prompt.label}")
            record = engine.infer(prompt.request, mode, n_predict, scenario="rag", label=prompt.label)
            if record.error:
                yield record   # a blend refusal or a broken engine: the run says so instead of hiding it
                return
            done += 1
    for mode in modes:
        engine.reset_native_cache()
        for index, prompt in enumerate(prompts, start=1):
            if stop_event is not None and stop_event.is_set():
                return
            if progress is not None:
                progress(done, total, f"{mode}: {prompt.label}")
            record = engine.infer(prompt.request, mode, n_predict, scenario="rag", label=prompt.label,
                                  request_index=index)
            record.expected = prompt.answer
            yield record
            done += 1
    if progress is not None:
        progress(total, total, "done")
