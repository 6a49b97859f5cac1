"""One step's batch: which tokens of which running requests go into the next llama_decode.

Decoding sequences first (one token each), then prefill chunks in priority order, at most
BATCH_TOKENS in all. A recurrent or hybrid model's prefill pieces end where its chunks end and one token
before the prompt's end (`boundary_step`), so the recurrent state can be captured there for the
chunks stored after the answer (kvbridge.scheduler.streaming); the batching is otherwise the same.
A pure function of the running requests: it changes nothing, so the loop
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


def plan_batch(running: list[Request], boundary_step: int = 0) -> Batch:
    """Decoding sequences first (one token each), then prefill chunks in priority order. A step
    that carries decode tokens, or prefills of different priorities, takes at most
    SHARED_STEP_PREFILL prefill tokens, so no one waits for a long prefill step. boundary_step: a
    recurrent model's chunk size (0: none), where a prefill piece must end (to_boundary)."""
    batch = []
    room = BATCH_TOKENS
    ordered = sorted(running, key=lambda r: (len(r.pending) > 1, -r.priority, r.submitted))
    prefilling = [r for r in ordered if len(r.pending) > 1]
    shared = len(prefilling) < len(ordered) or len({r.priority for r in prefilling}) > 1
    prefill_room = SHARED_STEP_PREFILL if shared else BATCH_TOKENS
    for request in ordered:
        if room <= 0:
            break
        take = room if len(request.pending) <= 1 else min(room, prefill_room, to_boundary(request, boundary_step))
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


def capture_points(request: Request, step: int) -> bool:
    """Whether the request's prefill stops at boundaries: a recurrent model's prompt still to be stored (a blend
    request's never is, and a resumed one's was already)."""
    return step > 0 and not request.blend and not request.prompt_stored


def is_boundary(request: Request, step: int) -> bool:
    """The sequence's state now is one a stored chunk or the tail carries: a chunk's end, or the prompt's last
    token but one (where a repeated prompt restores to)."""
    n, last = request.kv_tokens, len(request.prompt) - 1
    return capture_points(request, step) and 0 < n <= last and (n % step == 0 or n == last)


def to_boundary(request: Request, step: int) -> int:
    """How many pending tokens the next piece may take so that it ends at the next boundary (all of them where
    the request keeps none)."""
    n, last = request.kv_tokens, len(request.prompt) - 1
    if not capture_points(request, step) or n >= last:
        return len(request.pending)
    return min((n // step + 1) * step, last) - n
