"""Workloads for many requests at once: the KV cache lab's scenarios and the scheduler benchmarks.

A workload is a list of timed requests (chat messages, a priority, how much to generate, when it
arrives). The same definitions drive the GUI's KV cache lab (kvbridge.gui.lab), the scheduler
against llama-server benchmark (kvbridge.bench.scheduler_compare) and the tests, so what a person
watches is what was measured.

- **Priority burst**: several low-priority chats over long documents (different sections of the
  cold-store manual, so they share nothing) are running when short urgent requests arrive. A
  scheduler that can preempt swaps a low one out and answers the urgent ones at once; one that
  queues makes them wait for a slot.
- **Shared system prompt, many users**: one long system prompt and a different short question per
  user, all arriving together, on a budget too small for a private copy of the prompt per user.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable

from kvbridge.bench.common.scenarios import DATA_DIR, DOC_QA_SYSTEM, SUPPORT_QUESTIONS
from kvbridge.errors import BadSettings

CHARS_PER_TOKEN = 4.2    # SmolLM2's tokenizer on this English prose: how long a slice of text is in tokens

URGENT_PROMPTS = [
    "A pager alert says: 'Cold room 3 oxygen at 4.1 percent, setpoint 1.5'. In one sentence, what should the "
    "night operator check first?",
    "Translate to French, in one line: 'The packhouse opens at six tomorrow.'",
    "Give a one-line subject for an email telling staff that the forklift inspection moved to Friday.",
    "Is 0.8 degrees Celsius a normal storage temperature for apples? Answer yes or no with a short reason.",
]
LOW_QUESTIONS = [
    "Summarise this section for a new technician, step by step.",
    "List every setting named in this section and explain what each one does.",
    "Write a checklist an operator could follow from this section.",
    "Explain this section to someone who has never seen a cold store.",
]


@dataclass(frozen=True)
class TimedRequest:
    label: str
    messages: tuple[dict, ...]
    priority: int = 5
    n_predict: int = 32
    at_s: float = 0.0          # submitted this long after the workload starts
    urgent: bool = False       # counted among the urgent requests in the burst's figures


@dataclass(frozen=True)
class LabDefaults:
    """The scheduler settings a workload is shown with in the lab (each can be changed there)."""

    kv_cells: int
    max_running: int
    soft: float = 0.25
    hard: float = 0.10
    critical: float = 0.05


@dataclass(frozen=True)
class Workload:
    key: str
    title: str
    description: str
    requests: tuple[TimedRequest, ...]
    defaults: LabDefaults

    def with_priorities(self, priorities: dict[str, int]) -> "Workload":
        """The same workload with some requests' priorities changed (by label); bad values are refused."""
        changed = []
        for request in self.requests:
            value = priorities.get(request.label, request.priority)
            try:
                value = int(value)
            except (TypeError, ValueError):
                raise BadSettings(f"the priority of {request.label!r} must be a whole number 0 to 9, got {value!r}") from None
            if not 0 <= value <= 9:
                raise BadSettings(f"the priority of {request.label!r} must be 0 to 9 (higher is more urgent), got {value}")
            changed.append(replace(request, priority=value))
        return replace(self, requests=tuple(changed))


def manual_sections(min_chars: int) -> list[str]:
    """The cold-store manual cut into consecutive pieces of at least `min_chars` characters, at headings."""
    text = (DATA_DIR / "cold_store_manual.md").read_text(encoding="utf-8")
    parts = re.split(r"\n(?=## )", text)
    sections, current = [], ""
    for part in parts:
        current = f"{current}\n{part}" if current else part
        if len(current) >= min_chars:
            sections.append(current)
            current = ""
    return sections


def priority_burst(*, document_tokens: int = 600, n_low: int = 3, n_urgent: int = 2, low_predict: int = 96,
                   urgent_predict: int = 24, urgent_at_s: float = 2.0, low_priority: int = 1,
                   urgent_priority: int = 9) -> Workload:
    sections = manual_sections(int(document_tokens * CHARS_PER_TOKEN))
    if len(sections) < n_low:
        raise BadSettings(f"the manual has {len(sections)} sections of ~{document_tokens} tokens; ask for fewer "
                          f"low-priority chats or shorter documents")
    low = [TimedRequest(f"doc chat {i + 1}",
                        ({"role": "system", "content": DOC_QA_SYSTEM},
                         {"role": "user", "content": f"Document:\n{sections[i]}\n\n{LOW_QUESTIONS[i % len(LOW_QUESTIONS)]}"}),
                        priority=low_priority, n_predict=low_predict, at_s=0.0)
           for i in range(n_low)]
    urgent = [TimedRequest(f"urgent {i + 1}", ({"role": "user", "content": URGENT_PROMPTS[i % len(URGENT_PROMPTS)]},),
                           priority=urgent_priority, n_predict=urgent_predict, at_s=urgent_at_s + 0.2 * i, urgent=True)
              for i in range(n_urgent)]
    # room for the chats' prompts (whole sections, so longer than asked) and answers with a margin
    # above the watermarks; every running slot is taken, so an urgent request waits or preempts
    needs = sum(_tokens(m["content"]) for r in low for m in r.messages) + n_low * (low_predict + 40)
    cells = int(needs / (1 - 0.20))
    return Workload(
        "priority-burst", "Priority burst",
        f"{n_low} low-priority chats over different ~{document_tokens}-token documents fill every running slot; "
        f"{n_urgent} short urgent requests (priority {urgent_priority}) arrive after {urgent_at_s:g} s. Watch a low "
        "chat get preempted (its KV swapped out to the store), the urgent ones answered, and the low chat swapped "
        "back in to finish where it stopped.",
        tuple(low + urgent), LabDefaults(kv_cells=_round_up(cells, 256), max_running=n_low))


def shared_system_prompt(*, n_users: int = 8, n_predict: int = 24, stagger_s: float = 0.1) -> Workload:
    system = (DATA_DIR / "system_prompt.md").read_text(encoding="utf-8")
    prompt_tokens = int(len(system) / CHARS_PER_TOKEN)
    requests = tuple(
        TimedRequest(f"user {i + 1}", ({"role": "system", "content": system},
                                       {"role": "user", "content": SUPPORT_QUESTIONS[i % len(SUPPORT_QUESTIONS)]}),
                     priority=5, n_predict=n_predict, at_s=stagger_s * i)
        for i in range(n_users))
    per_user = prompt_tokens + 40 + n_predict
    cells = _round_up(per_user * n_users // 3, 256)   # about a third of what 8 private copies would need
    return Workload(
        "shared-system-prompt", "Shared system prompt, many users",
        f"{n_users} users send a short question behind the same ~{prompt_tokens}-token system prompt at once, on a "
        f"KV budget of about a third of {n_users} private copies. The system prompt is prefilled once and its "
        "cells are shared by reference count; finished prompts stay as cached prefixes until pressure evicts them.",
        requests, LabDefaults(kv_cells=max(cells, 1024), max_running=min(n_users, 4)))


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "priority-burst": priority_burst,
    "shared-system-prompt": shared_system_prompt,
}


def get_workload(key: str, **options) -> Workload:
    try:
        build = WORKLOADS[key]
    except KeyError:
        raise BadSettings(f"unknown workload {key!r}; known: {', '.join(WORKLOADS)}") from None
    return build(**options)


def _tokens(text: str) -> int:
    return int(len(text) / CHARS_PER_TOKEN) + 1


def _round_up(n: int, step: int) -> int:
    return -(-int(n) // step) * step
