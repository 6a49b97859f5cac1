"""What comes out of a decode: every sequence's new cells accounted, then a token sampled for each
sequence that asked for logits, streamed to its caller, and checked against the end token, n_predict
and the stop strings. A prompt's KV is queued for storing right after its first token went out (the
state copy, tens of MB, stays off the TTFT). A recurrent or hybrid model's sequence whose prefill piece
ended at a chunk boundary has its recurrent state captured there first, before its next decode moves it on.
"""
from __future__ import annotations

import logging
import time

from kvbridge.errors import StateTransferError
from kvbridge.scheduler.events import Journal
from kvbridge.scheduler.lifecycle import Lifecycle
from kvbridge.scheduler.planner import Batch, is_boundary
from kvbridge.scheduler.requests import Request
from kvbridge.scheduler.restorer import Restorer

log = logging.getLogger(__name__)


class Streamer:
    def __init__(self, ctx, ledger, lifecycle: Lifecycle, restorer: Restorer, journal: Journal,
                 boundary_step: int = 0) -> None:
        self._ctx = ctx
        self.boundary_step = boundary_step   # a recurrent model's chunk size: its state is captured there (0: never)
        self.ledger = ledger
        self.lifecycle = lifecycle
        self.restorer = restorer
        self.journal = journal

    def after_decode(self, batch: Batch) -> None:
        """Account every sequence's new cells first, then sample: a request whose sampling or streaming
        callback raises fails alone, and the others' accounts are already true."""
        sampled = []
        logit_index = 0
        for request, entries in batch:
            n = len(entries)
            self.ledger.grow(request.held, n, request.holder)
            request.kv_tokens += n
            request.pending = request.pending[n:]
            request.record.prefill_tokens += max(0, min(n, len(request.prompt) - (request.kv_tokens - n)))
            logit_index += n
            if self.boundary_step and is_boundary(request, self.boundary_step):
                self._capture(request)
            if entries[-1][3]:
                sampled.append((request, logit_index - 1))
        for request, index in sampled:
            try:
                self.on_token(request, request.sampler.pick(self._ctx.logits(index)))
            except Exception as exc:   # its own fault (its on_token raised): counted, logged, on its future
                log.exception("%s failed after its decode", request.holder)
                self.journal.counters["faults"] += 1
                self.lifecycle.abort(request, exc)

    def _capture(self, request: Request) -> None:
        """The request's recurrent state where its prefill piece ended; one llama.cpp did not give costs only
        the chunks ending there (not stored: ChunkKV counts them incomplete), never the answer."""
        try:
            request.boundaries[request.kv_tokens] = self._ctx.save_recurrent(request.seq)
        except StateTransferError as exc:
            log.warning("%s: recurrent state after %d tokens not captured (%s)", request.holder, request.kv_tokens, exc)

    def on_token(self, request: Request, token: int) -> None:
        now = time.perf_counter()
        if request.first_token_at is None:
            request.first_token_at = now
            request.record.ttft_ms = (now - request.submitted) * 1e3
        if not request.prompt_stored and request.kv_tokens >= len(request.prompt):
            request.prompt_stored = True   # its prompt's KV, for a restart or another process
            request.store_pending = self.restorer.worth_storing(request)
            if not request.store_pending:
                request.boundaries = {}   # nothing will be stored: the captures are not needed
        self._emit(request, token)
        self.restorer.store_prompt(request)   # after the token went out: the state copy (tens of MB) is off the TTFT

    def _emit(self, request: Request, token: int) -> None:
        if self._ctx.is_end(token):
            self.lifecycle.finish(request)
            return
        request.generated.append(token)
        piece = request.pieces.feed(self._ctx.piece(token))
        done = len(request.generated) >= request.n_predict
        if request.stop:
            text = request.text + piece
            cut = min((text.find(s) for s in request.stop if s and s in text), default=-1)
            if cut >= 0:
                piece, done = text[:cut][len(request.text):], True
        if piece:
            request.text += piece
            if request.on_token is not None:
                request.on_token(piece)
        if done:
            self.lifecycle.finish(request)
        else:
            request.pending = [token]
