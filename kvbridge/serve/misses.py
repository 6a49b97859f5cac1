"""What a client of `serve` is told about a miss: the record's cause (kvbridge.engine.misses), as the tenant
rules allow, for the `X-KVBridge-Miss` header, the usage's `kvbridge` object and the tenant's /metrics.

Place in the flow: the engine's RequestRecord (miss_reason, miss_detail, hit_tiers) -> **the client's view**
-> the response. Rules (Docs/Serve.md, "Why a prompt missed"; Docs/Security.md):
- nobody learns of another cache salt's objects: the engines never probe another salt's namespaces on a
  request's path (kvbridge.engine.misses; the operator's /metrics learns the true cause after the answer left),
  and an `other_namespace` whose difference is the salt (the owner's `kvbridge explain` names those) is shown
  as `none_stored` with the very detail a miss of the caller's own namespace gives, to every client;
- a tenant of a server with keys (anyone but the operator) is not shown another prompt's text (the stored
  side of a divergence), what an eviction made room for (another request's object), or why a tier is down
  (the addresses of the cache server or Redis).
The operator's /metrics counts the true causes (kvbridge.serve.metrics).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge.engine.misses import MISS_REASONS, SALT_FIELD, nothing_stored, parse_hit_tiers

MISS_HEADER = "X-KVBridge-Miss"
HIT = "hit"            # the header's and the usage's code when nothing restorable was missed
PENDING = "pending"    # a stream's headers left before the engine admitted the request
# where a detail starts to speak of something that is not the client's own (kvbridge.engine.misses, store.history)
_NOT_THEIRS = {"diverged": ", stored …", "evicted": " to make room for "}


@dataclass(frozen=True)
class MissView:
    reason: str                                   # HIT or a code of MISS_REASONS
    detail: str = ""
    hit_tiers: dict[str, int] = field(default_factory=dict)

    def usage_fields(self) -> dict:
        """The usage's `kvbridge` object."""
        return {"miss_reason": self.reason, "miss_detail": self.detail, "hit_tiers": dict(self.hit_tiers)}


def client_view(record, full: bool) -> MissView:
    """The record's miss as a client may see it; `full`: the caller sees everything (the operator, or a
    server with no keys), so only other salts are hidden from it."""
    reason, detail = record.miss_reason or HIT, record.miss_detail if record.miss_reason else ""
    hit_tiers = parse_hit_tiers(record.hit_tiers)
    if reason == "other_namespace" and SALT_FIELD in detail:
        at = record.matched_tokens
        return MissView("none_stored", f"from token {at} of {record.prompt_tokens}: {nothing_stored(at)}", hit_tiers)
    if full:
        return MissView(reason, detail, hit_tiers)
    if reason == "tier_down":
        detail = _generic(record, "tier_down")
    elif reason in _NOT_THEIRS:
        detail = detail.partition(_NOT_THEIRS[reason])[0]
    return MissView(reason, detail, hit_tiers)


def header_value(record) -> str:
    """X-KVBridge-Miss from a (possibly live) record: its code, HIT, or PENDING before admission."""
    if record is None:
        return PENDING
    return client_view(record, full=False).reason


def _generic(record, reason: str) -> str:
    return f"from token {record.matched_tokens} of {record.prompt_tokens}: {MISS_REASONS[reason]}"
