"""From a submit to a request the loop can run: the refusals, the prompt's tokens and the checks.

Runs on the submitting thread (Scheduler.submit), before the request joins the waiting queue: a
request that can never run is refused on its own Future, and the loop never sees it.
"""
from __future__ import annotations

from kvbridge.engine.segments import tokenize_segments
from kvbridge.errors import KVBridgeError
from kvbridge.settings import Settings


class RequestRefused(KVBridgeError):
    """A request the scheduler cannot take (too long for the budget, a priority out of range, a full queue)."""


class QueueFull(RequestRefused):
    """KVB_SCHED_MAX_WAITING requests are already waiting."""


class PromptTokens(list):
    """A prompt's token ids, and where its segments start when it was cut by the blend separator."""

    def __init__(self, tokens, segments: tuple[int, ...] = ()) -> None:
        super().__init__(int(t) for t in tokens)
        self.segments = tuple(segments)


def prompt_tokens(ctx, separator: str, prompt, cut: bool = False) -> PromptTokens:
    """Token ids (with the segment starts); a blend request (`cut`) cut by the blend separator is
    tokenized segment by segment, any other prompt as it is, separator and all (a message that holds
    the separator reaches the model unaltered). `ctx`: the LlamaContext (its template and tokenizer)."""
    if isinstance(prompt, str):
        text = prompt
    else:
        text = ctx.render(tuple(dict(m) for m in prompt))
    if not text:
        raise RequestRefused("the prompt is empty")
    segmented = tokenize_segments(text, separator, ctx.tokenize) if cut else None
    if segmented is not None:
        return PromptTokens(segmented.tokens, segmented.starts)
    return PromptTokens(ctx.tokenize(text))


def check_queue(n_waiting: int, settings: Settings) -> None:
    """Refuse a request when KVB_SCHED_MAX_WAITING are waiting already."""
    if n_waiting >= settings.sched_max_waiting:
        raise QueueFull(f"{n_waiting} requests are waiting already (KVB_SCHED_MAX_WAITING="
                        f"{settings.sched_max_waiting}); try again when some have finished")


def check_request(settings: Settings, n_cells: int, tokens: list[int], priority, n_predict) -> None:
    """Refuse a priority out of range, an n_predict below one, or a prompt no budget can hold."""
    if not isinstance(priority, int) or not 0 <= priority <= 9:
        raise RequestRefused(f"priority {priority!r} is out of range; use 0 to 9 (higher is more urgent)")
    if n_predict is not None and int(n_predict) < 1:
        raise RequestRefused(f"n_predict must be at least 1, got {n_predict}")
    budget = min(settings.ctx_size, n_cells)
    if len(tokens) + 1 > budget:
        raise RequestRefused(f"the prompt has {len(tokens)} tokens; one request may use at most {budget} "
                             f"(KVB_CTX_SIZE={settings.ctx_size}, serve's -c; KVB_SCHED_KV_CELLS={n_cells})")
