"""One step's batch: which tokens of which running requests go into the next llama_decode.

Decoding sequences first (one token each), then prefill chunks in priority order, at most
BATCH_TOKENS in all. A pure function of the running requests: it changes nothing, so the loop
(kvbridge.scheduler.scheduler) accounts the cells only after the decode succeeded.
"""
from __future__ import annotations

from kvbridge.backends.llama_context import BATCH_TOKENS
from kvbridge.scheduler.requests import Request

# Prefill tokens per step while sequences decode or requests of different priorities prefill: a
# step's time is about linear in its tokens on a CPU (a 512-token step is ~1.2 s with SmolLM2 on 2
# cores, a 128-token one ~0.3 s at 5% lower prefill throughput), and every decoding sequence and a
# newly arrived urgent request wait for the step in flight.
SHARED_STEP_PREFILL = 128

Entry = tuple[int, int, int, bool]        # (token, position, sequence, wants logits)
Batch = list[tuple[Request, list[Entry]]]


def plan_batch(running: list[Request]) -> Batch:
    """Decoding sequences first (one token each), then prefill chunks in priority order. A step
    that carries decode tokens, or prefills of different priorities, takes at most
    SHARED_STEP_PREFILL prefill tokens, so no one waits for a long prefill step."""
    batch = []
    room = BATCH_TOKENS
    ordered = sorted(running, key=lambda r: (len(r.pending) > 1, -r.priority, r.submitted))
    prefilling = [r for r in ordered if len(r.pending) > 1]
    shared = len(prefilling) < len(ordered) or len({r.priority for r in prefilling}) > 1
    prefill_room = SHARED_STEP_PREFILL if shared else BATCH_TOKENS
    for request in ordered:
        if room <= 0:
            break
        take = room if len(request.pending) <= 1 else min(room, prefill_room)
        feed = request.pending[:take]
        if not feed:
            continue
        if len(request.pending) > 1:
            prefill_room -= len(feed)
        last = len(feed) == len(request.pending)
        entries = [(token, request.kv_tokens + i, request.seq, last and i == len(feed) - 1)
                   for i, token in enumerate(feed)]
        batch.append((request, entries))
        room -= len(entries)
    return batch
