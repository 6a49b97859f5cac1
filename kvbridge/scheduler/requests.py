"""What the scheduler keeps per request and per cached prefix, and its three queues of requests.

A request's context is its prompt followed by what it generated; the KV of context[:kv_tokens] sits
in its llama.cpp sequence, and `pending` (context[kv_tokens:]) is what the next batches feed: the
unprefilled prompt, or the one token just sampled. Preemption empties the sequence (kv_tokens = 0,
pending = the whole context) and swap-in restores all it can, so a request resumes where it stopped.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from kvbridge.backends.llama_context import Sampler
from kvbridge.backends.text_decoding import Utf8Decoder
from kvbridge.engine.records import RequestRecord
from kvbridge.scheduler.ledger import Holding
from kvbridge.scheduler.sequence_store import SwapTicket


@dataclass
class Request:
    id: int
    label: str
    priority: int
    prompt: list[int]
    n_predict: int
    sampler: Sampler
    stop: tuple[str, ...]
    on_token: Callable[[str], None] | None
    future: Future
    record: RequestRecord
    submitted: float = field(default_factory=time.perf_counter)
    state: str = "waiting"          # waiting, running, swapped, done
    seq: int | None = None
    held: Holding | None = None
    generated: list[int] = field(default_factory=list)
    kv_tokens: int = 0
    pending: list[int] = field(default_factory=list)
    text: str = ""
    pieces: Utf8Decoder = field(default_factory=Utf8Decoder)
    prompt_stored: bool = False
    store_pending: bool = False          # its prompt's KV is to be stored (after the token that went out)
    first_token_at: float | None = None
    admitted_at: float | None = None
    swap: SwapTicket | None = None       # what swap-out left in the store (pinned until the request resumes)
    salt: str = ""                       # cache salt (a tenant's): shares cells and stored KV only with the same
    segments: tuple[int, ...] = ()       # where instruction, passages, question start (kvbridge.engine.segments)
    blend: bool = False                  # place stored passages at any position (approximate KV: never shared,
                                         # swapped or stored as exact chunks)
    blend_placement: Any = None          # kvbridge.blend.runner.Placement: what to store after the answer
    blend_result: Any = None             # kvbridge.blend.runner.BlendResult of the placement
    # a recurrent or hybrid model: the sequence's recurrent state (PARTIAL_ONLY bytes) after the prompt's first n
    # tokens, by n, captured where its prefill steps end (each chunk's end, and one token before the prompt's end)
    boundaries: dict[int, bytes] = field(default_factory=dict)
    min_tokens: int = 0                  # no end token and no stop string counts before this many were generated
    ignore_eos: bool = False             # end-of-generation tokens are never sampled (stop strings still stop)
    store_before_answer: bool = False    # the Future resolves only once the prompt's KV is in the store
    stop_from: int = 0                   # a stop string counts only where it ends past text[:stop_from] (min_tokens)

    def __post_init__(self) -> None:
        self.pending = list(self.prompt)

    @property
    def holder(self) -> str:
        return f"req-{self.id}"

    @property
    def context(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def prefilling(self) -> bool:
        return self.kv_tokens < len(self.prompt)

    @property
    def may_end(self) -> bool:
        """An end-of-generation token may be sampled now (not under ignore_eos, nor before min_tokens)."""
        return not self.ignore_eos and len(self.generated) >= self.min_tokens

    def describe(self) -> dict:
        return {"id": self.id, "label": self.label, "priority": self.priority, "state": self.state,
                "tokens": len(self.context), "kv_tokens": self.kv_tokens, "generated": len(self.generated),
                "preemptions": self.record.preemptions}


@dataclass
class CachedPrefix:
    """A finished request's prompt kept resident in a sequence of its own, so later prompts share it."""

    id: int
    seq: int
    tokens: list[int]
    held: Holding
    label: str = ""
    last_used: float = field(default_factory=time.monotonic)
    salt: str = ""                  # the cache salt of the request it came from: shared only with the same

    @property
    def holder(self) -> str:
        return f"prefix-{self.id}"


@dataclass
class Queues:
    """Who runs, who waits to be admitted, who waits swapped out: the lists every part of the loop reads
    (changed in place, so each part may hold them)."""

    running: list[Request] = field(default_factory=list)
    waiting: list[Request] = field(default_factory=list)
    swapped: list[Request] = field(default_factory=list)

    def everyone(self) -> list[Request]:
        return self.running + self.waiting + self.swapped

    def busy(self) -> bool:
        return bool(self.running or self.waiting or self.swapped)

    def remove_everywhere(self, request: Request) -> None:
        for queue_ in (self.running, self.waiting, self.swapped):
            queue_[:] = [r for r in queue_ if r is not request]

    def salts_in_use(self) -> set[str]:
        return {r.salt for r in self.everyone()}
