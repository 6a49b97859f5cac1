"""RequestRecord: what one request cost and where its KV came from. The GUI, the bench and exports read it.

Its `mode` is one of the engine's modes (kvbridge.engine.modes: mode_names()).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class RequestRecord:
    mode: str
    engine: str = ""
    kv_mode: str = ""                 # "full" or "shadow"
    scenario: str = ""
    request_index: int = 0
    label: str = ""
    expected: str = ""                # the fact a right answer holds, where the scenario knows it (rag)
    prompt_tokens: int = 0
    chunks_total: int = 0
    chunks_hit: int = 0
    matched_tokens: int = 0           # tokens whose KV came from our store (full) or would (shadow: predicted)
    tier: str = "none"                # "L1", "L2", "L3" or "none": the slowest tier any restored object came from
    # why the tokens after matched_tokens were not restored (kvbridge.engine.misses): a code from MISS_REASONS,
    # "" when every token that could be restored was (the last prompt token is always computed)
    miss_reason: str = ""
    miss_detail: str = ""             # the cause for a person: which tier evicted it when, which field differs, ...
    hit_tiers: str = ""               # the restored tokens by tier, "L1=256 L2=96" ("context" = resident cells)
    explain_ms: float = 0.0           # what naming the cause cost (0 on a hit)
    lookup_ms: float = 0.0            # asking the store which chunks it holds (the stages: kvbridge.engine.stages)
    restore_ms: float = 0.0           # assemble + handoff: the restored KV into the engine
    prefill_tokens: int = 0           # tokens actually computed
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    gen_tokens: int = 0
    text: str = ""
    store_ms: float = 0.0
    stored_objects: int = 0
    engine_cached_tokens: int | None = None
    predicted_reuse_tokens: int | None = None  # shadow engines: what our index predicts
    restore_ok: bool | None = None    # None: no restore tried
    approx: bool = False              # token figures come from an approximate tokenizer
    error: str = ""
    notes: str = ""
    # the path to the first token, stage by stage (kvbridge.engine.stages; they add up to ttft_ms)
    tokenize_ms: float = 0.0
    hash_ms: float = 0.0
    fetch_ms: float = 0.0             # reading the hit objects and confirming their token ids
    assemble_ms: float = 0.0
    handoff_ms: float = 0.0           # the assembled state into the engine (set_data / slot restore)
    reset_ms: float = 0.0             # the engine's own cache dropped (cold, or a miss)
    prefill_ms: float = 0.0           # the engine evaluating the prompt tokens not restored
    first_token_ms: float = 0.0       # from the end of the prefill to the first piece of text
    fetch_bytes: int = 0              # bytes read from the store for the restore
    fetch_tiers: str = ""             # those bytes by tier, "L1=48234496 L3=1048576"
    store_calls: int = 0              # store calls of lookup and fetch (each a round trip to a cache server)
    # the scheduler (kvbridge.scheduler): many requests on one context
    priority: int = 5                 # 0-9, higher is more urgent
    queue_ms: float = 0.0             # from submission to admission
    preemptions: int = 0              # times it was swapped out for a more urgent request
    swap_out_ms: float = 0.0
    swap_in_ms: float = 0.0
    stored_tokens: int = 0            # store_before_answer: the leading prompt tokens the store held when it answered
    # blend's deviation rule (kvbridge.blend.deviation)
    blend_drift: float | None = None  # the deviation its kept reused tokens carry: what the gate reads
    blend_fallback: bool = False      # the gate found the drift above KVB_BLEND_GATE: answered with prefix reuse

    def raise_for_error(self) -> "RequestRecord":
        """This record when the request succeeded; RequestFailed (a KVBridgeError) with `error` when it did not.

        CachedEngine.infer() never raises for a failed request (a GUI or a bench keeps going and shows the
        error): a program that wants an exception writes `engine.infer(prompt).raise_for_error()`."""
        if self.error:
            from kvbridge.errors import RequestFailed

            raise RequestFailed(self.error, self)
        return self

    def add_note(self, note: str) -> None:
        self.notes = f"{self.notes}; {note}" if self.notes else note

    def to_dict(self) -> dict:
        return asdict(self)


RECORD_FIELDS = [f.name for f in fields(RequestRecord)]
