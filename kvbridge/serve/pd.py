"""Prefill/decode disaggregation through the shared cache: what each leg of a PD router asks of this
instance, and what the prefill leg answers.

vllm-router's PD mode (`--vllm-pd-disaggregation --prefill URL --decode URL`) sends the prefill worker
the request with max_tokens 1, stream false and `kv_transfer_params` {"do_remote_decode": true, ...};
once that answered, the decode worker gets the original request plus the prefill answer's
`kv_transfer_params`, copied verbatim. No KV travels between the two here: the prefill leg stores
every chunk of its prompt in the shared store (the cache server of KVB_STORE_URL, or L3), and the decode
leg's admission restores them as it restores any stored prefix.

The hand-off is a pipeline: the prefill leg answers at its first token, while its prompt's write (never
skipped) is still under way, and says so ("written": false, the tokens it will have stored); the router's
hop and the decode leg's arrival overlap that write, and the decode leg waits, before its admission, until the
store holds the promised prefix (polled, at most HANDOFF_WAIT_S: past it the rest is computed, as any miss
is, so a lost write costs time, never the answer). Measured in Docs/Research.md §34. The prefill answer says
what it stored under "kv_transfer_params": {"kvbridge": {...}}; never "transfer_mode" (that sends vllm-router
down its NIXL path).

KVB_SERVE_ROLE: `both` (the default: each leg as asked), `prefill` (every request is stored before it
is answered: the instance exists to fill the shared cache), `decode` (a prefill leg is refused).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from kvbridge.serve.protocol import ApiError, Generation

log = logging.getLogger(__name__)
RESTORED_HEADER = "X-KVBridge-Restored-Tokens"   # a decode leg's: prompt tokens restored or shared, not prefilled
HANDOFF_WAIT_S = 5.0    # the longest a decode leg waits for its prefill leg's write: a write of a few thousand
                        # tokens takes well under a second here; past this the write is presumed lost
HANDOFF_POLL_S = 0.003  # between two looks at the store (each a lookup and a read of the tail's header and ids)


def is_prefill_leg(gen: Generation) -> bool:
    """The request is a PD prefill leg: its kv_transfer_params ask for a remote decode."""
    return (gen.kv_transfer_params or {}).get("do_remote_decode") is True


def stores_before_answer(gen: Generation, role: str) -> bool:
    """Whether the request's prompt must be in the store before it is answered (a prefill leg, or every
    request on a prefill instance). ApiError for a prefill leg this instance cannot be."""
    prefill_leg = is_prefill_leg(gen)
    if prefill_leg and role == "decode":
        raise ApiError(400, "this instance only decodes (KVB_SERVE_ROLE=decode): send the prefill leg "
                            "(kv_transfer_params.do_remote_decode) to an instance whose role is prefill or both",
                       param="kv_transfer_params", code="wrong_role")
    if prefill_leg and gen.stream:
        raise ApiError(400, "a prefill leg (kv_transfer_params.do_remote_decode) is answered whole, with what it "
                            "stored: send it with stream false", param="stream")
    return prefill_leg or role == "prefill"


def answers_at_first_token(gen: Generation) -> bool:
    """A PD prefill leg answers at its first token, its write still under way (a request on a prefill instance
    that is no leg keeps its promise: answered once stored)."""
    return is_prefill_leg(gen)


def prefill_params(instance: str, record, chunk_size: int, model_id: str, written: bool = True) -> dict:
    """The prefill answer's kv_transfer_params: what the decode leg will find in the shared store (written: in
    it now; else the prompt's tokens once the write under way lands)."""
    stored = int(getattr(record, "stored_tokens", 0)) if written else record.prompt_tokens
    return {"kvbridge": {"instance": instance, "prompt_tokens": record.prompt_tokens,
                         "stored_tokens": stored, "written": written, "chunk_size": chunk_size,
                         "model": model_id,
                         # the leg's own path (the request's only: its queue, its first token, its end), so a
                         # hand-off can be taken apart stage by stage (kvbridge.bench.probes.pd_probe)
                         "timings_ms": {"queue": round(record.queue_ms, 1), "first_token": round(record.ttft_ms, 1),
                                        **({"finished": round(record.total_ms, 1)} if written else {})}}}


def decode_leg(gen: Generation) -> dict | None:
    """What the prefill leg stored, when this request is the decode leg after it; None otherwise."""
    entry = (gen.kv_transfer_params or {}).get("kvbridge")
    return entry if isinstance(entry, dict) else None


def check_restore(entry: dict, record) -> None:
    """Log (at info) a decode leg that found less of its prompt than the prefill leg stored: those
    tokens were prefilled again (the store evicted them, or the two instances use different stores)."""
    stored = entry.get("stored_tokens")
    if isinstance(stored, int) and not isinstance(stored, bool) and record.matched_tokens < stored:
        log.info("decode leg: %d of the %d prompt tokens the prefill instance %s stored were restored; the rest "
                 "was prefilled again (is KVB_STORE_URL the same cache server on both?)",
                 record.matched_tokens, stored, entry.get("instance", "?"))


def handoff_pending(entry: dict | None) -> bool:
    """The decode leg of a prefill leg that answered before its write landed."""
    return isinstance(entry, dict) and entry.get("written") is False and _count(entry.get("stored_tokens")) > 0


def wait_for_handoff(entry: dict, reach: Callable[[], int], timeout_s: float = HANDOFF_WAIT_S,
                     clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> int:
    """Wait until the store holds the prefix the prefill leg promised (`reach`: how many leading prompt tokens it
    holds now; negative: this engine cannot tell, so nothing is waited for), or `timeout_s` passed; what it held
    last. All but the last prompt token is enough: a restore never takes more."""
    target = _count(entry.get("stored_tokens")) - 1
    deadline = clock() + timeout_s
    while True:
        held = reach()
        if held < 0 or held >= target:
            return held
        if clock() >= deadline:
            log.info("decode leg: the store held %d of the %d prompt tokens the prefill instance %s promised after "
                     "%.1f s; the rest is prefilled here", held, target + 1, entry.get("instance", "?"), timeout_s)
            return held
        sleep(HANDOFF_POLL_S)


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
