"""Many conversations on one llama.cpp context: continuous batching over a paged KV budget, shared
prefixes, LRU eviction of cached prefixes, watermark pressure and priority preemption with swap.

Each step of the loop (one thread owns llama.cpp):
  1. cancelled requests free their blocks;
  2. pressure from free blocks: SOFT evicts cold cached prefixes (least recently used first), CRITICAL
     preempts the lowest-priority running request;
  3. swapped requests resume first (restored from the store), then waiting ones are admitted in
     priority order while the budget allows and pressure is below HARD; a waiting request more
     urgent than the least urgent running one preempts it when the budget or the slots are short;
     one whose prompt a running request is still prefilling waits for it, to share it (a system
     prompt that many users send at once is prefilled once);
  4. one batch: a token for every decoding sequence plus prefill work for newly admitted ones;
  5. sampling, streaming, stop checks; a finished prompt stays resident as a cached prefix.

A prefix is shared at token granularity: the longest common token run with a running request's
context or a cached prefix is copied into the new sequence with seq_cp (no recompute, no copy of
cells), and what no resident sequence has may come from the store (chunks, then the tail). A
preempted request is swapped out to the store (pinned), swapped back in by restore, and continues
decoding where it stopped; if the store could not take it, it is recomputed from its tokens.

Faults degrade, counted: a restore llama.cpp refuses is recomputed from the cells the sequence really
holds (`restore_failed`), and an exception in a step fails only the requests it was changing (their
futures get it, their sequences and blocks are freed: `faults`, `failed`) while the loop goes on.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Sequence

from kvbridge.backends.base import Message, WindowCapture
from kvbridge.backends.llamacpp import llama_cpp_fingerprint
from kvbridge.backends.model_traits import traits_of_model
from kvbridge.engine.segments import no_passages_note, tokenize_segments
from kvbridge.engine.cached_engine import open_store
from kvbridge.engine.chunks import common_prefix_length
from kvbridge.engine.namespace import file_sha256, kv_namespace, sha_cache_file
from kvbridge.engine.records import RequestRecord
from kvbridge.errors import EngineUnavailable, KVBridgeError, StateTransferError
from kvbridge.formats.architectures import kv_support
from kvbridge.formats.llama_state import parse_state
from kvbridge.scheduler.ledger import BlockLedger, Holding, Pressure
from kvbridge.backends.llama_context import BATCH_TOKENS, LlamaContext, Sampler
from kvbridge.scheduler.requests import CachedPrefix, Request
from kvbridge.scheduler.salts import SaltSpaces, salt_namespace
from kvbridge.scheduler.swap import SwapShared, SwapSpace
from kvbridge.settings import Settings
from kvbridge.store.serde import remember_geometry

log = logging.getLogger(__name__)

# Prefill tokens per step while sequences decode or requests of different priorities prefill: a
# step's time is about linear in its tokens on a CPU (a 512-token step is ~1.2 s with SmolLM2 on 2
# cores, a 128-token one ~0.3 s at 5% lower prefill throughput), and every decoding sequence and a
# newly arrived urgent request wait for the step in flight.
SHARED_STEP_PREFILL = 128
PROBE_TEXT = "KVBridge scheduler probe: the KV layout of this model."
EVENT_KINDS = ("admit", "share", "restore", "restore-failed", "evict", "preempt", "swap-out", "swap-in", "finish",
               "cancel", "fail")


class RequestRefused(KVBridgeError):
    """A request the scheduler cannot take (too long for the budget, a priority out of range, a full queue)."""


class QueueFull(RequestRefused):
    """KVB_SCHED_MAX_WAITING requests are already waiting."""


@dataclass(frozen=True)
class Event:
    t: float          # seconds since the scheduler started
    kind: str
    request: str      # the holder: "req-7", "prefix-9"
    detail: str = ""
    label: str = ""   # what the person who submitted it called it


class Scheduler:
    """`Scheduler(settings)`; `submit(...)` returns a Future of the RequestRecord. Use as a context manager."""

    def __init__(self, settings: Settings, store=None) -> None:
        self.settings = settings
        s = settings
        self.max_running = s.sched_max_running
        self._ctx = LlamaContext(s, s.sched_kv_cells, s.sched_max_running + s.sched_cached_prefixes + 1)
        self.ledger = BlockLedger(self._ctx.n_cells, s.sched_block_tokens, s.sched_soft, s.sched_hard, s.sched_critical)
        self._free_seqs = list(range(self._ctx.n_seq))
        self.store = store if store is not None else open_store(s)
        self._own_store = store is None
        traits = traits_of_model(self._ctx.model)
        geometry = self._probe_geometry(traits)
        self._geometry = geometry
        remember_geometry(geometry)
        model_sha = file_sha256(self._ctx.model_path, sha_cache_file(s.l2_dir))
        self.namespace = kv_namespace(llama_cpp_fingerprint(s, traits), model_sha256=model_sha,
                                      kv_layout=geometry.digest().hex()[:16],
                                      lossy_codecs=getattr(self.store, "lossy_codecs", []), chunk_size=s.chunk_size)
        self._swap_shared = SwapShared()   # one writer thread and one restore buffer for every salt
        self._swaps = SaltSpaces(lambda salt: SwapSpace(self.store, s, salt_namespace(self.namespace, salt), geometry,
                                                        shared=self._swap_shared), s.sched_max_salts)
        self.swap = self._swaps.get("")
        self._blender = None   # kvbridge.blend.runner.BlendRunner on this context, made by the first blend request
        self._running: list[Request] = []
        self._waiting: list[Request] = []
        self._swapped: list[Request] = []
        self._prefixes: list[CachedPrefix] = []
        self._ids = iter(range(1, 1 << 62))
        self._counters = collections.Counter()
        self._involved: list[Request] = []   # the requests the step's operation in progress is changing
        self._events: collections.deque[Event] = collections.deque(maxlen=5000)
        self._started = time.perf_counter()
        self._lock = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="kvbridge-scheduler", daemon=True)
        self._thread.start()

    def _probe_geometry(self, traits):
        """The KV layout of this model and cache type, from a tiny real state (as CachedEngine learns it);
        a model whose layout KVBridge refuses (kvbridge.formats.architectures) cannot be scheduled."""
        support = kv_support(traits)
        if support.refused:
            self._ctx.close()
            if self._own_store:
                self.store.close()
            raise EngineUnavailable(f"The scheduler cannot run {self._ctx.model_path.name}: {support.reason.split(';')[0]}.")
        seq = self._free_seqs[0]
        tokens = self._ctx.tokenize(PROBE_TEXT)
        if self._ctx.decode([(t, i, seq, i == len(tokens) - 1) for i, t in enumerate(tokens)]) != 0:
            raise KVBridgeError("llama.cpp could not decode the scheduler's probe prompt")
        geometry = parse_state(self._ctx.save_seq(seq), traits.n_layer, window=support.window).geometry
        self._ctx.seq_rm(seq)
        return geometry

    # -- the public API -------------------------------------------------------------------------------
    def __enter__(self) -> "Scheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, prompt: str | Sequence[Message], *, priority: int = 5, n_predict: int | None = None,
               temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
               on_token: Callable[[str], None] | None = None, label: str = "", cache_salt: str = "",
               blend: bool = False) -> Future:
        """Queue a request; its Future gives a RequestRecord. Raises QueueFull when too many wait;
        a request that cannot run (too long, a bad priority) fails on its Future, the others go on.

        blend: reuse stored passages wherever they stand (kvbridge.blend; the prompt cut by
        KVB_BLEND_SEPARATOR). The placement runs at admission on the loop's thread, the question's
        prefill and the generation in the shared batches; passages not stored yet are stored after
        the answer. A prompt without passages runs as usual and its record says so.

        cache_salt (a tenant, as vLLM's `cache_salt`): the request shares resident cells only with
        requests of the same salt, and its stored KV lives under keys seeded by it, so a prompt another
        salt cached is a cold prefill here (no timing tells one tenant what another asked)."""
        future: Future = Future()
        if not isinstance(cache_salt, str) or len(cache_salt) > 256:
            future.set_exception(RequestRefused("cache_salt must be a string of at most 256 characters"))
            return future
        with self._lock:
            if self._closing:
                raise RequestRefused("the scheduler is closed")
            if len(self._waiting) >= self.settings.sched_max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (KVB_SCHED_MAX_WAITING="
                                f"{self.settings.sched_max_waiting}); try again when some have finished")
            request_id = next(self._ids)
        try:
            # only a blend request is cut at the separator: any other prompt reaches the model as sent
            tokens = self._prompt_tokens(prompt, cut=True) if blend else self._prompt_tokens(prompt)
            segments = getattr(tokens, "segments", ())
            self._check_request(tokens, priority, n_predict)
            if blend and len(segments) >= 3:
                self._blender_for(cache_salt)   # a model that cannot blend is refused here, on this request
        except (RequestRefused, ValueError, TypeError, KVBridgeError) as exc:
            future.set_exception(exc if isinstance(exc, RequestRefused) else RequestRefused(str(exc)))
            return future
        n_predict = self.settings.n_predict if n_predict is None else int(n_predict)
        blending = bool(blend) and len(segments) >= 3
        record = RequestRecord(mode="blend" if blending else "lmcache", engine="llamacpp-scheduler", kv_mode="full",
                               label=label, request_index=request_id, prompt_tokens=len(tokens), priority=priority)
        if blend and not blending:
            record.add_note(no_passages_note(self.settings.blend_separator))
        request = Request(request_id, label or f"request {request_id}", int(priority), tokens, n_predict,
                          Sampler(temperature, top_p, seed), tuple(stop), on_token, future, record, salt=cache_salt,
                          segments=segments, blend=blending)
        future.record = record   # live: tier and matched_tokens are set at admission (a server's headers read them)
        with self._lock:
            # checked again where the request joins the queue: submits from several threads all passed
            # the first check while their prompts were tokenized, and each appended (no limit at all)
            if len(self._waiting) >= self.settings.sched_max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (KVB_SCHED_MAX_WAITING="
                                f"{self.settings.sched_max_waiting}); try again when some have finished")
            self._waiting.append(request)
            self._lock.notify_all()
        return future

    def cancel(self, future: Future) -> bool:
        """Stop a waiting, running or swapped request and free its blocks; False when it already finished."""
        cancelled = future.cancel()
        with self._lock:
            self._lock.notify_all()
        return cancelled

    def snapshot(self) -> dict:
        """Blocks by owner (shared ones with reference counts), pressure, the three queues, the free
        sequence ids, counters."""
        with self._lock:
            return {
                "blocks": self.ledger.snapshot(),
                "pressure": self.ledger.pressure().name,
                "watermarks": {"soft": self.settings.sched_soft, "hard": self.settings.sched_hard,
                               "critical": self.settings.sched_critical},
                "running": [r.describe() for r in self._running],
                "waiting": [r.describe() for r in self._waiting],
                "swapped": [r.describe() for r in self._swapped],
                "prefixes": [{"id": p.id, "tokens": len(p.tokens), "holder": p.holder, "label": p.label}
                             for p in self._prefixes],
                "free_seqs": sorted(self._free_seqs),
                "counters": {name: self._counters[name] for name in ("hits", "misses", "evictions", "preemptions",
                                                                     "swap_ins", "recomputed", "shared_tokens",
                                                                     "restored_tokens", "restore_failed", "finished",
                                                                     "cancelled", "faults", "failed",
                                                                     "blend_reused_tokens")},
            }

    def events(self) -> list[dict]:
        with self._lock:
            return [{"t": round(e.t, 4), "kind": e.kind, "request": e.request, "label": e.label, "detail": e.detail}
                    for e in self._events]

    def drain(self, timeout_s: float = 300.0) -> bool:
        """Wait until every submitted request finished and the prompts' stores are done."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._running or self._waiting or self._swapped:
                if not self._lock.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() > deadline:
                    return False
        self._swap_shared.writer.drain(max(1.0, deadline - time.monotonic()))
        return True

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._lock.notify_all()
        self._thread.join(timeout=60)
        for request in self._running + self._waiting + self._swapped:
            self._fail(request, RequestRefused("the scheduler was closed before this request finished"))
        self._swaps.close()
        self._swap_shared.close()
        if self._blender is not None:
            self._blender.close()
        self._ctx.close()
        if self._own_store:
            self.store.close()

    # -- checks ---------------------------------------------------------------------------------------
    def _prompt_tokens(self, prompt, cut: bool = False) -> list[int]:
        """Token ids (a PromptTokens list: with the segment starts); a blend request (`cut`) cut by the
        blend separator is tokenized segment by segment, any other prompt as it is, separator and all
        (a message that holds the separator reaches the model unaltered)."""
        if isinstance(prompt, str):
            text = prompt
        else:
            text = self._ctx.render(tuple(dict(m) for m in prompt))
        if not text:
            raise RequestRefused("the prompt is empty")
        segmented = tokenize_segments(text, self.settings.blend_separator, self._ctx.tokenize) if cut else None
        if segmented is not None:
            return PromptTokens(segmented.tokens, segmented.starts)
        return PromptTokens(self._ctx.tokenize(text))

    def _blender_for(self, salt: str):
        """The blend runner of a cache salt (its passages live under that salt's namespace), on this context:
        one runner, seen under each salt's namespace, so a salt costs no runner or buffer of its own."""
        from kvbridge.blend.runner import BlendRunner

        if self._blender is None:   # raises BlendRefused for a model blend cannot run, on the request that asked
            self._blender = BlendRunner(self.settings, self.store, self.namespace, context=self._ctx,
                                        geometry=self._geometry)
        return self._blender.under(salt_namespace(self.namespace, salt)) if salt else self._blender

    def _check_request(self, tokens: list[int], priority, n_predict) -> None:
        if not isinstance(priority, int) or not 0 <= priority <= 9:
            raise RequestRefused(f"priority {priority!r} is out of range; use 0 to 9 (higher is more urgent)")
        if n_predict is not None and int(n_predict) < 1:
            raise RequestRefused(f"n_predict must be at least 1, got {n_predict}")
        budget = min(self.settings.ctx_size, self._ctx.n_cells)
        if len(tokens) + 1 > budget:
            raise RequestRefused(f"the prompt has {len(tokens)} tokens; one request may use at most {budget} "
                                 f"(KVB_CTX_SIZE={self.settings.ctx_size}, KVB_SCHED_KV_CELLS={self._ctx.n_cells})")

    # -- the loop -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closing and not (self._running or self._waiting or self._swapped):
                    self._lock.wait()
                if self._closing:
                    return
            try:
                self._step()
            except Exception as exc:   # counted, logged, and on the futures of the requests it involved
                log.exception("a scheduler step failed")
                with self._lock:
                    self._fail_step(exc)

    def _fail_step(self, exc: Exception) -> None:
        """Fail the requests whose operation the exception interrupted (a batch's, a start's, a
        preemption's) and free their sequences and blocks, so the loop goes on serving the others. A
        fault outside every request's operation is one in the policy itself, which would recur each
        step: then every queued request is failed (and freed) rather than the loop spinning on it."""
        involved = self._involved or self._running + self._waiting + self._swapped
        self._involved = []
        self._counters["faults"] += 1
        seen: set[int] = set()
        for request in involved:
            if request.id not in seen:
                seen.add(request.id)
                self._abort(request, exc)
        self._lock.notify_all()

    @contextlib.contextmanager
    def _working_on(self, *requests: Request):
        """Mark the requests an operation is changing: if the step fails inside it, they are the ones
        left half-changed (a sequence taken, cells decoded but not accounted), so they are the ones failed."""
        mark = len(self._involved)
        self._involved.extend(requests)
        yield
        del self._involved[mark:]

    def _step(self) -> None:
        with self._lock:
            self._drop_cancelled()
            self._relieve_pressure()
            self._resume_swapped()
            self._admit_waiting()
            batch = self._plan_batch()
        if not batch:   # nothing can run now: wait for a submit, a cancel or a finished store
            with self._lock:
                self._lock.wait(0.02)
            return
        entries = [entry for _, feed in batch for entry in feed]
        with self._working_on(*(request for request, _ in batch)):
            rc = self._ctx.decode(entries)
            with self._lock:
                if rc != 0:
                    self._no_room(rc)
                    return
                self._after_decode(batch)
                self._lock.notify_all()

    # -- 1, 2: cancels and pressure -------------------------------------------------------------------
    def _drop_cancelled(self) -> None:
        for queue_ in (self._waiting, self._running, self._swapped):
            for request in [r for r in queue_ if r.future.cancelled()]:
                with self._working_on(request):
                    queue_.remove(request)
                    self._free_request(request)
                    self._release_swap(request)
                request.state = "done"
                self._counters["cancelled"] += 1
                self._event("cancel", request)

    def _relieve_pressure(self) -> None:
        while self.ledger.pressure() >= Pressure.SOFT and self._prefixes:
            self._evict_prefix(min(self._prefixes, key=lambda p: p.last_used))
        if self.ledger.pressure() >= Pressure.CRITICAL and len(self._running) > 1:
            self._preempt(self._least_urgent(), "critical pressure")

    def _evict_prefix(self, prefix: CachedPrefix) -> None:
        """Drop a cached prefix (its prompt was stored after its prefill, so a restore can bring it back)."""
        self._prefixes.remove(prefix)
        self._ctx.seq_rm(prefix.seq)
        self.ledger.release(prefix.held)
        self._free_seqs.append(prefix.seq)
        self._counters["evictions"] += 1
        self._event("evict", prefix, f"{len(prefix.tokens)} tokens")

    # -- 3: resume and admit ----------------------------------------------------------------------------
    def _resume_swapped(self) -> None:
        for request in sorted(self._swapped, key=lambda r: (-r.priority, r.submitted)):
            if not self._make_room(request):
                break
            self._swapped.remove(request)
            self._start(request, resumed=True)

    def _admit_waiting(self) -> None:
        top_swapped = max((r.priority for r in self._swapped), default=-1)
        for request in sorted(self._waiting, key=lambda r: (-r.priority, r.submitted)):
            if request.priority <= top_swapped:
                break        # swapped requests resume before new ones of no higher priority
            if self.ledger.pressure() >= Pressure.HARD and not self._can_preempt_for(request):
                break
            if self._prefix_in_prefill(request):
                continue     # share it when its prefill is done rather than prefill the same tokens twice
            if not self._make_room(request):
                if self._can_preempt_for(request):
                    self._preempt(self._least_urgent(), f"for {request.holder} (priority {request.priority})")
                    if not self._room_for(request):
                        break
                else:
                    break
            self._waiting.remove(request)
            request.admitted_at = time.perf_counter()
            request.record.queue_ms = (request.admitted_at - request.submitted) * 1e3
            self._start(request, resumed=False)

    def _make_room(self, request: Request) -> bool:
        """Whether the request fits, after evicting cold cached prefixes (least recently used first)
        when blocks are short; a full set of running slots is not helped by evicting anything."""
        if len(self._running) >= self.max_running:
            return False
        while not self._room_for(request) and self._prefixes:
            self._evict_prefix(min(self._prefixes, key=lambda p: p.last_used))
        return self._room_for(request)

    def _room_for(self, request: Request) -> bool:
        """A free slot and blocks for the context (a shared prefix costs nothing) plus a decode block each."""
        if len(self._running) >= self.max_running or not self._free_seqs:
            return False
        _, shared = self._best_source(request.context, request.salt)
        cost = self.ledger.blocks_for(len(request.context) - shared) + len(self._running) + 1
        if not self._running:   # alone it may use the whole budget: never wait for nobody
            return cost <= self.ledger.free_blocks()
        return self.ledger.pressure(extra_blocks=cost) < Pressure.HARD and cost <= self.ledger.free_blocks()

    def _prefix_in_prefill(self, request: Request) -> bool:
        """A running request is still prefilling most of this request's context (at least half of it,
        and a block more than any resident sequence holds now): a system prompt many users send at
        once. Waiting costs this request that prefill's time; not waiting would prefill it twice. A
        short common run (a few tokens of chat template) is not worth a wait."""
        _, shared = self._best_source(request.context, request.salt)
        limit = len(request.context) - 1
        for other in self._running:
            if other.prefilling and other.salt == request.salt:
                common = _common_prefix(other.prompt, request.context, limit)
                if 2 * common >= len(request.context) and common >= shared + self.ledger.block_tokens \
                        and other.kv_tokens < common:
                    return True
        return False

    def _can_preempt_for(self, request: Request) -> bool:
        return bool(self._running) and self._least_urgent().priority < request.priority

    def _least_urgent(self) -> Request:
        return min(self._running, key=lambda r: (r.priority, -r.submitted))

    def _start(self, request: Request, resumed: bool) -> None:
        """Give the request a sequence holding as much of its context as resident cells or the store have."""
        with self._working_on(request):
            request.seq = self._take_seq()
            request.held = Holding(request.holder)
            if request.blend and not resumed:
                kv, tier = self._blend_place(request)
            else:
                kv, tier = self._reuse(request, resumed)
            self._release_swap(request)   # restored (or to be recomputed): the store may evict them again
            context = request.context
            if resumed:
                self._counters["swap_ins"] += 1
                if kv < len(context) - 1:
                    self._counters["recomputed"] += 1
                self._event("swap-in", request, f"{kv} of {len(context)} tokens restored")
            else:
                self._counters["hits" if kv else "misses"] += 1
                if not request.blend:   # a blend request's positions held include the tokens it recomputed
                    request.record.matched_tokens = kv
                request.record.chunks_hit = kv // self.settings.chunk_size
                request.record.tier = tier
                if request.record.restore_ok is None:   # False stays: a restore failed and was recomputed
                    request.record.restore_ok = True if kv else None
                self._event("admit", request, f"{len(context)} tokens, {kv} reused ({tier})")
            request.kv_tokens = kv
            request.pending = context[kv:]
            request.state = "running"
            self._running.append(request)

    def _reuse(self, request: Request, resumed: bool) -> tuple[int, str]:
        """Fill the request's new sequence with the longest resident run (shared), replaced by the store's
        copy when that is longer: (tokens the sequence holds, where they came from)."""
        source, shared = self._best_source(request.context, request.salt)
        if shared > 0:
            self._share(request, source, shared)
            self._counters["shared_tokens"] += shared
            if isinstance(source, CachedPrefix):
                source.last_used = time.monotonic()
            self._event("share", request, f"{shared} tokens from {source.holder}")
        if resumed and request.swap is not None and not request.swap.complete:
            return shared, "resident" if shared else "none"   # the store could not take it at swap-out
        kv, tier, restore_ms = self._restore_beyond(request, source, shared)
        if resumed:
            request.record.swap_in_ms += restore_ms
        return kv, tier

    def _blend_place(self, request: Request) -> tuple[int, str]:
        """Blend: stored instruction and passages placed into the request's sequence, a few tokens of each
        passage (its last, by default) decoded in context (kvbridge.blend.runner); (positions held, slowest
        tier). Needs a free sequence for a moment, and takes more where there are (one per later passage,
        up to RUN_SEQS) to decode every passage's recomputed tokens at once; without one free sequence, or
        when llama.cpp has no room, it computes everything."""
        from kvbridge.blend.runner import RUN_SEQS, BlendResult

        if not self._free_seqs:
            request.record.add_note("blend: no free sequence to place passages through; computed in full")
            return 0, "none"
        scratch = self._free_seqs.pop()
        # more free sequences, when there are, let every passage's recomputed tokens go into one decode
        later_passages = max(0, len(request.segments) - 3)
        runs = [self._free_seqs.pop() for _ in range(min(len(self._free_seqs), later_passages, RUN_SEQS))]
        runner = self._blender_for(request.salt)
        result = BlendResult()
        try:
            placement = runner.place(request.prompt, request.segments, self.settings.blend_recompute_tokens, result,
                                     answer=request.seq, scratch=scratch,
                                     recompute_at=self.settings.blend_recompute_at, run_seqs=runs)
        except KVBridgeError as exc:
            self._ctx.seq_rm(request.seq)
            self._counters["restore_failed"] += 1
            request.record.restore_ok = False
            request.record.add_note(f"blend placement failed ({exc}); computed in full")
            return 0, "none"
        finally:
            for seq in [scratch, *runs]:
                self._ctx.seq_rm(seq)
                self._free_seqs.append(seq)
        kv = placement.kv_tokens
        if kv:
            self.ledger.grow(request.held, kv, request.holder)
        request.blend_placement, request.blend_result = placement, result
        record = request.record
        record.prefill_tokens += result.recomputed_tokens - len(placement.pending)   # decoded while placing
        result.fill_record(record, len(request.segments), self.settings.blend_recompute_tokens,
                           self.settings.blend_recompute_at)
        self._counters["blend_reused_tokens"] += result.reused_tokens
        return kv, result.tier if result.reused_tokens else "none"

    def _store_blend(self, request: Request) -> None:
        """After a blend answer: the passages it computed, each from its own prefill after the instruction."""
        placement = request.blend_placement
        if placement is None or not placement.missing or request.seq is None or not self._free_seqs:
            return
        scratch = self._free_seqs.pop()
        try:
            self._blender_for(request.salt).store_missing(request.prompt, placement, request.blend_result,
                                                          answer=request.seq, scratch=scratch)
            request.record.stored_objects = request.blend_result.stored_segments
        except KVBridgeError as exc:
            log.warning("storing blend passages of %s failed: %s", request.holder, exc)
        finally:
            self._ctx.seq_rm(scratch)
            self._free_seqs.append(scratch)
            request.blend_placement = None

    def _restore_beyond(self, request: Request, source, shared: int) -> tuple[int, str, float]:
        """Restore the context's longest stored prefix into the request's sequence when it beats the
        `shared` cells from `source`: (tokens the sequence holds then, their tier, ms spent restoring)."""
        kept = shared, "resident" if shared else "none", 0.0
        enough = shared + self.ledger.block_tokens // 2    # less is not worth replacing the shared cells
        if len(request.context) - 1 <= enough:
            return kept     # the resident run covers all the store could give
        start = time.perf_counter()
        plan = self._swap_for(request.salt).restore(request.context, request.swap, at_least=enough)
        if plan.matched_tokens <= enough or plan.state is None:
            return kept
        self._empty(request)   # the store's copy replaces the shared cells: one sequence, one source
        try:
            self._ctx.load_seq(request.seq, plan.state.data)
            held = self._ctx.seq_len(request.seq)
            if held != plan.matched_tokens:
                raise StateTransferError(f"the sequence holds {held} positions after restoring {plan.matched_tokens}")
        except KVBridgeError as exc:
            kv = self._recompute_after_failed_restore(request, source, shared, exc)
            return kv, "resident" if kv else "none", (time.perf_counter() - start) * 1e3
        self.ledger.grow(request.held, plan.matched_tokens, request.holder)
        self._counters["restored_tokens"] += plan.matched_tokens
        self._event("restore", request, f"{plan.matched_tokens} tokens from {plan.tier}")
        return plan.matched_tokens, plan.tier, (time.perf_counter() - start) * 1e3

    def _recompute_after_failed_restore(self, request: Request, source, shared: int, exc: Exception) -> int:
        """llama.cpp refused the state (no room for its cells near capacity, or a layout it does not
        take) after the sequence gave up its shared cells for it. Share them again (no new cells, which
        the cache is short of) and recompute the rest; the count returned is what the sequence really
        holds, so the next decode continues at cells that are there, not past missing ones."""
        log.warning("restore into sequence %d failed (%s); recomputing past %d shared tokens", request.seq, exc, shared)
        self._counters["restore_failed"] += 1
        request.record.restore_ok = False
        request.record.add_note(f"restore failed ({exc}); recomputed")
        self._empty(request)   # whatever a refused load left behind
        if shared > 0:
            self._share(request, source, shared)
        held = self._ctx.seq_len(request.seq)
        if held != shared:     # the cells are not what the ledger says: recompute all of it
            self._empty(request)
            held = 0
        self._event("restore-failed", request, f"{exc}; {held} tokens kept, {len(request.context) - held} recomputed")
        return held

    def _share(self, request: Request, source, n_tokens: int) -> None:
        """The first n_tokens of `source`'s cells join the request's (empty) sequence: seq_cp, no copy."""
        self._ctx.seq_cp(source.seq, request.seq, n_tokens)
        request.held = self.ledger.share(source.held, request.holder, n_tokens)

    def _empty(self, request: Request) -> None:
        """The request's sequence gives up every cell it holds (its sequence id stays with it)."""
        self._ctx.seq_rm(request.seq)
        self.ledger.release(request.held)
        request.held = Holding(request.holder)

    def _best_source(self, context: list[int], salt: str):
        """The resident sequence (running request or cached prefix) of the same cache salt sharing the
        longest token run with `context`, and that length (at most len(context) - 1: the last token is
        always fed)."""
        best, best_len = None, 0
        limit = len(context) - 1
        for source in [*self._running, *self._prefixes]:
            if source.salt != salt or getattr(source, "blend", False):   # blended cells are not exact KV
                continue
            tokens = source.context[:source.kv_tokens] if isinstance(source, Request) else source.tokens
            n = _common_prefix(tokens, context, limit)
            if n > best_len:
                best, best_len = source, n
        return best, best_len

    # -- preemption ---------------------------------------------------------------------------------
    def _preempt(self, request: Request, why: str) -> None:
        """Swap the request's KV out to the store, free its cells, and queue it to resume later."""
        with self._working_on(request):
            start = time.perf_counter()
            self._running.remove(request)
            kept = request.kv_tokens
            if request.blend:
                # blended KV is not what the exact store may hold: resumed, it is recomputed exactly
                request.blend = False
                request.record.add_note("blend: preempted; resumed by computing the context exactly")
            elif kept > 0:
                data = self._ctx.save_seq(request.seq)
                capture = self._window_captures(request.seq, data)
                request.swap = self._swap_for(request.salt).swap_out(data, request.context[:kept], capture)
            self._free_request(request)
            request.kv_tokens = 0
            request.pending = request.context
            request.state = "swapped"
            request.record.preemptions += 1
            request.record.swap_out_ms += (time.perf_counter() - start) * 1e3
            self._swapped.append(request)
            self._counters["preemptions"] += 1
            self._event("preempt", request, why)
            lost = request.swap is not None and not request.swap.complete
            self._event("swap-out", request, f"{kept} tokens" + (" (store refused: will recompute)" if lost else ""))

    def _no_room(self, rc: int) -> None:
        """llama.cpp found no cells for the batch: preempt or evict, then the next step retries."""
        if rc < 0:
            raise KVBridgeError(f"llama_decode failed with {rc}")
        if self._prefixes:
            self._evict_prefix(min(self._prefixes, key=lambda p: p.last_used))
        elif len(self._running) > 1:
            self._preempt(self._least_urgent(), "llama.cpp had no free cells")
        else:
            request = self._running[0]
            self._running.remove(request)
            self._free_request(request)
            self._fail(request, RequestRefused("the KV cache has no room for this request (KVB_SCHED_KV_CELLS)"))

    # -- 4, 5: the batch and what comes out ----------------------------------------------------------
    def _plan_batch(self) -> list[tuple[Request, list[tuple[int, int, int, bool]]]]:
        """Decoding sequences first (one token each), then prefill chunks in priority order. A step
        that carries decode tokens, or prefills of different priorities, takes at most
        SHARED_STEP_PREFILL prefill tokens, so no one waits for a long prefill step."""
        batch = []
        room = BATCH_TOKENS
        ordered = sorted(self._running, key=lambda r: (len(r.pending) > 1, -r.priority, r.submitted))
        prefilling = [r for r in ordered if len(r.pending) > 1]
        shared = len(prefilling) < len(ordered) or len({r.priority for r in prefilling}) > 1
        prefill_room = SHARED_STEP_PREFILL if shared else BATCH_TOKENS
        for request in ordered:
            if room <= 0:
                break
            take = room if len(request.pending) <= 1 else min(room, prefill_room)
            feed = request.pending[:take]
            if not feed:
                continue
            if len(request.pending) > 1:
                prefill_room -= len(feed)
            last = len(feed) == len(request.pending)
            entries = [(token, request.kv_tokens + i, request.seq, last and i == len(feed) - 1)
                       for i, token in enumerate(feed)]
            batch.append((request, entries))
            room -= len(entries)
        return batch

    def _after_decode(self, batch) -> None:
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
            if entries[-1][3]:
                sampled.append((request, logit_index - 1))
        for request, index in sampled:
            try:
                self._on_token(request, request.sampler.pick(self._ctx.logits(index)))
            except Exception as exc:   # its own fault (its on_token raised): counted, logged, on its future
                log.exception("%s failed after its decode", request.holder)
                self._counters["faults"] += 1
                self._abort(request, exc)

    def _on_token(self, request: Request, token: int) -> None:
        now = time.perf_counter()
        if request.first_token_at is None:
            request.first_token_at = now
            request.record.ttft_ms = (now - request.submitted) * 1e3
        if not request.prompt_stored and request.kv_tokens >= len(request.prompt):
            request.prompt_stored = True   # its prompt's KV, for a restart or another process
            request.store_pending = self._worth_storing(request)
        self._emit(request, token)
        self._store_prompt(request)   # after the token went out: the state copy (tens of MB) is off the TTFT

    def _worth_storing(self, request: Request) -> bool:
        """What it reused came from the store or from a sequence whose prompt was stored, so only what
        lies beyond is new: worth storing unless every whole chunk is there already and the rest is a
        few tokens (a new question after a shared document). That tail would cost a copy of the whole
        sequence's state (tens of MB) and a tail object of up to a chunk to save recomputing a few
        tokens, and on a 2-core machine it competes with the next request's prefill."""
        if request.blend:
            return False   # blended KV never becomes exact chunks (its passages are stored by _store_blend)
        reused, n = request.record.matched_tokens, len(request.prompt)
        new_tokens = n - reused
        c = self.settings.chunk_size
        return new_tokens > 1 and not (reused // c >= n // c and new_tokens < c // 4)

    def _store_prompt(self, request: Request) -> None:
        if request.store_pending and request.seq is not None:
            request.store_pending = False
            data = self._ctx.save_seq(request.seq)
            self._swap_for(request.salt).store_behind(data, request.prompt, self._window_captures(request.seq, data))

    def _window_captures(self, seq: int, data) -> Callable[[int], WindowCapture | None] | None:
        """Sliding-window models: a saved state holds the window rows of its last positions only; the
        earlier windows are read now, on this thread (llama.cpp's context is not shared), through a
        free sequence id, for ChunkKV.store_prompt to take later (its capture calls, precomputed:
        each asks one position past the rows still missing). None: no window, or no free sequence."""
        window = self._geometry.window
        if not window or not self._free_seqs:
            return None
        start = parse_state(data, window=window).window_start
        scratch = self._free_seqs[-1]
        captured: dict[int, WindowCapture] = {}
        while start > 0:
            end = start + 1
            captured[end] = WindowCapture(self._ctx.save_window(seq, scratch, end), whole_state=False, trusted_end=end)
            start = max(0, end - window)
        return captured.get

    def _emit(self, request: Request, token: int) -> None:
        if self._ctx.is_end(token):
            self._finish(request)
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
            self._finish(request)
        else:
            request.pending = [token]

    def _finish(self, request: Request) -> None:
        tail = request.pieces.flush()
        if tail:
            request.text += tail
            if request.on_token is not None:
                request.on_token(tail)
        self._running.remove(request)
        request.state = "done"
        record = request.record
        record.text = request.text
        record.gen_tokens = len(request.generated)
        record.total_ms = (time.perf_counter() - request.submitted) * 1e3
        self._counters["finished"] += 1
        self._event("finish", request, f"{record.gen_tokens} tokens")
        if not request.future.cancelled():
            request.future.set_result(record)   # first: what follows is housekeeping, not the answer's time
        self._store_prompt(request)
        if request.blend:
            self._store_blend(request)
        self._keep_prefix(request)
        self._free_request(request)

    def _keep_prefix(self, request: Request) -> None:
        """Keep the finished prompt resident (its cells shared, not copied) for later prompts to share.

        All but its last token: a later request always feeds its own last token, and with that cell
        left free (it is the first one freed with the request) the same prompt asked again decodes its
        last token into the cell it had when it was computed cold, and a longer one continues there.
        llama.cpp's attention sums over cells in SIMD lanes by cell index, so the same token one cell
        further on rounds differently: on an AVX2 machine Gemma 3's repeated answer differed from its
        cold one at the first tied logit (Docs/Research.md, "Exact on every CPU")."""
        n = min(len(request.prompt), request.kv_tokens) - 1
        if self.settings.sched_cached_prefixes == 0 or n < self.ledger.block_tokens or request.blend:
            return
        if any(p.salt == request.salt and _common_prefix(p.tokens, request.prompt, n) >= n for p in self._prefixes):
            return   # the same prompt is resident already
        if len(self._prefixes) >= self.settings.sched_cached_prefixes:
            self._evict_prefix(min(self._prefixes, key=lambda p: p.last_used))
        if not self._free_seqs:
            return
        seq = self._take_seq()
        self._ctx.seq_cp(request.seq, seq, n)
        prefix = CachedPrefix(next(self._ids), seq, request.prompt[:n], Holding(""), f"prompt of {request.label}",
                              salt=request.salt)
        prefix.held = self.ledger.share(request.held, prefix.holder, n)
        self._prefixes.append(prefix)

    # -- helpers ----------------------------------------------------------------------------------------
    def _swap_for(self, salt: str) -> SwapSpace:
        """The store space of a cache salt: its namespace (so its hash seed, so every key) has the salt's
        digest in it. The salt itself never appears in a namespace, a key or a status. Called on the
        loop's thread, where the queues it reads are its own."""
        return self._swaps.get(salt, self._salts_in_use)

    def _salts_in_use(self) -> set[str]:
        return {r.salt for queue_ in (self._running, self._waiting, self._swapped) for r in queue_}

    def bytes_held(self) -> dict[str, dict[str, int]] | None:
        """{cache salt: {tier: bytes}} the store holds under each salt this scheduler has used (the salt
        "" shares its namespace with CachedEngine's); None when the store cannot tell (a cache server's
        objects are counted there). Reads the store's indexes, not the scheduler's lock."""
        by_namespace = getattr(self.store, "bytes_by_namespace", None)
        if by_namespace is None:
            return None
        held = by_namespace()
        return {salt: dict(held.get(space.kv.namespace, {})) for salt, space in self._swaps.items()}

    def _take_seq(self) -> int:
        return self._free_seqs.pop(0)

    def _free_request(self, request: Request) -> None:
        if request.seq is not None:
            self._ctx.seq_rm(request.seq)
            self._free_seqs.append(request.seq)
            request.seq = None
        if request.held is not None:
            self.ledger.release(request.held)
            request.held = None

    def _abort(self, request: Request, error: Exception) -> None:
        """A request a fault left half-changed: out of its queue, its sequence and blocks freed, the
        error on its future (counted; one that has its answer already is only freed)."""
        for queue_ in (self._running, self._waiting, self._swapped):
            queue_[:] = [r for r in queue_ if r is not request]
        self._free_request(request)
        answered = request.future.done()
        self._fail(request, error)
        if not answered:
            self._counters["failed"] += 1
            self._event("fail", request, f"{type(error).__name__}: {error}")

    def _fail(self, request: Request, error: Exception) -> None:
        request.state = "done"
        self._release_swap(request)
        if not request.future.done():
            request.future.set_exception(error)

    @staticmethod
    def _release_swap(request: Request) -> None:
        if request.swap is not None:
            request.swap.release()
            request.swap = None

    def _event(self, kind: str, who: Request | CachedPrefix, detail: str = "") -> None:
        self._events.append(Event(time.perf_counter() - self._started, kind, who.holder, detail, who.label))


class PromptTokens(list):
    """A prompt's token ids, and where its segments start when it was cut by the blend separator."""

    def __init__(self, tokens, segments: tuple[int, ...] = ()) -> None:
        super().__init__(int(t) for t in tokens)
        self.segments = tuple(segments)


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    return min(common_prefix_length(a, b), limit)
