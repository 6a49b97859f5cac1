"""Many conversations on one llama.cpp context: continuous batching over a paged KV budget, shared
prefixes, LRU eviction of cached prefixes, watermark pressure and priority preemption with swap.

The Scheduler is the API and the loop; one thread owns llama.cpp, and each step runs the parts in turn:
  1. cancelled requests free their blocks (lifecycle);
  2. pressure from free blocks evicts cold cached prefixes or preempts (policy);
  3. swapped requests resume, then waiting ones are admitted in priority order (policy), each started
     with what resident cells share (prefix_cache), the store restores (restorer) or blend places
     (blend_placement);
  4. one batch: a token for every decoding sequence plus prefill work for admitted ones (planner);
  5. sampling, streaming, stop checks (streaming); a finished prompt stays resident as a cached
     prefix and is stored (lifecycle, prefix_cache, restorer);
  6. the kv listeners are told when the resident whole chunks changed (kv_listeners), and, from the
     writer, what each stored prompt left in the store.
A recurrent or hybrid model (Mamba 2, LFM2, Granite 4 hybrid, ...) runs exactly: its prefill pieces end
where chunks end so its recurrent state is captured there (planner, streaming), a preempted sequence is
swapped out whole (sequence_store), and resident sequences are shared only whole (prefix_cache).
Faults degrade, counted: an exception in a step fails only the requests it was changing, and the
loop goes on. What the lab and serve read is a copy: snapshot() and events() (events).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, Sequence

from kvbridge.backends.base import Message
from kvbridge.backends.llama_context import LlamaContext, Sampler
from kvbridge.backends.llama_cpp_model import llama_cpp_fingerprint
from kvbridge.backends.model_traits import traits_of_model
from kvbridge.engine import cut_verdicts
from kvbridge.engine.layout import decide_layout, probe_state_on_sequence
from kvbridge.engine.namespace import namespace_for
from kvbridge.engine.records import RequestRecord
from kvbridge.engine.segments import no_passages_note
from kvbridge.errors import EngineUnavailable, KVBridgeError
from kvbridge.scheduler import events, exact
from kvbridge.scheduler.blend_placement import BlendPlacer
from kvbridge.scheduler.intake import RequestRefused, check_queue, check_request, prompt_tokens
from kvbridge.scheduler.kv_listeners import KVListeners
from kvbridge.scheduler.ledger import BlockLedger
from kvbridge.scheduler.lifecycle import Lifecycle
from kvbridge.scheduler.misses import AdmissionMisses
from kvbridge.scheduler.planner import plan_batch
from kvbridge.scheduler.policy import Policy
from kvbridge.scheduler.prefix_cache import PrefixCache
from kvbridge.scheduler.requests import Queues, Request
from kvbridge.scheduler.restorer import Restorer
from kvbridge.scheduler.salts import SaltStores, salt_namespace
from kvbridge.scheduler.sequence_store import SequenceStore, SequenceStoreShared
from kvbridge.scheduler.sequences import SequencePool
from kvbridge.scheduler.streaming import Streamer
from kvbridge.settings import Settings
from kvbridge.store import open_store
from kvbridge.store.serde import remember_geometry

log = logging.getLogger(__name__)

PROBE_TEXT = "KVBridge scheduler probe: the KV layout of this model."


class Scheduler:
    """`Scheduler(settings)`; `submit(...)` returns a Future of the RequestRecord. Use as a context manager."""

    def __init__(self, settings: Settings, store=None) -> None:
        self.settings = s = settings
        self.chunk_size = s.chunk_size
        # exact mode (on by default) unless the settings or the model rule it out: then off, and said so
        self.exact_off_reason = exact.off_reason(s)
        self._open_context(not self.exact_off_reason)
        self.store = store if store is not None else open_store(s)
        self._own_store = store is None
        traits = traits_of_model(self._ctx.model)
        layout = self._decide_layout(traits)
        self._geometry = geometry = layout.geometry
        if self.exact and geometry.recurrent:   # known once the model is loaded: its context again, unified
            self.exact_off_reason = exact.off_reason(s, traits.architecture, recurrent=True)
            self._ctx.close()
            self._open_context(False)
            layout = self._decide_layout(traits)
            self._geometry = geometry = layout.geometry
        if s.sched_exact and self.exact_off_reason:
            log.warning("exact mode is off: %s", self.exact_off_reason)
        # exact mode: how many decode tokens one call may carry, measured on this model and CPU (kvbridge.scheduler.exact)
        self.decode_width = exact.probe_decode_width(self._ctx, self.seqs.free[:s.sched_max_running],
                                                     s.sched_max_running, exact.probe_tokens()) if self.exact else 0
        # a recurrent model's state is captured where each chunk ends while it prefills (0: not recurrent)
        boundary_step = s.chunk_size if geometry.recurrent else 0
        remember_geometry(geometry)   # the int8 codec finds a chunk's K and V rows by it
        fingerprint = llama_cpp_fingerprint(s, traits)
        self.namespace = namespace_for(s, fingerprint=fingerprint, model_path=self._ctx.model_path,
                                       kv_layout=exact.namespace_key(layout.namespace_key, self.exact), store=self.store)
        # exact mode's cut: the cut probe's verdict for this model, build and CPU (CachedEngine's), else a grid of 32
        self.cut_rule = exact.cut_rule(cut_verdicts.rule_for(s, self._ctx.model_path, fingerprint))
        self._store_shared = SequenceStoreShared()   # one writer thread and one restore buffer for every salt
        self._swaps = SaltStores(lambda salt: SequenceStore(self.store, s, salt_namespace(self.namespace, salt),
                                                            geometry, shared=self._store_shared,
                                                            n_stream=self._ctx.n_seq if self.exact else 1),
                              s.sched_max_salts)
        self.swap = self._swaps.get("")
        self.queues = Queues()
        self.journal = events.Journal()
        self._ids = iter(range(1, 1 << 62))   # requests and cached prefixes: one numbering
        self.prefixes = PrefixCache(self._ctx, self.seqs, self.queues.running, s.sched_cached_prefixes, self._ids,
                                    self.journal, whole_only=bool(geometry.recurrent), exact=self.exact,
                                    rule=self.cut_rule)
        misses = AdmissionMisses(self._detokenize, s.explain_misses, s.sched_block_tokens // 2, exact=self.exact,
                                 rule=self.cut_rule)
        self.restorer = Restorer(self._ctx, self.seqs, self.prefixes, self._swap_for, geometry.window, s.chunk_size,
                                 self.journal, geometry=geometry, misses=misses, exact=self.exact,
                                 rule=self.cut_rule)
        if self.exact:
            self.journal.notes.append(
                f"exact mode: one KV stream per sequence, prefill pieces on their own, up to {self.decode_width} "
                "decode tokens a call (as many as leave each sequence's logits those of a decode alone on this CPU)")
            self.journal.notes.append(f"exact mode's cut: {self.cut_rule.describe()}")
        elif s.sched_exact:
            self.journal.notes.append(f"exact mode is off: {self.exact_off_reason}")
        if geometry.recurrent:
            self.journal.notes.append(
                f"{traits.architecture} keeps recurrent state: prefill steps end at every {s.chunk_size}-token chunk "
                "to capture it; resident sequences are shared only when a new context extends all of one; a "
                "preempted sequence is swapped out as one whole-sequence snapshot")
        self.blend = BlendPlacer(s, self.store, self.namespace, geometry, self._ctx, self.seqs, self.journal)
        self.lifecycle = Lifecycle(self._ctx, self.queues, self.seqs, self.prefixes, self.restorer, self.blend,
                                   s.chunk_size, self.journal)
        self.policy = Policy(self.queues, self.seqs, self.prefixes, self.lifecycle, s.sched_max_running)
        self.streamer = Streamer(self._ctx, self.ledger, self.lifecycle, self.restorer, self.journal, boundary_step)
        self._boundary_step = boundary_step
        self._kv_listeners = KVListeners(s.chunk_size)
        self._lock = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="kvbridge-scheduler", daemon=True)
        self._thread.start()

    def _open_context(self, exact_on: bool) -> None:
        """The llama.cpp context (non-unified in exact mode), its block ledger and its sequence ids."""
        s = self.settings
        self.exact = exact_on
        self._ctx = LlamaContext(s, s.sched_kv_cells, s.sched_max_running + s.sched_cached_prefixes + 1, exact=exact_on)
        self.ledger = BlockLedger(self._ctx.n_cells, s.sched_block_tokens, s.sched_soft, s.sched_hard, s.sched_critical)
        self.seqs = SequencePool(self._ctx, self.ledger)

    def _decide_layout(self, traits):
        """The KV layout of this model and cache type, proven on a tiny real state in a free sequence
        (kvbridge.engine.layout, as CachedEngine learns it); a model whose layout KVBridge refuses cannot
        be scheduled."""
        # the scheduler captures a recurrent model's state where each chunk ends, as the in-process engine does
        layout = decide_layout(traits, lambda: probe_state_on_sequence(self._ctx, self.seqs.free[0], PROBE_TEXT),
                               captures_recurrent=True)
        if layout.refusal:
            self._refuse(f"The scheduler cannot run {self._ctx.model_path.name}: {layout.refusal.split(';')[0]}.")
        return layout

    def _refuse(self, why: str) -> None:
        """Give back what start-up took so far (the context, a store of its own) and refuse to run: `why`."""
        self._ctx.close()
        if self._own_store:
            self.store.close()
        raise EngineUnavailable(why)

    # -- the public API -------------------------------------------------------------------------------
    def __enter__(self) -> "Scheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, prompt: str | Sequence[Message], *, priority: int = 5, n_predict: int | None = None,
               temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, stop: Sequence[str] = (),
               on_token: Callable[[str], None] | None = None, label: str = "", cache_salt: str = "",
               blend: bool = False, min_tokens: int = 0, ignore_eos: bool = False,
               store_before_answer: bool = False) -> Future:
        """Queue a request; its Future gives a RequestRecord. Raises QueueFull when too many wait;
        a request that cannot run (too long, a bad priority) fails on its Future, the others go on.

        blend: reuse stored passages wherever they stand (kvbridge.blend; the prompt cut by
        KVB_BLEND_SEPARATOR). The placement runs at admission on the loop's thread, the question's
        prefill and the generation in the shared batches; passages not stored yet are stored after
        the answer. A prompt without passages runs as usual and its record says so.

        cache_salt (a tenant, as vLLM's `cache_salt`): the request shares resident cells only with
        requests of the same salt, and its stored KV lives under keys seeded by it, so a prompt another
        salt cached is a cold prefill here (no timing tells one tenant what another asked).

        min_tokens: no end-of-generation token is sampled and no stop string counts before this many
        tokens were generated (vLLM's meaning; capped by n_predict). ignore_eos: no end-of-generation
        token is ever sampled, so it runs to n_predict unless a stop string stops it.

        store_before_answer (a prefill instance handing its prompt to a decode instance through a shared
        store): the Future resolves only once the prompt's KV is in the store, every whole chunk and the
        tail, never skipped for a full write queue; record.stored_tokens then says how many leading prompt
        tokens the store held (a lookup after the write)."""
        future: Future = Future()
        if not isinstance(cache_salt, str) or len(cache_salt) > 256:
            future.set_exception(RequestRefused("cache_salt must be a string of at most 256 characters"))
            return future
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            future.set_exception(RequestRefused(f"min_tokens must be an integer of at least 0, got {min_tokens!r}"))
            return future
        with self._lock:
            if self._closing:
                raise RequestRefused("the scheduler is closed")
            check_queue(len(self.queues.waiting), self.settings)
            request_id = next(self._ids)
        try:
            # only a blend request is cut at the separator: any other prompt reaches the model as sent
            tokens = self._prompt_tokens(prompt, cut=True) if blend else self._prompt_tokens(prompt)
            segments = getattr(tokens, "segments", ())
            check_request(self.settings, self._ctx.n_cells, tokens, priority, n_predict)
            if blend and len(segments) >= 3 and not self.exact:
                self.blend.runner_for(cache_salt)   # a model that cannot blend is refused here, on this request
        except (RequestRefused, ValueError, TypeError, KVBridgeError) as exc:
            future.set_exception(exc if isinstance(exc, RequestRefused) else RequestRefused(str(exc)))
            return future
        n_predict = self.settings.n_predict if n_predict is None else int(n_predict)
        blending = bool(blend) and len(segments) >= 3 and not self.exact
        record = RequestRecord(mode="blend" if blending else "lmcache", engine="llamacpp-scheduler", kv_mode="full",
                               label=label, request_index=request_id, prompt_tokens=len(tokens), priority=priority)
        if blend and self.exact:
            record.add_note("blend: off in exact mode (KVB_SCHED_EXACT=true, the default); the prompt was computed "
                            "exactly. KVB_SCHED_EXACT=false (serve --no-exact) lets blend run")
        elif blend and not blending:
            record.add_note(no_passages_note(self.settings.blend_separator))
        request = Request(request_id, label or f"request {request_id}", int(priority), tokens, n_predict,
                          Sampler(temperature, top_p, seed), tuple(stop), on_token, future, record, salt=cache_salt,
                          segments=segments, blend=blending, min_tokens=min(min_tokens, n_predict),
                          ignore_eos=bool(ignore_eos), store_before_answer=bool(store_before_answer))
        future.record = record   # live: tier and matched_tokens are set at admission (a server's headers read them)
        with self._lock:
            # checked again where the request joins the queue: submits from several threads all passed
            # the first check while their prompts were tokenized, and each appended (no limit at all)
            check_queue(len(self.queues.waiting), self.settings)
            self.queues.waiting.append(request)
            self._lock.notify_all()
        return future

    def tokens_of(self, prompt: str | Sequence[Message]) -> list[int]:
        """The exact token ids submit() prefills for this prompt (a string, or chat messages rendered with
        the model's template), never cut at the blend separator. Any thread (submit tokenizes on its caller's)."""
        if self._closing:
            raise RequestRefused("the scheduler is closed")
        return list(self._prompt_tokens(prompt))

    def unsalted_hashes(self, tokens: Sequence[int]) -> list[bytes]:
        """The chunk hashes (one per whole chunk) unsalted prompts are stored under (cache salt "")."""
        return self.swap.hashes(tokens)

    def stored_media(self, hashes: Sequence[bytes]) -> list[str | None]:
        """Where the store holds each unsalted chunk hash now: "CPU" (L1 in RAM, or the cache server's L1
        in shared memory), "DISK" (L2, L3) or None (gone, or a store fault: its counted miss). Any thread;
        bounded: no lookup starts after KVB_KV_EVENTS_CHECK_S, and each is bounded by its store
        (KVB_CACHE_SERVER_TIMEOUT, KVB_L3_TIMEOUT)."""
        return self.swap.media(hashes, deadline_s=max(0.1, self.settings.kv_events_check_s))

    def add_kv_listener(self, listener) -> None:
        """Tell `listener` what unsalted exact KV is resident (`resident(runs)`, after the steps that changed
        it, [] at close) and stored (`stored(tokens, n_chunks)`, after each write): kvbridge.scheduler.kv_listeners."""
        self._kv_listeners.add(listener)
        self.swap.on_stored = self._kv_listeners.stored

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
            view = events.snapshot(self.settings, self.ledger, self.queues, self.prefixes, self.seqs.free, self.journal)
        view["exact"] = {"on": self.exact, "off_reason": self.exact_off_reason,
                         "cut_rule": self.cut_rule.describe() if self.exact else ""}
        return view

    def events(self) -> list[dict]:
        with self._lock:
            return self.journal.events()

    def bytes_held(self) -> dict[str, dict[str, int]] | None:
        """{cache salt: {tier: bytes}} the store holds under each salt this scheduler has used (in exact mode the
        salt "" shares its namespace with CachedEngine's); None when the store cannot tell (a cache server's
        objects are counted there). Reads the store's indexes, not the scheduler's lock."""
        by_namespace = getattr(self.store, "bytes_by_namespace", None)
        if by_namespace is None:
            return None
        held = by_namespace()
        return {salt: dict(held.get(sequences.kv.namespace, {})) for salt, sequences in self._swaps.items()}

    def drain(self, timeout_s: float = 300.0) -> bool:
        """Wait until every submitted request finished and the prompts' stores are done."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self.queues.busy():
                if not self._lock.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() > deadline:
                    return False
        self._store_shared.writer.drain(max(1.0, deadline - time.monotonic()))
        return True

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._lock.notify_all()
        self._thread.join(timeout=60)
        for request in self.queues.everyone():
            self.lifecycle.fail(request, RequestRefused("the scheduler was closed before this request finished"))
        self._kv_listeners.close()
        self._swaps.close()
        self._store_shared.close()
        for request in list(self.restorer.awaiting_store.values()):   # writes the closed writer dropped
            self.lifecycle.fail(request, RequestRefused("the scheduler was closed before this prompt was stored"))
        self.blend.close()
        self._ctx.close()
        if self._own_store:
            self.store.close()

    def _prompt_tokens(self, prompt, cut: bool = False) -> list[int]:
        return prompt_tokens(self._ctx, self.settings.blend_separator, prompt, cut)

    def _detokenize(self, tokens) -> str:
        """Text of token ids, for a miss's excerpt (the loop's thread: llama.cpp's tokenizer is not shared)."""
        return b"".join(self._ctx.piece(int(t)) for t in tokens).decode("utf-8", "replace")

    def _swap_for(self, salt: str) -> SequenceStore:
        """The SequenceStore of a cache salt: its namespace (so its hash seed, so every key) has the salt's
        digest in it. The salt itself never appears in a namespace, a key or a status. Called on the
        loop's thread, where the queues it reads are its own."""
        return self._swaps.get(salt, self.queues.salts_in_use)

    # -- the loop -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closing and not self.queues.busy():
                    self._lock.wait()
                if self._closing:
                    return
            try:
                self._step()
            except Exception as exc:   # counted, logged, and on the futures of the requests it involved
                log.exception("a scheduler step failed")
                with self._lock:
                    self.lifecycle.fail_step(exc)
                    self._lock.notify_all()
            # the queues are changed on this thread only: read without the lock
            self._kv_listeners.after_step(self.queues.running, self.prefixes.prefixes)

    def _step(self) -> None:
        with self._lock:
            self.lifecycle.drop_cancelled()
            self.policy.relieve_pressure()
            self.policy.resume_swapped()
            self.policy.admit_waiting()
            if self.exact:
                calls = exact.plan_exact(self.queues.running, self.decode_width)
            else:
                calls = [plan_batch(self.queues.running, self._boundary_step)]
        calls = calls or [[]]   # nothing to run: the empty batch waits for a submit
        for batch in calls:
            if not self._run_batch(batch):
                return

    def _run_batch(self, batch) -> bool:
        """One llama_decode of the batch and what comes out of it; False when the step must end here (nothing
        to run, or no room: the pressure relieved, the next step plans again)."""
        if not batch:   # nothing can run now: wait for a submit, a cancel or a finished store
            with self._lock:
                self._lock.wait(0.02)
            return False
        entries = [entry for _, feed in batch for entry in feed]
        with self.lifecycle.working_on(*(request for request, _ in batch)):
            rc = self._ctx.decode(entries)
            with self._lock:
                if rc != 0:
                    if not (self.exact and self.lifecycle.end_full_streams(batch, self._ctx.stream_cells)):
                        self.policy.no_room(rc)
                    return False
                self.streamer.after_decode(batch)
                self._lock.notify_all()
        return True
