"""The stages of one request's path to its first token, timed one by one.

    tokenize -> hash -> lookup -> fetch -> assemble -> handoff -> (reset) -> prefill -> first token

- tokenize: the chat template and the tokenizer; hash: the chunk hashes;
- lookup: asking the store which leading chunks it holds; fetch: reading the hit objects (and the
  tail after them) and confirming their token ids, with the bytes read per tier;
- assemble: the objects' cells written into one engine state; handoff: that state given to the
  engine (`llama_state_seq_set_data` in-process, the slot file and its restore for llama-server);
- reset: the engine's own cache dropped (cold requests and misses);
- prefill: the engine evaluating the prompt tokens it did not get restored (llama-server's own
  `timings.prompt_ms`); first_token: from the end of the prefill to the first piece of text
  (sampling, detokenising; through llama-server also the HTTP round trip).

Each stage is timed on its own (not as the gap between two marks), so the stages of a record add
up to its TTFT only while every piece of work on the way is inside one; a test holds them to
that (tests/test_stages.py), so work added to the path without a stage shows up there.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

STAGES = ("tokenize", "hash", "lookup", "fetch", "assemble", "handoff", "reset", "prefill", "first_token")
STAGE_FIELDS = tuple(f"{stage}_ms" for stage in STAGES)
STAGE_LABELS = {"tokenize": "tokenize", "hash": "hash", "lookup": "lookup", "fetch": "fetch", "assemble": "assemble",
                "handoff": "hand to engine", "reset": "reset cache", "prefill": "suffix prefill",
                "first_token": "first token"}


class StageTimer:
    """Milliseconds per stage of one request; a stage entered twice adds up."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = dict.fromkeys(STAGES, 0.0)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if name not in self.ms:
            raise ValueError(f"unknown stage {name!r}; stages are {', '.join(STAGES)}")
        started = time.perf_counter()
        try:
            yield
        finally:
            self.ms[name] += (time.perf_counter() - started) * 1000

    def add(self, name: str, ms: float) -> None:
        self.ms[name] += ms


def stages_of(record) -> dict[str, float]:
    """{stage: ms} of a RequestRecord (or its dict), in path order."""
    get = record.get if isinstance(record, dict) else lambda name, default=0.0: getattr(record, name, default)
    return {stage: float(get(f"{stage}_ms", 0.0) or 0.0) for stage in STAGES}


def stages_gap_ms(record) -> float:
    """TTFT minus the sum of the stages: the time on the way to the first token no stage accounts for."""
    ttft = record["ttft_ms"] if isinstance(record, dict) else record.ttft_ms
    return ttft - sum(stages_of(record).values())


def record_stages(record, timer: StageTimer, report, engine_ms: float) -> None:
    """The stages into a RequestRecord: ours as timed, the engine's as its EngineReport says (an engine that
    reports no prefill time is all prefill; one that reports no first-token time gets the rest)."""
    prefill = report.prefill_ms if report.prefill_ms is not None else engine_ms
    first_token = report.first_token_ms if report.first_token_ms is not None else max(0.0, engine_ms - prefill)
    timer.add("prefill", prefill)
    timer.add("first_token", first_token)
    for stage, ms in timer.ms.items():
        setattr(record, f"{stage}_ms", ms)
    record.restore_ms = record.assemble_ms + record.handoff_ms
