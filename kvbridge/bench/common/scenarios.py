"""Demo scenarios: repeated long prompts of the kinds that make TTFT suffer, as a registry.

Each scenario builds a list of requests (chat messages, or an engine restart). The documents and
prompts are written for this project and ship in kvbridge/data; a text file dropped in input/ can be
used as the document.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from kvbridge.engine.records import RequestRecord
from kvbridge.errors import BadSettings
from kvbridge.settings import Settings

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
DOC_QA_SYSTEM = "You answer questions about the document you are given. Answer briefly, using only the document."

HANDBOOK_QUESTIONS = [
    "Who is the general manager of the cooperative?",
    "How deep are Well One and Well Two?",
    "Why is spring water blended with well water?",
    "How often are the filters backwashed?",
    "How much water does the Quarry Hill reservoir hold?",
    "What happens when turbidity at the plant outlet exceeds 1.0 NTU?",
    "Where are the bacteriological samples analysed?",
    "What was the leakage rate in 2024?",
    "How much is the volumetric charge per cubic metre?",
    "How is a boil-water notice announced?",
    "How big is the emergency stock of bottled water?",
    "What will replace the Ashgrove tank?",
]

SUPPORT_QUESTIONS = [
    "Are you open on Mondays?",
    "How much does a full service cost for my cargo bike?",
    "My e-bike battery got dropped, can I still charge it?",
    "What does the lifetime warranty cover?",
    "How much is a week of touring bike rental?",
    "My brakes feel weak, what should I do?",
    "Can I pay by card in the chat?",
    "How long does a puncture repair on a hub-motor wheel cost?",
]

CHAT_TURNS = [
    ("I want to plan a three-day cycling trip along a river. Where should I start?",
     "Start by choosing a river route with marked cycle paths and villages every 20 to 30 kilometres, so you can rest and find food."),
    ("How far should I ride each day if I am a beginner?",
     "Around 40 to 50 kilometres a day is comfortable for a beginner, with breaks every hour."),
    ("What should I pack?",
     "Pack a repair kit, a spare tube, rain gear, sun cream, two water bottles, snacks and a light lock."),
    ("Should I book places to sleep in advance?",
     "Yes, book the first night at least, and check that the places accept bicycles indoors."),
    ("What if it rains on the second day?",
     "Ride shorter, wear the rain gear, keep the brakes in mind on wet roads, and plan a cafe stop to dry off."),
    ("How do I keep my phone charged for navigation?",
     "Carry a small power bank, dim the screen, and download offline maps before you leave."),
    ("Any advice for the last day?",
     "Keep the last day short so you have time for the trip home, and check the train rules for bicycles."),
]


@dataclass(frozen=True)
class ScenarioRequest:
    messages: tuple[dict, ...] = ()
    label: str = ""
    action: str = "infer"          # "infer", or "restart": restart the engine and drop L1 (a process restart)


@dataclass(frozen=True)
class ScenarioOptions:
    n_requests: int | None = None  # None: the scenario's own count
    document: str | None = None    # None: the built-in document
    lengths: tuple[int, ...] | None = None  # prompt lengths in tokens, for scenarios that sweep them
    corpus: str | None = None      # rag: a corpus name (kvbridge.bench.rag.CORPORA) or a path; None: railway


# A scenario that is a measurement rather than a list of requests runs itself:
# (engine, modes, options, progress, stop_event, n_predict) -> records, as run_scenario yields them.
RunFn = Callable[..., Iterator[RequestRecord]]


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    description: str
    build: Callable[[ScenarioOptions], list[ScenarioRequest]] | None = field(default=None, repr=False)
    default_requests: int = 0
    run: RunFn | None = field(default=None, repr=False)
    # the context (tokens) a run needs for (options, n_predict); the bench raises KVB_CTX_SIZE to it
    context_needed: Callable[[ScenarioOptions, int], int] | None = field(default=None, repr=False)


_SCENARIOS: dict[str, Scenario] = {}


def register_scenario(scenario: Scenario) -> Scenario:
    _SCENARIOS[scenario.key] = scenario
    return scenario


def scenario_specs() -> list[Scenario]:
    return list(_SCENARIOS.values())


def get_scenario(key: str) -> Scenario:
    try:
        return _SCENARIOS[key]
    except KeyError:
        raise BadSettings(f"Unknown scenario {key!r}; known scenarios: {', '.join(_SCENARIOS)}.") from None


def build_requests(key: str, n_requests: int | None = None, document: str | None = None) -> list[ScenarioRequest]:
    if n_requests is not None and n_requests < 1:
        raise BadSettings(f"The number of requests must be at least 1, got {n_requests}.")
    scenario = get_scenario(key)
    if scenario.build is None:
        raise BadSettings(f"The {key!r} scenario is a measurement with its own runner: run it with "
                          f"`python -m kvbridge bench --scenario {key}` or from the GUI.")
    return scenario.build(ScenarioOptions(n_requests=n_requests, document=document))


def builtin_document() -> str:
    return (DATA_DIR / "handbook.md").read_text(encoding="utf-8")


def list_documents(settings: Settings) -> dict[str, str]:
    """Built-in documents plus the text files in input/ (name -> text)."""
    docs = {"Water cooperative handbook (built-in, ~1.7k tokens)": builtin_document()}
    input_dir = Path(settings.input_dir)
    if input_dir.is_dir():
        for path in sorted(input_dir.iterdir()):
            if path.is_file() and path.suffix.lower() in {".txt", ".md", ".rst", ".csv", ".json", ".html"}:
                try:
                    docs[f"input/{path.name}"] = path.read_text(encoding="utf-8", errors="replace")
                except OSError:
                    continue   # unreadable files are simply not offered
    return docs


def _take(requests: list, n: int | None) -> list:
    return requests if n is None else [requests[i % len(requests)] for i in range(n)]


def _doc_messages(document: str, question: str) -> tuple[dict, ...]:
    return ({"role": "system", "content": DOC_QA_SYSTEM},
            {"role": "user", "content": f"Document:\n{document}\n\nQuestion: {question}"})


def _doc_qa(opts: ScenarioOptions) -> list[ScenarioRequest]:
    doc = opts.document or builtin_document()
    questions = _take(HANDBOOK_QUESTIONS, opts.n_requests)
    return [ScenarioRequest(_doc_messages(doc, q), f"Q{i + 1}: {q}") for i, q in enumerate(questions)]


def _system_prompt(opts: ScenarioOptions) -> list[ScenarioRequest]:
    system = (DATA_DIR / "system_prompt.md").read_text(encoding="utf-8")
    return [ScenarioRequest(({"role": "system", "content": system}, {"role": "user", "content": q}), f"U{i + 1}: {q}")
            for i, q in enumerate(_take(SUPPORT_QUESTIONS, opts.n_requests))]


def _multi_turn(opts: ScenarioOptions) -> list[ScenarioRequest]:
    history: list[dict] = [{"role": "system", "content": "You are a helpful cycling-trip planner."}]
    requests = []
    for i, (user, assistant) in enumerate(_take(CHAT_TURNS, opts.n_requests)):
        history.append({"role": "user", "content": user})
        requests.append(ScenarioRequest(tuple(history), f"turn {i + 1}"))
        history.append({"role": "assistant", "content": assistant})  # scripted, so every mode sees the same history
    return requests


def _engine_restart(opts: ScenarioOptions) -> list[ScenarioRequest]:
    doc = opts.document or builtin_document()
    n = max(2, opts.n_requests or 4)
    questions = _take(HANDBOOK_QUESTIONS, n)
    half = max(1, n // 2)
    requests = [ScenarioRequest(_doc_messages(doc, q), f"Q{i + 1} before restart") for i, q in enumerate(questions[:half])]
    requests.append(ScenarioRequest(label="restart engine, drop L1", action="restart"))
    requests += [ScenarioRequest(_doc_messages(doc, q), f"Q{i + 1 + half} after restart")
                 for i, q in enumerate(questions[half:])]
    return requests


register_scenario(Scenario(
    "doc-qa", "Document Q&A",
    "One ~1.9k-token document, 12 different questions (RAG). Every request repeats the document; "
    "only the question changes.", _doc_qa, len(HANDBOOK_QUESTIONS)))
register_scenario(Scenario(
    "system-prompt", "Shared system prompt",
    "One long system prompt shared by varied short user turns, as in a support assistant.",
    _system_prompt, len(SUPPORT_QUESTIONS)))
register_scenario(Scenario(
    "multi-turn", "Multi-turn chat",
    "A conversation whose history grows every turn, as in an agent loop or chat app.", _multi_turn, len(CHAT_TURNS)))
register_scenario(Scenario(
    "engine-restart", "Engine restart",
    "Document Q&A, then the engine is restarted and L1 dropped (as a process restart would); "
    "the next requests restore from L2 on disk.", _engine_restart, 4))


def _long_context_run(engine, modes, opts: ScenarioOptions, progress=None, stop_event=None, n_predict=None):
    from kvbridge.bench.long_context import run_long_context

    return run_long_context(engine, modes, lengths=opts.lengths, warm_repeats=opts.n_requests, n_predict=n_predict,
                            document=opts.document, progress=progress, stop_event=stop_event)


def _long_context_needed(opts: ScenarioOptions, n_predict: int) -> int:
    from kvbridge.bench.long_context import context_needed

    return context_needed(opts.lengths, n_predict)


register_scenario(Scenario(
    "long-context", "Long context (512 to 8k tokens)",
    "Prompts of about 512, 1k, 2k, 4k and 8k tokens (a ~9k-token manual plus a short question): cold, warm "
    "native and warm lmcache TTFT per length, and each restore against a plain memory copy of its bytes. "
    "The number of requests is the warm requests per length and mode. Lengths beyond the engine's context "
    "(KVB_CTX_SIZE) are clipped to it; the CLI bench raises the context itself.",
    default_requests=3, run=_long_context_run, context_needed=_long_context_needed))


def _rag_run(engine, modes, opts: ScenarioOptions, progress=None, stop_event=None, n_predict=None):
    from kvbridge.bench.rag import DEFAULT_CORPUS, run_rag

    return run_rag(engine, modes, n_prompts=opts.n_requests, n_predict=n_predict, progress=progress,
                   stop_event=stop_event, corpus=opts.corpus or DEFAULT_CORPUS)


register_scenario(Scenario(
    "rag", "RAG with shuffled passages",
    "Each prompt: an instruction, 4 passages of ~250 tokens from a 16-passage handbook (the one holding the "
    "answer and 3 others) in a changing order, then the question. A prefix cache reuses the instruction only; "
    "blend mode reuses every passage seen before, wherever it stands. Run cold, lmcache and blend: the summary "
    "shows each mode's answers against cold's. Every passage is seen once in a warm-up first.",
    default_requests=12, run=_rag_run))
