"""What each RequestRecord field means, for a person: the table in Docs/Python.md is made from this and the
dataclass itself (`python -m kvbridge.engine.record_fields` prints it), and a test holds the two equal, so
the guide cannot drift from the code. A field without a line here fails that test.
"""
from __future__ import annotations

from dataclasses import MISSING, fields

from kvbridge.engine.records import RequestRecord

FIELD_DOCS: dict[str, str] = {
    "mode": "the mode it ran in: cold, native, lmcache or blend",
    "engine": "the engine's key (llama.cpp, llama-server, ollama, ...)",
    "kv_mode": "`full` (KV leaves the engine) or `shadow` (predicted only)",
    "scenario": "the bench scenario it belongs to, if any",
    "request_index": "its place in that scenario, from 1",
    "label": "a short name for the request (a bench's question)",
    "expected": "the fact a right answer holds, where the scenario knows it",
    "prompt_tokens": "tokens in the prompt, chat template included",
    "chunks_total": "whole chunks (`KVB_CHUNK_SIZE` tokens) in the prompt",
    "chunks_hit": "of those, the leading ones the store held",
    "matched_tokens": "tokens whose KV was restored from the store (shadow: predicted)",
    "tier": "the slowest tier any restored object came from (`L1`, `L2`, `L3`, `S3`), or `none`",
    "miss_reason": "why the tokens after `matched_tokens` were not restored (a code; empty on a full hit)",
    "miss_detail": "that cause in words: which tier evicted it when, which setting differs, ...",
    "hit_tiers": "the restored tokens by tier, `L1=256 L2=96`",
    "explain_ms": "what naming the miss's cause cost",
    "lookup_ms": "asking the store which chunks it holds",
    "restore_ms": "assemble + hand-off: the restored KV into the engine",
    "prefill_tokens": "prompt tokens the engine computed",
    "ttft_ms": "time to the first token of the answer",
    "total_ms": "the whole request, answer included",
    "gen_tokens": "tokens generated",
    "text": "the answer",
    "store_ms": "storing the prompt's new chunks after the answer",
    "stored_objects": "objects that store wrote",
    "engine_cached_tokens": "tokens the engine itself reported reusing (None: it reports none)",
    "predicted_reuse_tokens": "shadow engines: the reuse KVBridge's index predicts",
    "restore_ok": "whether the engine used the restored KV (None: no restore tried)",
    "approx": "token figures come from an approximate tokenizer",
    "error": "why the request failed, for a person; empty when it succeeded (see `raise_for_error()`)",
    "notes": "what else happened, `; `-separated (a lossy codec, a recomputed restore, ...)",
    "tokenize_ms": "stage: the prompt into tokens",
    "hash_ms": "stage: the chunk hashes",
    "fetch_ms": "stage: reading the hit objects and checking their token ids",
    "assemble_ms": "stage: the objects into one engine state",
    "handoff_ms": "stage: that state into the engine (`set_data`, a slot restore)",
    "reset_ms": "stage: the engine's own cache dropped (cold, or a miss)",
    "prefill_ms": "stage: the engine computing the prompt tokens not restored",
    "first_token_ms": "stage: from the end of the prefill to the first piece of text",
    "fetch_bytes": "bytes read from the store for the restore",
    "fetch_tiers": "those bytes by tier, `L1=48234496 L3=1048576`",
    "store_calls": "store calls of lookup and fetch (each a round trip to a cache server)",
    "priority": "the scheduler: 0-9, higher is more urgent",
    "queue_ms": "the scheduler: from submission to admission",
    "preemptions": "the scheduler: times it was swapped out for a more urgent request",
    "swap_out_ms": "the scheduler: time spent swapping it out",
    "swap_in_ms": "the scheduler: time spent swapping it back in",
    "stored_tokens": "the scheduler: leading prompt tokens the store held when it answered",
    "blend_drift": "blend's deviation rule: the mean deviation its kept reused tokens carry, what the gate reads "
                   "(None: not measured)",
    "blend_fallback": "blend's gate found `blend_drift` above `KVB_BLEND_GATE` and answered with prefix reuse "
                      "(the instruction and first passage reused, the rest computed)",
}


def _type_name(annotation) -> str:
    name = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return name.replace("|", "\\|")   # a bar inside a markdown table cell


def fields_table() -> str:
    """The markdown table of RequestRecord's fields: name, type, default, meaning."""
    lines = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in fields(RequestRecord):
        default = "required" if f.default is MISSING else repr(f.default)
        lines.append(f"| `{f.name}` | `{_type_name(f.type)}` | `{default}` | {FIELD_DOCS.get(f.name, '')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(fields_table())
