"""KVB_SCHED_EXACT: every answer equals the same request run alone in a fresh context, token for token,
whatever else runs, is preempted, swapped or shared.

What a solo run's arithmetic depends on, found on llama.cpp's CPU kernels (Docs/Research.md, "The same
answer under concurrency"), and what this mode does about each:

1. The cells beside a sequence. In the unified cache a sequence's cells sit among other sequences' cells,
   and attention sums over cell indices in SIMD lanes, so the same values one cell further on round
   differently (with one sequence per decode call, SmolLM2's answers still differed). Here the context is
   non-unified (`LlamaContext(exact=True)`): each sequence id has a stream of its own, filled from cell 0
   as in a fresh context, so every sequence attends over exactly the cells its solo run would.
2. The batch shape of each step. Several sequences' decode tokens go into one llama_decode only as many
   at a time as leave every sequence's logits bit for bit those of a decode alone (`probe_decode_width`,
   measured at start: a quantised matmul may switch kernel at four rows, Gemma 3's Q4_K does); prefill
   pieces never share a call with anything else.
3. Where a prefill piece starts and how long it is. A solo run prefills its prompt in BATCH_TOKENS
   pieces from position 0; a piece here ends where a solo piece ends, or at a multiple of ALIGN tokens
   with ALIGN or more left of that solo piece (kernels pick their path by rows: 4 rows and 8 differ, and
   repacked weights group rows by 4). Reused KV (shared cells, a restore) ends on the cut rule's grid with
   its fewest rows or more left of the solo piece (`safe_reuse`): the cut probe's verdict for this model,
   build and CPU (kvbridge.engine.cut_verdicts, the one CachedEngine's restores follow), else ALIGN_RULE,
   a grid of 32 leaving 32 or more.
4. How reused KV was computed. Only prefill-computed prompt cells are shared (never a running request's
   generated tokens, which its decode steps computed one at a time), a preempted sequence is kept whole
   in this process (its own cells back bit for bit; a sliding-window model's, whose saved state holds
   only its last window, goes through the store under a salt of the scheduler's own and comes back
   whole), and the store's objects are the bytes a cold run computes, in CachedEngine's namespace; KV computed
   in a unified cache beside other sequences (the mode off) lives under a namespace of its own (`BATCHED_TAG`)
   and never comes back here.

Batched decoding stays where it is exact: SmolLM2's decode tokens all share one call.

The mode is on by default (KVB_SCHED_EXACT=true: serve, the fleet, the lab). Where it cannot run the scheduler
starts with it off and says why (`off_reason`: a log line at start, a note in the journal, `exact_off_reason`
in serve's /health): KVB_FLASH_ATTN=true (a quantised V cache needs it), or a recurrent model. Falling back
rather than refusing is deliberate: a quantised V cache or a hybrid model is a choice of its own, and serve
should run it, telling the operator the answers are the mode off's.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from kvbridge.backends.llama_context import BATCH_TOKENS
from kvbridge.engine.cold_cut import CutRule
from kvbridge.scheduler.planner import SHARED_STEP_PREFILL, Batch
from kvbridge.scheduler.requests import Request

log = logging.getLogger(__name__)

ALIGN = 32                  # a cut inside a solo prefill piece where nothing was proven: at a multiple of this,
                            # with as many tokens beyond
ALIGN_RULE = CutRule(ALIGN, ALIGN, source="exact mode's fixed grid of 32 (no cut probe verdict for this model, "
                                          "build and CPU)")
BATCHED_TAG = "batched"     # the store's objects of a scheduler with the mode off: KV computed beside other sequences
PROBE_TOKENS = 24           # each probe sequence's prompt
PROBE_STEPS = 2             # decode steps compared at each width


def off_reason(settings, architecture: str = "", recurrent: bool = False) -> str:
    """Why exact mode is off for these settings (and, once the model is loaded, its architecture), written for
    a person; "" when it runs."""
    if not settings.sched_exact:
        return "KVB_SCHED_EXACT=false (or --no-exact): answers may differ from a request run alone"
    if settings.flash_attn:
        quantised_v = settings.cache_type_v.lower() not in ("f16", "f32", "bf16")
        why = (f"KVB_CACHE_TYPE_V={settings.cache_type_v} needs flash attention (KVB_FLASH_ATTN=true)"
               if quantised_v else "KVB_FLASH_ATTN=true")
        return (f"{why}, and exact mode needs it off: llama.cpp's CPU flash attention splits a sequence's cells "
                "between threads by the cache's size, so an answer depends on what else is cached. For exact "
                "answers set KVB_FLASH_ATTN=false" + (" and an f16 V cache" if quantised_v else "")
                + "; KVB_SCHED_EXACT=false says the mode off is meant")
    if recurrent:
        return (f"{architecture or 'this model'} keeps recurrent state, and exact mode is proven on attention-only "
                "models; KVB_SCHED_EXACT=false says the mode off is meant")
    return ""


def solo_piece_end(position: int, prompt_len: int) -> int:
    """Where the solo prefill piece holding `position` ends (pieces of BATCH_TOKENS from position 0)."""
    return min((position // BATCH_TOKENS + 1) * BATCH_TOKENS, prompt_len)


def cut_rule(verdict: CutRule) -> CutRule:
    """Exact mode's rule: the cut probe's verdict where one was proven here (a cut it proves exact after a restore
    is exact where a piece of the scheduler's ends too: the rows before it were computed as a batch ending there,
    the rows after it as a batch starting there), else ALIGN_RULE."""
    return verdict if verdict.proven else ALIGN_RULE


def safe_reuse(n_tokens: int, prompt_len: int, rule: CutRule = ALIGN_RULE) -> int:
    """The most of `n_tokens` reused prompt tokens (shared or restored) after which the rest of the prompt
    prefills with the solo run's arithmetic: at most all but the last token, at the start of a solo piece or on
    `rule`'s grid leaving `rule.min_rows` or more tokens of its solo piece (and, where `rule` was not proven
    across pieces, only in the prompt's last piece); nothing under ALIGN tokens."""
    cut = min(n_tokens, prompt_len - 1)
    if cut <= 0:
        return 0
    start = cut // BATCH_TOKENS * BATCH_TOKENS
    if not rule.crosses_pieces and start < (prompt_len - 1) // BATCH_TOKENS * BATCH_TOKENS:
        return start
    inside = rule.on_grid(min(cut, solo_piece_end(cut, prompt_len) - rule.min_rows))
    cut = max(start, inside)
    # under ALIGN tokens nothing is reused: with Gemma 3 a 4-token share (the chat template's opening) from a
    # 600-token prompt changed two short answers in exact mode, though the cut probe proves such a cut and a
    # prefix's rows do not depend on the prompt that computed them (donor_rows_probe); the cause is not found
    # (Research §35)
    return cut if cut >= ALIGN else 0


def next_piece(request: Request, room: int, first: bool = True) -> int:
    """How many of the request's pending prompt tokens its next prefill piece takes: to the end of the solo
    piece it is in, or, when that is more than `room`, to an ALIGN cut that leaves ALIGN or more of it. When
    no such cut fits the room, the step's first piece takes its whole solo piece (so every step makes
    progress) and a later one takes nothing this step (0): the step stays as short as the room says.

    Always ALIGN, not the cut probe's verdict: a piece cut short by the room may neither start at a solo piece's
    start nor end where a solo piece ends, a batch the probe does not measure (its batches start at a restore's
    end and run to the piece's end, or start at a piece's start and end at a cut)."""
    start, prompt_len = request.kv_tokens, len(request.prompt)
    end = solo_piece_end(start, prompt_len)
    if end - start > room:
        cut = ((start + room) // ALIGN) * ALIGN
        if cut - start >= ALIGN and end - cut >= ALIGN:
            end = cut
        elif not first:
            return 0
    return end - start


def plan_exact(running: list[Request], width: int) -> list[Batch]:
    """The step's llama_decode calls: every decoding sequence's token, `width` sequences a call, then each
    prefilling request's next piece in a call of its own (priority order, BATCH_TOKENS of them in all, or
    SHARED_STEP_PREFILL while sequences decode, so no one waits for a long prefill step). Generated tokens
    that must be computed again (none, while swap-outs are whole) are fed one a call, as decode fed them."""
    ordered = sorted(running, key=lambda r: (-r.priority, r.submitted))
    decoding = [r for r in ordered if r.kv_tokens >= len(r.prompt) - 1 and r.pending]
    prefilling = [r for r in ordered if r.kv_tokens < len(r.prompt) - 1]
    calls: list[Batch] = []
    for at in range(0, len(decoding), max(1, width)):
        group = decoding[at:at + max(1, width)]
        calls.append([(r, [(r.pending[0], r.kv_tokens, r.seq, len(r.pending) == 1)]) for r in group])
    room = SHARED_STEP_PREFILL if decoding or len({r.priority for r in prefilling}) > 1 else BATCH_TOKENS
    full = room
    for request in prefilling:
        if room <= 0:
            break
        take = next_piece(request, room, first=room == full)
        if take == 0:
            continue
        feed = request.pending[:take]
        last = len(feed) == len(request.pending)
        calls.append([(request, [(token, request.kv_tokens + i, request.seq, last and i == len(feed) - 1)
                                 for i, token in enumerate(feed)])])
        room -= len(feed)
    return calls


def probe_decode_width(ctx, seqs: Sequence[int], max_width: int, tokens: Sequence[int]) -> int:
    """The most sequences one decode call may carry with every sequence's logits bit for bit those of its
    decode alone, measured on this machine's kernels: each width up to `max_width` is tried on free sequences
    `seqs` holding short prompts cut from `tokens`, and the first width that changes a logit ends the search.
    The sequences are emptied again."""
    width = 1
    n = min(max_width, len(seqs))
    if n < 2:
        return 1
    prompts = [list(tokens[i:i + PROBE_TOKENS]) or [1] for i in range(n)]
    try:
        for seq, prompt in zip(seqs, prompts):
            _must(ctx.decode([(t, i, seq, i == len(prompt) - 1) for i, t in enumerate(prompt)]))
        for w in range(2, n + 1):
            if not _same_batched(ctx, seqs[:w], prompts[:w]):
                log.info("exact mode: a decode call carries at most %d sequences on this model and CPU", width)
                break
            width = w
    finally:
        for seq in seqs[:n]:
            ctx.seq_rm(seq)
    return width


def _same_batched(ctx, seqs: Sequence[int], prompts: list[list[int]]) -> bool:
    for step in range(PROBE_STEPS):
        entries = [(prompt[step % len(prompt)], len(prompt), seq, True) for seq, prompt in zip(seqs, prompts)]
        alone = []
        for entry in entries:
            _must(ctx.decode([entry]))
            alone.append(ctx.logits(0))
            ctx.seq_rm(entry[2], entry[1], -1)
        _must(ctx.decode(entries))
        together = [ctx.logits(i) for i in range(len(entries))]
        for entry in entries:
            ctx.seq_rm(entry[2], entry[1], -1)
        if not all(np.array_equal(a, b) for a, b in zip(alone, together)):
            return False
    return True


def _must(rc: int) -> None:
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc} while probing the exact mode's decode width")


def solo_answer(ctx, tokens: Sequence[int], n_predict: int, seq: int = 0) -> list[int]:
    """The greedy answer a solo run gives: the prompt prefilled in BATCH_TOKENS pieces from position 0 into
    empty sequence `seq` of a context no other sequence uses, then one token a decode; stops at an end token.
    The reference every exact answer is held to (tests, the benchmark's identity check)."""
    tokens = list(tokens)
    logits = None
    for start in range(0, len(tokens), BATCH_TOKENS):
        piece = tokens[start:start + BATCH_TOKENS]
        _must(ctx.decode([(t, start + i, seq, start + i == len(tokens) - 1) for i, t in enumerate(piece)]))
    logits = ctx.logits(len(tokens) - 1 - (len(tokens) - 1) // BATCH_TOKENS * BATCH_TOKENS)   # the last piece's last
    answer: list[int] = []
    position = len(tokens)
    while len(answer) < n_predict:
        token = int(np.argmax(logits))
        if ctx.is_end(token):
            break
        answer.append(token)
        if len(answer) == n_predict:
            break
        _must(ctx.decode([(token, position, seq, True)]))
        logits = ctx.logits(0)
        position += 1
    ctx.seq_rm(seq)
    return answer


def probe_tokens() -> list[int]:
    """Token ids for probe_decode_width's prompts: ordinary ids every vocabulary has (no text needed)."""
    return list(range(300, 300 + PROBE_TOKENS + 64))


def namespace_key(kv_layout: str, exact: bool) -> str:
    """The KV layout's key in the namespace. Exact mode's objects hold KV computed as a cold run computes it, the
    very bytes CachedEngine stores for the same prompt (tests/test_scheduler_shared_namespace.py compares them),
    so they share CachedEngine's namespace; the mode off tags its own (`BATCHED_TAG`), since KV computed in a
    unified cache beside other sequences is not what a cold run computes, and must reach neither of them."""
    return kv_layout if exact else f"{kv_layout}+{BATCHED_TAG}"


def serve_namespace(engine) -> tuple[str, str]:
    """(the namespace serve's scheduler stores this started CachedEngine's prompts under, with the engine's
    settings; why it is not the engine's own, or ""). Exact mode shares the engine's namespace; the mode off
    (asked for, or forced by flash attention or a recurrent model, as the scheduler forces it) has its own."""
    from kvbridge.engine.namespace import namespace_for

    geometry = engine.geometry
    traits = engine.traits
    why = off_reason(engine.settings, traits.architecture if traits is not None else "",
                     recurrent=bool(geometry is not None and geometry.recurrent))
    if not why or engine.backend.kv_mode != "full" or engine.kv_layout_key is None:
        return engine.namespace, ""
    namespace = namespace_for(engine.settings, fingerprint=engine.backend.kv_fingerprint(),
                              model_path=engine.backend.model_file(),
                              kv_layout=namespace_key(engine.kv_layout_key, False), store=engine.store)
    return namespace, f"serve's scheduler runs with exact mode off ({why.split(':')[0]}): its own namespace"
