"""Prefill/decode disaggregation through the shared cache: what each leg of a PD router asks of this
instance, and what the prefill leg answers.

vllm-router's PD mode (`--vllm-pd-disaggregation --prefill URL --decode URL`) sends the prefill worker
the request with max_tokens 1, stream false and `kv_transfer_params` {"do_remote_decode": true, ...};
once that answered, the decode worker gets the original request plus the prefill answer's
`kv_transfer_params`, copied verbatim. No KV travels between the two here: the prefill leg stores
every chunk of its prompt in the shared store (the cache server of KVB_STORE_URL, or L3), and the decode
leg's admission restores them as it restores any stored prefix.

The prefill leg answers once its prompt's write has landed, and says what the store holds then, under
"kv_transfer_params": {"kvbridge": {...}} (with its own timings, so a hand-off can be taken apart); never
"transfer_mode" (that sends vllm-router down its NIXL path). Answering at the first token instead, with the
decode leg polling the store for the promised prefix, was tried and measured (Docs/Research.md §34): it gained
nothing on two cores, and a poll that reads the previous prompt's tail while the new one is put makes the cache
server refuse the newer tail as busy, so the decode leg found its promise never kept.

KVB_SERVE_ROLE: `both` (the default: each leg as asked), `prefill` (every request is stored before it
is answered: the instance exists to fill the shared cache), `decode` (a prefill leg is refused).
"""
from __future__ import annotations

import logging

from kvbridge.serve.protocol import ApiError, Generation

log = logging.getLogger(__name__)
RESTORED_HEADER = "X-KVBridge-Restored-Tokens"   # a decode leg's: prompt tokens restored or shared, not prefilled


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


def prefill_params(instance: str, record, chunk_size: int, model_id: str) -> dict:
    """The prefill answer's kv_transfer_params: what the decode leg will find in the shared store."""
    return {"kvbridge": {"instance": instance, "prompt_tokens": record.prompt_tokens,
                         "stored_tokens": int(getattr(record, "stored_tokens", 0)), "chunk_size": chunk_size,
                         "model": model_id,
                         # the leg's own path (the request's only: its queue, its first token, its end), so a
                         # hand-off can be taken apart stage by stage (kvbridge.bench.probes.pd_probe)
                         "timings_ms": {"queue": round(record.queue_ms, 1), "first_token": round(record.ttft_ms, 1),
                                        "finished": round(record.total_ms, 1)}}}


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

