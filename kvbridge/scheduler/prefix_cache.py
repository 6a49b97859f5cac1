"""Resident prefixes: sharing cells with running requests and cached prefixes, and keeping a finished
prompt resident for later prompts.

A prefix is shared at token granularity: the longest common token run with a running request's
context or a cached prefix (same cache salt, never blended cells) is copied into the new sequence
with seq_cp, no recompute and no copy of cells. A finished prompt stays resident as a cached prefix
(KVB_SCHED_CACHED_PREFIXES of them at most), evicted least recently used first under pressure; its
prompt was stored after its prefill, so a restore can bring an evicted one back.

A recurrent or hybrid model (`whole_only`): llama.cpp's seq_cp gives the new sequence the source's whole
recurrent state, which cannot be cut back to a shorter run, so a resident sequence is shared only when the
new context extends all of it (a chat's next turn after the previous answer); a finished request is kept
resident whole, its prompt and answer, and no request waits for another's prefill to share it. What
such a request stores after its answer ends with the last chunk whose recurrent state was captured: chunks
ending inside the earlier answer (decoded token by token, never captured) are counted incomplete, not stored.
"""
from __future__ import annotations

import time
from typing import Iterator, Sequence

from kvbridge.engine.chunks import common_prefix_length
from kvbridge.engine.cold_cut import CutRule
from kvbridge.scheduler.events import Journal
from kvbridge.scheduler.exact import ALIGN_RULE, safe_reuse
from kvbridge.scheduler.ledger import Holding
from kvbridge.scheduler.requests import CachedPrefix, Request
from kvbridge.scheduler.sequences import SequencePool


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    return min(common_prefix_length(a, b), limit)


class PrefixCache:
    """The cached prefixes, and the resident run (theirs or a running request's) a new context shares."""

    def __init__(self, ctx, pool: SequencePool, running: list[Request], limit: int, ids: Iterator[int],
                 journal: Journal, whole_only: bool = False, exact: bool = False,
                 rule: CutRule = ALIGN_RULE) -> None:
        self._ctx = ctx
        self.pool = pool
        self.ledger = pool.ledger
        self.running = running
        self.limit = limit        # KVB_SCHED_CACHED_PREFIXES
        self._ids = ids           # the scheduler's: a prefix and a request never have the same number
        self.journal = journal
        self.whole_only = whole_only   # a recurrent model: share a resident sequence only whole
        # KVB_SCHED_EXACT: share only prompt cells a prefill computed, cut where a solo prefill would cut
        self.exact = exact
        self.rule = rule   # exact mode's cut (kvbridge.scheduler.exact.cut_rule)
        self.prefixes: list[CachedPrefix] = []

    def best_source(self, context: list[int], salt: str, prompt_len: int | None = None):
        """The resident sequence (running request or cached prefix) of the same cache salt sharing the
        longest token run with `context`, and that length (at most len(context) - 1: the last token is
        always fed)."""
        best, best_len = None, 0
        limit = len(context) - 1
        for source in [*self.running, *self.prefixes]:
            if source.salt != salt or getattr(source, "blend", False):   # blended cells are not exact KV
                continue
            tokens = source.context[:source.kv_tokens] if isinstance(source, Request) else source.tokens
            if self.exact and isinstance(source, Request):
                tokens = tokens[:len(source.prompt)]   # its answer's cells were decoded one token a call
            n = common_prefix(tokens, context, limit)
            if self.exact:
                n = safe_reuse(n, prompt_len if prompt_len is not None else len(context), self.rule)
            if self.whole_only and n < len(tokens):
                continue   # its recurrent state is past the common run: cannot be shared
            if n > best_len:
                best, best_len = source, n
        return best, best_len

    def share_into(self, request: Request):
        """Fill the request's new sequence with the longest resident run: (its source, tokens shared)."""
        source, shared = self.best_source(request.context, request.salt, len(request.prompt))
        if shared > 0:
            self.pool.share(request, source, shared)
            self.journal.counters["shared_tokens"] += shared
            if isinstance(source, CachedPrefix):
                source.last_used = time.monotonic()
            self.journal.event("share", request, f"{shared} tokens from {source.holder}")
        return source, shared

    def in_prefill(self, request: Request) -> bool:
        """A running request is still prefilling most of this request's context (at least half of it,
        and a block more than any resident sequence holds now): a system prompt many users send at
        once. Waiting costs this request that prefill's time; not waiting would prefill it twice. A
        short common run (a few tokens of chat template) is not worth a wait."""
        if self.whole_only:
            return False   # its prefill done, it decodes on: its sequence is no longer a whole prefix of this context
        _, shared = self.best_source(request.context, request.salt)
        limit = len(request.context) - 1
        for other in self.running:
            if other.prefilling and other.salt == request.salt:
                common = common_prefix(other.prompt, request.context, limit)
                if 2 * common >= len(request.context) and common >= shared + self.ledger.block_tokens \
                        and other.kv_tokens < common:
                    return True
        return False

    def evict_coldest(self) -> None:
        """Drop the least recently used cached prefix (its prompt was stored after its prefill, so a
        restore can bring it back)."""
        prefix = min(self.prefixes, key=lambda p: p.last_used)
        self.prefixes.remove(prefix)
        n_tokens = len(prefix.tokens)
        self.pool.free_holder(prefix)
        self.journal.counters["evictions"] += 1
        self.journal.event("evict", prefix, f"{n_tokens} tokens")

    def keep(self, request: Request) -> None:
        """Keep the finished prompt resident (its cells shared, not copied) for later prompts to share.

        All but its last token: a later request always feeds its own last token, and with that cell
        left free (it is the first one freed with the request) the same prompt asked again decodes its
        last token into the cell it had when it was computed cold, and a longer one continues there.
        llama.cpp's attention sums over cells in SIMD lanes by cell index, so the same token one cell
        further on rounds differently: on an AVX2 machine Gemma 3's repeated answer differed from its
        cold one at the first tied logit (Docs/Research.md, "Exact on every CPU").

        A recurrent model keeps the whole sequence (its recurrent state is after its last position): a later
        context that extends the prompt and this answer shares it, a repeated prompt restores from the store."""
        n = request.kv_tokens if self.whole_only else min(len(request.prompt), request.kv_tokens) - 1
        kept = request.context[:n]
        if self.limit == 0 or n < self.ledger.block_tokens or request.blend:
            return
        if any(p.salt == request.salt and common_prefix(p.tokens, kept, n) >= n
               and (len(p.tokens) == n or not self.whole_only) for p in self.prefixes):
            return   # the same run is resident already
        if len(self.prefixes) >= self.limit:
            self.evict_coldest()
        if not self.pool.free:
            return
        seq = self.pool.take()
        self._ctx.seq_cp(request.seq, seq, n)
        prefix = CachedPrefix(next(self._ids), seq, kept, Holding(""), f"prompt of {request.label}",
                              salt=request.salt)
        prefix.held = self.ledger.share(request.held, prefix.holder, n)
        self.prefixes.append(prefix)

    def describe(self) -> list[dict]:
        return [{"id": p.id, "tokens": len(p.tokens), "holder": p.holder, "label": p.label} for p in self.prefixes]
