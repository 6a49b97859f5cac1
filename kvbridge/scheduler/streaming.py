"""What comes out of a decode: every sequence's new cells accounted, then a token sampled for each
sequence that asked for logits, streamed to its caller, and checked against the end token, n_predict
and the stop strings (min_tokens and ignore_eos as vLLM means them: an end-of-generation token is not
sampled while it may not end the answer, as llama.cpp's ignore_eos masks it; a stop string counts only
once min_tokens tokens were generated). A prompt's KV is queued for storing right after its first token went out (the
state copy, tens of MB, stays off the TTFT). A recurrent or hybrid model's sequence whose prefill piece
ended at a chunk boundary has its recurrent state captured there first, before its next decode moves it on.
"""
from __future__ import annotations

import logging
import time

import numpy as np

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
                self.on_token(request, self._pick(request, index))
            except Exception as exc:   # its own fault (its on_token raised): counted, logged, on its future
                log.exception("%s failed after its decode", request.holder)
                self.journal.counters["faults"] += 1
                self.lifecycle.abort(request, exc)

    def _pick(self, request: Request, index: int) -> int:
        """The sampled token; while the request may not end, an end-of-generation token is masked and the
        sampler asked again (the same pick as masking every end token first: a model has a few of them)."""
        logits = self._ctx.logits(index)   # a copy of its own: masking it changes nothing of llama.cpp's
        token = request.sampler.pick(logits)
        if request.may_end:
            return token
        while self._ctx.is_end(token) and np.isfinite(logits[token]):
            logits[token] = -np.inf
            token = request.sampler.pick(logits)
        return token

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
            request.store_pending = self.restorer.worth_storing(request) or (request.store_before_answer
                                                                             and not request.blend)
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
            if len(request.generated) < request.min_tokens:
                request.stop_from = len(text)   # not honoured yet: a stop string counts where it ends past here
            else:
                found = (text.find(s, max(0, request.stop_from - len(s) + 1)) for s in request.stop if s)
                cut = min((at for at in found if at >= 0), default=-1)
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
