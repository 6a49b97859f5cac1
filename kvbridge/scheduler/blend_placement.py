"""Blend requests on the scheduler's context: stored passages placed wherever they stand, and the
passages an answer computed stored after it (kvbridge.blend does the work; this is where the
scheduler lends it sequences and counts what happened).

One BlendRunner, made by the first blend request on the loop's context and seen under each cache
salt's namespace, so a salt costs no runner or buffer of its own. A model blend cannot run is
refused on the request that asked; a placement that fails is computed in full, counted.
"""
from __future__ import annotations

import logging

from kvbridge.engine.misses import MissExplainer
from kvbridge.errors import KVBridgeError
from kvbridge.scheduler.events import Journal
from kvbridge.scheduler.requests import Request
from kvbridge.scheduler.salts import salt_namespace
from kvbridge.scheduler.sequences import SequencePool
from kvbridge.settings import Settings

log = logging.getLogger(__name__)


class BlendPlacer:
    def __init__(self, settings: Settings, store, namespace: str, geometry, ctx, pool: SequencePool,
                 journal: Journal) -> None:
        self.settings = settings
        self.store = store
        self.namespace = namespace
        self.geometry = geometry
        self._ctx = ctx
        self.pool = pool
        self.ledger = pool.ledger
        self.journal = journal
        self._runner = None   # kvbridge.blend.runner.BlendRunner on this context, made by the first blend request

    def runner_for(self, salt: str):
        """The blend runner of a cache salt (its passages live under that salt's namespace), on this context:
        one runner, seen under each salt's namespace, so a salt costs no runner or buffer of its own."""
        from kvbridge.blend.runner import BlendRefused, BlendRunner

        if self.geometry is not None and self.geometry.recurrent:
            raise BlendRefused(f"blend mode does not run {self._ctx.model_path.name}: its recurrent state cannot take "
                               "passages placed at other positions; send the request without blend (lmcache reuses "
                               "its prompt exactly)")
        if self._runner is None:   # raises BlendRefused for a model blend cannot run, on the request that asked
            self._runner = BlendRunner(self.settings, self.store, self.namespace, context=self._ctx,
                                       geometry=self.geometry)
        return self._runner.under(salt_namespace(self.namespace, salt)) if salt else self._runner

    def place(self, request: Request) -> tuple[int, str]:
        """Blend: stored instruction and passages placed into the request's sequence, a few tokens of each
        passage (its last, by default) decoded in context (kvbridge.blend.runner); (positions held, slowest
        tier). Needs a free sequence for a moment, and takes more where there are (one per later passage,
        up to RUN_SEQS) to decode every passage's recomputed tokens at once; without one free sequence, or
        when llama.cpp has no room, it computes everything."""
        from kvbridge.blend.result import BlendResult
        from kvbridge.blend.runner import RUN_SEQS

        # a sliding-window model's placement also holds its cells in a sequence of their own (kvbridge.blend.runner.PIN)
        windowed = bool(self.geometry is not None and self.geometry.window)
        if len(self.pool.free) < 1 + windowed:
            request.record.add_note("blend: no free sequence to place passages through; computed in full")
            MissExplainer.fixed("refused", "blend: no free sequence to place the stored passages through (every one "
                                "of KVB_SCHED_MAX_RUNNING + KVB_SCHED_CACHED_PREFIXES is taken); computed in full"
                                ).apply(request.record)
            return 0, "none"
        scratch = self.pool.borrow()
        pin = self.pool.borrow() if windowed else None
        # more free sequences, when there are, let every passage's recomputed tokens go into one decode
        later_passages = max(0, len(request.segments) - 3)
        runs = [self.pool.borrow() for _ in range(min(len(self.pool.free), later_passages, RUN_SEQS))]
        runner = self.runner_for(request.salt)
        result = BlendResult()
        try:
            placement = runner.place(request.prompt, request.segments, self.settings.blend_recompute_tokens, result,
                                     answer=request.seq, scratch=scratch,
                                     recompute_at=self.settings.blend_recompute_at, run_seqs=runs,
                                     ratio=self.settings.blend_recompute_ratio, gate=self.settings.blend_gate,
                                     pin=pin)
        except KVBridgeError as exc:
            self._ctx.seq_rm(request.seq)
            self.journal.counters["restore_failed"] += 1
            request.record.restore_ok = False
            request.record.add_note(f"blend placement failed ({exc}); computed in full")
            MissExplainer.fixed("refused", f"blend: the placement failed ({exc}); computed in full").apply(request.record)
            return 0, "none"
        finally:
            for seq in [scratch, *runs] + ([pin] if pin is not None else []):
                self.pool.give_back(seq)
        kv = placement.kv_tokens
        if kv:
            self.ledger.grow(request.held, kv, request.holder)
        request.blend_placement, request.blend_result = placement, result
        record = request.record
        record.prefill_tokens += result.recomputed_tokens - len(placement.pending)   # decoded while placing
        result.fill_record(record, len(request.segments), self.settings.blend_recompute_tokens,
                           self.settings.blend_recompute_at, self.settings.blend_recompute_ratio)
        self.journal.counters["blend_reused_tokens"] += result.reused_tokens
        return kv, result.tier if result.reused_tokens else "none"

    def store_passages(self, request: Request) -> None:
        """After a blend answer: the passages it computed, each from its own prefill after the instruction."""
        placement = request.blend_placement
        if placement is None or not placement.missing or request.seq is None or not self.pool.free:
            return
        scratch = self.pool.borrow()
        try:
            self.runner_for(request.salt).store_missing(request.prompt, placement, request.blend_result,
                                                        answer=request.seq, scratch=scratch)
            request.record.stored_objects = request.blend_result.stored_segments
        except KVBridgeError as exc:
            log.warning("storing blend passages of %s failed: %s", request.holder, exc)
        finally:
            self.pool.give_back(scratch)
            request.blend_placement = None

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
