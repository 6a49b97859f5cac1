"""Why an admitted request did not reuse its whole prompt: the scheduler's side of kvbridge.engine.misses.

Place in the flow: admission -> resident cells shared (prefix_cache) -> the store's longer prefix restored
(restorer) -> **the first prompt token neither reached, explained into the record** -> prefill the rest.

The record gets miss_reason, miss_detail and hit_tiers as CachedEngine's do, with one tier of the
scheduler's own: `context`, the tokens shared from cells resident in its llama.cpp context. The store's
part is explained by the salt's ChunkKV explainer (one store call on a miss, none on a hit); what only
the scheduler knows comes first: a prompt still queued in its own store writer (`lease_busy`), a resident
prompt that continues the shared run with other tokens (`diverged`, found in the cells' own token ids, no
store call), a rest too short to read the store for (`below_chunk`), a store fault (`tier_down`) and a
restore llama.cpp refused (`refused`). Only a request's first admission is explained: a swap-in restores
what its own swap-out stored, which says nothing about the prompt's reuse.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from kvbridge.engine.cold_cut import CutRule
from kvbridge.engine.misses import MissExplainer, MissReport
from kvbridge.engine.restore_plan import RestorePlan
from kvbridge.scheduler.exact import ALIGN_RULE, safe_reuse
from kvbridge.scheduler.requests import Request
from kvbridge.scheduler.sequence_store import SequenceStore

CONTEXT_TIER = "context"   # hit_tiers' name for cells shared from a resident sequence


class AdmissionMisses:
    """Fills a first admission's miss fields. `probe`: KVB_EXPLAIN_MISSES (False: no store call, the cause
    from the plan alone); `half_block`: less than this beyond the resident cells is never read from the store;
    `exact`: exact mode, whose cut (kvbridge.scheduler.exact.safe_reuse under `rule`) leaves up to 63 tokens of a
    prompt that matched whole to compute (2 where the cut probe proved SmolLM2 exact at any token): reaching
    that cut of a whole match is a hit, not a miss to explain (a prompt that diverged is explained as before)."""

    def __init__(self, detokenize: Callable[[Sequence[int]], str] | None, probe: bool, half_block: int,
                 exact: bool = False, rule: CutRule = ALIGN_RULE) -> None:
        self.detokenize = detokenize
        self.probe = probe
        self.half_block = max(1, half_block)
        self.exact = exact
        self.rule = rule

    def _whole_hit(self, prompt: Sequence[int], reached: int, matched: int, resident: Sequence[int]) -> bool:
        """Exact mode: the prompt matched whole (the store's reach `matched`, or the resident tokens) and the reuse
        `reached` exact mode's cut of it."""
        n = len(prompt)
        if not self.exact or reached < safe_reuse(n - 1, n, self.rule):
            return False
        return matched >= n - 1 or _common_prefix(prompt, resident) >= n - 1

    def resident_only(self, request: Request, sequences: SequenceStore, shared: int, resident: Sequence[int]) -> None:
        """No lookup was made: the resident run (`shared` of the `resident` tokens a source holds) reaches to
        within half a block of the prompt's end."""
        n, limit = len(request.prompt), len(request.prompt) - 1
        hit = _context(shared)
        if shared >= limit or self._whole_hit(request.prompt, shared, 0, resident):
            MissReport(hit_tiers=hit, at_token=shared).apply(request.record)
            return
        if self._resident_diverged(request, sequences, shared, resident):
            return
        beyond = f"beyond the {shared} resident ones" if shared else "in this prompt"
        MissExplainer.fixed("below_chunk", f"from token {shared} of {n}: {limit - shared} tokens to reuse {beyond} "
                            f"(the last is always computed), under half a block ({self.half_block}): the store is "
                            "not read for so few", at_token=shared, hit_tiers=hit).apply(request.record)

    def after_lookup(self, request: Request, sequences: SequenceStore, plan, shared: int, resident: Sequence[int],
                     restored: bool, kept: int | None = None) -> None:
        """The store was asked (`plan`, a RestorePlan); `restored`: its prefix replaced the `shared` resident cells
        (of the `resident` tokens their source holds); `kept`: how much of it the engine keeps (exact mode's cut),
        which is what hit_tiers counts, as the usage's cached_tokens does."""
        prompt = request.prompt
        n, limit = len(prompt), len(prompt) - 1
        reached = plan.matched_tokens if restored else shared
        hit = _first_tokens(dict(plan.tier_tokens), kept) if restored else _context(shared)
        if reached >= limit or self._whole_hit(prompt, reached, plan.matched_tokens, resident):
            MissReport(hit_tiers=hit, at_token=reached).apply(request.record)
            return
        queued = min(sequences.queued_reach(prompt), limit)
        if self.exact:   # what exact mode would keep of the queued write: no gain over `reached`, no lease_busy
            queued = safe_reuse(queued, n, self.rule)
        if queued >= reached + self.half_block:
            MissExplainer.fixed("lease_busy", f"from token {reached} of {n}: the first {queued} tokens of this prompt "
                                "are queued in the scheduler's store writer (a prompt answered moments ago), not in "
                                "the store yet; a request a moment later restores them",
                                at_token=reached, hit_tiers=hit).apply(request.record)
            return
        if not restored and plan.matched_tokens <= shared and self._resident_diverged(request, sequences, shared,
                                                                                      resident):
            return
        report = self._explainer(sequences).explain(prompt, sequences.hashes(prompt), plan, probe=self.probe)
        reason, detail = report.reason, report.detail
        if not restored and plan.matched_tokens > shared:
            # the store held a little more than the resident cells: not worth replacing them
            detail = (f"the store's {plan.matched_tokens} tokens are under half a block ({self.half_block}) beyond "
                      f"the {shared} resident ones: not restored" + (f"; {detail}" if detail else ""))
            reason = reason or "below_chunk"
        elif not restored and shared:
            detail = f"{shared} tokens shared from resident cells; in the store: {detail}"
        MissReport(reason=reason, detail=detail, at_token=reached, hit_tiers=hit, probe_ms=report.probe_ms,
                   round_trips=report.round_trips,
                   operator_probe=report.operator_probe if reason == "none_stored" else None).apply(request.record)

    def _resident_diverged(self, request: Request, sequences: SequenceStore, shared: int,
                           resident: Sequence[int]) -> bool:
        """The resident source continues the shared run with other tokens: `diverged`, read off its cells' token
        ids (no store call; its prompt was stored too, so the store cannot hold more of this one)."""
        prompt = request.prompt
        # exact mode shared only up to its cut: where the resident run really diverges is further on
        reach = max(shared, _common_prefix(prompt, resident)) if self.exact else shared
        if reach < 1 or len(resident) <= reach:
            return False
        seen = RestorePlan(matched_tokens=reach, continuation=(0, np.asarray(resident)))
        seen.add_tokens(CONTEXT_TIER, reach)
        report = self._explainer(sequences).explain(prompt, sequences.hashes(prompt), seen, probe=False)
        if report.reason != "diverged":
            return False
        cut = f" (exact mode reuses {shared} of them: its cut)" if reach > shared else ""
        MissReport(reason="diverged", detail=f"{reach} tokens shared from resident cells{cut}; {report.detail}",
                   at_token=shared, hit_tiers=_context(shared), probe_ms=report.probe_ms).apply(request.record)
        return True

    def _explainer(self, sequences: SequenceStore) -> MissExplainer:
        explainer = sequences.kv.misses
        if self.detokenize is not None:
            explainer.detokenize = self.detokenize
        return explainer

    @staticmethod
    def store_fault(request: Request, shared: int, exc: Exception) -> None:
        """The lookup or the fetch failed (a storage fault, counted): recomputed past the resident cells."""
        reason = "lease_busy" if "lease" in str(exc) else "tier_down"
        MissExplainer.fixed(reason, f"from token {shared} of {len(request.prompt)}: the store failed ({exc}); "
                            "recomputed", at_token=shared, hit_tiers=_context(shared)).apply(request.record)

    @staticmethod
    def refused(request: Request, held: int, exc: Exception) -> None:
        """llama.cpp refused the restored state: `held` resident tokens kept, the rest recomputed."""
        MissExplainer.fixed("refused", f"from token {held} of {len(request.prompt)}: llama.cpp refused the restored "
                            f"state ({exc}); recomputed", at_token=held, hit_tiers=_context(held)).apply(request.record)


def resident_tokens(source) -> Sequence[int]:
    """The token ids a resident source's cells hold: a cached prefix's, or a running request's KV so far."""
    if source is None:
        return ()
    tokens = getattr(source, "tokens", None)   # a CachedPrefix
    return tokens if tokens is not None else source.context[:source.kv_tokens]


def _first_tokens(by_tier: dict[str, int], kept: int | None) -> dict[str, int]:
    """`by_tier` (tokens a restore gave, in prompt order) cut to its first `kept` tokens."""
    if kept is None:
        return by_tier
    out, left = {}, kept
    for tier, tokens in by_tier.items():
        if left <= 0:
            break
        out[tier] = min(tokens, left)
        left -= out[tier]
    return out


def _context(tokens: int) -> dict[str, int]:
    return {CONTEXT_TIER: tokens} if tokens else {}


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two token sequences share."""
    m = min(len(a), len(b))
    if m == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:m]) != np.asarray(b[:m]))
    return int(differ[0]) if len(differ) else m
