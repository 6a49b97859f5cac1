"""bench-fleet's workload: several long documents, questions about them interleaved, asked through the openai SDK.

Place in the flow: kvbridge.bench.fleet_bench starts the fleets; this module says what is asked and how
one streamed request is timed. Everything here is deterministic for a seed: the documents are cut from
kvbridge/data/cold_store_manual.md (a run of whole sections each, ~`document_chars` characters, under
a title line of its own so no two documents share a first chunk), the questions are the same few
generic ones about each document, and their order is a seeded random interleaving that keeps each
document's questions in order (a plain cycle would line documents up with round_robin's turn).

A request is the Document Q&A shape with the document first: the system message is the document and
then the instruction, the user message is the question. It is sent streamed and greedy with
`stream_options.include_usage`; TTFT is the client's, from just before the SDK call to the first chunk
carrying content; the instance that answered is the response's X-KVBridge-Instance header (which the
router passes through). Left out: sampling, tools, and anything a router does not forward.
"""
from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass

from kvbridge.bench.common.scenarios import DATA_DIR, DOC_QA_SYSTEM
from kvbridge.bench.common.streamed_chat import stream_chat

INSTANCE_HEADER = "X-KVBridge-Instance"   # read as any client reads it: the bench layer imports nothing of serve
REQUEST_TIMEOUT_S = 600.0
MANUAL = "cold_store_manual.md"
QUESTIONS = (
    "What is the main subject of this part of the manual?",
    "Which numbers or settings does this part mention?",
    "Who is this part written for?",
    "What should be done first, according to this part?",
    "What warning does this part give?",
    "Which part of the controller does this part describe?",
    "What is the last instruction in this part?",
    "Name one word from the title of this part.",
)


@dataclass(frozen=True)
class Document:
    title: str
    text: str       # the title line first, then the sections


@dataclass(frozen=True)
class Question:
    doc: int         # index into the documents
    number: int      # index into QUESTIONS

    @property
    def key(self) -> str:
        return f"d{self.doc}q{self.number}"


@dataclass
class Answer:
    """One streamed request as the client saw it."""
    key: str
    doc: int
    number: int
    ttft_ms: float | None = None          # request sent -> first chunk with content
    last_token_ms: float | None = None    # request sent -> last chunk with content
    total_ms: float | None = None
    sent_s: float = 0.0                   # when it was sent, seconds from the run's start
    prompt_tokens: int = 0
    cached_tokens: int = 0                # usage.prompt_tokens_details.cached_tokens (absent: 0, and noted)
    completion_tokens: int = 0
    instance: str = ""                    # X-KVBridge-Instance
    text: str = ""
    error: str = ""

    @property
    def time_per_output_token_ms(self) -> float | None:
        if self.ttft_ms is None or self.last_token_ms is None or self.completion_tokens < 2:
            return None
        return (self.last_token_ms - self.ttft_ms) / (self.completion_tokens - 1)


def documents(count: int, document_chars: int) -> list[Document]:
    """`count` documents cut from the manual: whole sections up to ~document_chars each, a title line first."""
    text = (DATA_DIR / MANUAL).read_text(encoding="utf-8")
    manual_title = text.splitlines()[0].lstrip("# ").split(":")[0]
    sections = re.split(r"\n(?=## )", text.split("\n", 1)[1].strip())
    docs, part = [], []
    for section in sections:
        part.append(section.strip())
        if sum(len(s) for s in part) >= document_chars:
            docs.append(_document(part, len(docs) + 1, manual_title, document_chars))
            part = []
        if len(docs) == count:
            return docs
    raise ValueError(f"the manual holds only {len(docs)} documents of ~{document_chars} characters; "
                     f"--documents {count} asks for more")


def _document(sections: list[str], number: int, manual_title: str, document_chars: int) -> Document:
    first = sections[0].splitlines()[0].lstrip("# ")
    topic = first.split(". ", 1)[-1]
    title = f"{topic}: part {number} of the {manual_title} manual"
    body = "\n\n".join(sections)
    if len(body) > document_chars:
        cut = body.rfind(" ", 0, document_chars + 1)
        body = body[:cut if cut > 0 else document_chars]
    return Document(title, f"{title}\n\n{body}")


def interleaved(n_documents: int, per_document: int, seed: int) -> list[Question]:
    """Every document's questions 0..per_document-1, in order per document, documents mixed at random (seeded)."""
    if per_document > len(QUESTIONS):
        raise ValueError(f"--questions-per-document is at most {len(QUESTIONS)}, got {per_document}")
    rng = random.Random(seed)
    left = {d: list(range(per_document)) for d in range(n_documents)}
    order = []
    while left:
        # a document drawn with weight = its questions left: a uniformly random interleaving
        doc = rng.choices(list(left), weights=[len(q) for q in left.values()])[0]
        order.append(Question(doc, left[doc].pop(0)))
        if not left[doc]:
            del left[doc]
    return order


def messages(document: Document, number: int) -> list[dict]:
    return [{"role": "system", "content": f"{document.text}\n\n{DOC_QA_SYSTEM}"},
            {"role": "user", "content": QUESTIONS[number]}]


def client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)


def ask(client, model: str, docs: list[Document], question: Question, max_tokens: int, *,
        cache_salt: str = "", started: float | None = None) -> Answer:
    """One streamed, greedy chat request through the SDK; its error (if any) goes into the answer."""
    answer = Answer(question.key, question.doc, question.number)
    answer.sent_s = time.perf_counter() - started if started is not None else 0.0
    sent = stream_chat(client, model, messages(docs[question.doc], question.number), max_tokens,
                       extra_body={"cache_salt": cache_salt} if cache_salt else None)
    answer.instance = sent.headers.get(INSTANCE_HEADER.lower(), "")
    answer.ttft_ms, answer.last_token_ms, answer.total_ms = sent.ttft_ms, sent.last_token_ms, sent.total_ms
    answer.prompt_tokens, answer.completion_tokens = sent.prompt_tokens, sent.completion_tokens
    answer.cached_tokens = sent.cached_tokens or 0
    answer.text, answer.error = sent.text, sent.error
    return answer
