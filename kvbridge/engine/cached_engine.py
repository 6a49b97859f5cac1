"""CachedEngine: the one place that runs the whole flow and records what it cost.

prompt -> tokens -> chunk hashes -> lookup (L1, L2) -> restore -> prefill only the suffix ->
generate -> store new chunks and the tail (after generation, off the TTFT path).

Each request runs in a mode asked of the registry in kvbridge.engine.modes, as in LMCache-style testbeds:
- cold:    the engine's own cache is dropped before every request; full prefill; the baseline.
- native:  the engine's own in-context prefix reuse only (what a user has today).
- lmcache: the engine's own cache is dropped first (eviction by another session, or a restart);
           full engines restore the longest stored prefix from our store, shadow engines index the
           prompt and predict the reuse, next to the engine's own cached-token count.
These three exact prefix modes run here (run_exact_prefix); other modes plug in from above (blend:
kvbridge.blend.mode) and keep what they need per engine through mode_runner().
The backend's `kv_mode` is checked here and nowhere else.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from kvbridge.backends.base import Backend, EngineReport, Message, Prompt
from kvbridge.settings import Settings
from kvbridge.errors import EmptyPrompt, KVBridgeError, StateTransferError
from kvbridge.engine.segments import tokenize_segments
from kvbridge.engine.hashing import make_hasher
from kvbridge.engine import cut_verdicts
from kvbridge.engine.cold_cut import DEFAULT_RULE, CutRule
from kvbridge.engine.chunks import ChunkKV, ForeignState
from kvbridge.engine.shadow_index import ShadowIndex
from kvbridge.formats.architectures import ModelTraits
from kvbridge.formats.llama_state import KVGeometry, LayoutError
from kvbridge.store.serde import remember_geometry
from kvbridge.engine.metrics import (HIT_TOKENS_PREFIX, MISS_REASON_PREFIX, MISS_TOKENS_PREFIX, PROMPT_TOKENS,
                                     Metrics)
from kvbridge.engine.misses import MissExplainer, parse_hit_tiers
from kvbridge.engine.layout import decide_layout
from kvbridge.engine.namespace import namespace_for, short_namespace
from kvbridge.engine.modes import ModeRequest, ModeSpec, mode_spec
from kvbridge.engine.records import RequestRecord
from kvbridge.engine.stages import StageTimer, record_stages
from kvbridge.store import TieredStore, open_store
from kvbridge.store.objects import StoreFault

log = logging.getLogger(__name__)
# The probe learns the KV layout and warms the engine up: the first large prefill after a start is
# several times slower (buffers are allocated), which would otherwise inflate the first cold request.
PROBE_TEXT = " ".join(["KV layout probe and warm-up."] * 24)


class CachedEngine:
    def __init__(self, settings: Settings, backend: Backend, store: TieredStore | None = None,
                 metrics: Metrics | None = None):
        self.settings = settings
        self.backend = backend
        self.store = store if store is not None else open_store(settings)
        self.metrics = metrics if metrics is not None else Metrics()
        self.namespace = ""
        self.geometry: KVGeometry | None = None
        self.traits: ModelTraits | None = None
        self.kv_refusal = ""   # set: the model's KV layout is not one KVBridge can restore exactly; runs uncached
        self.hasher = None
        self._kv: ChunkKV | None = None
        self._index: ShadowIndex | None = None
        self._boundary_step = 0   # recurrent models: the engine captures its state every chunk in lmcache mode
        self._mode_runners: dict[str, object] = {}   # what a mode keeps per engine (blend: its runner), by mode
        self._lock = threading.RLock()   # one request at a time per engine
        self.started = False

    # lifecycle -----------------------------------------------------------------------------
    def start(self) -> "CachedEngine":
        with self._lock:
            if not self.started:
                self.backend.start()
                self._open_namespace()
                self.started = True
        return self

    def stop(self) -> None:
        with self._lock:
            if self.started:
                self.backend.stop()
                self.started = False
            self.store.flush()

    def close(self) -> None:
        self.stop()
        if self._kv is not None:
            self._kv.close()
        for runner in self._mode_runners.values():
            runner.close()
        self._mode_runners.clear()
        self.store.close()

    def __enter__(self) -> "CachedEngine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def restart_backend(self, drop_l1: bool = False) -> None:
        """Drop the engine's context or process (as a restart would); the store is kept.

        drop_l1=True also empties L1, as a process restart would, so the next request restores from L2.
        """
        with self._lock:
            self.backend.restart()
            if drop_l1 and not getattr(self.store, "shared", False):   # a cache server's L1 outlives engines
                self.store.clear("L1")
            self.metrics.inc("engine_restarts")

    def reset_native_cache(self) -> None:
        """Drop the engine's own prefix cache (each scenario mode starts from it empty)."""
        with self._lock:
            if self.started:
                self.backend.reset_native_cache()

    def _open_namespace(self) -> None:
        kv_layout = None
        if self.backend.kv_mode == "full":
            # what the model is decides which layout is expected (kvbridge.engine.layout); whole snapshots remain
            # only for a plain model on a llama-server whose slot files are not on this machine
            self.traits = self.backend.model_traits()
            decision = decide_layout(self.traits, self._probe_state, by_reference=self.backend.kv_by_reference,
                                     captures_recurrent=self.backend.captures_recurrent)
            self.geometry, self.kv_refusal = decision.geometry, decision.refusal
            # a recurrent state is kept where each chunk ends while the engine prefills (Backend.boundary_state)
            self._boundary_step = self.settings.chunk_size if self.geometry and self.geometry.recurrent else 0
            kv_layout = decision.namespace_key
            if self.geometry is not None:
                remember_geometry(self.geometry)   # the int8 codec finds a chunk's K and V rows by it
        self.kv_layout_key = kv_layout   # the layout's key in the namespace (serve's scheduler tags it in the mode off)
        fingerprint = self.backend.kv_fingerprint()
        self.namespace = namespace_for(self.settings, fingerprint=fingerprint,
                                       model_path=self.backend.model_file(), kv_layout=kv_layout, store=self.store)
        self.hasher = make_hasher(self.settings.chunk_size, self.namespace, self.settings.prefer_lmcache_hasher)
        seed = getattr(self.hasher, "seed", b"")
        if self.backend.kv_mode == "full" and not self.kv_refusal:
            self._kv = ChunkKV(self.store, self.namespace, seed, self.settings.chunk_size, self.geometry)
            self._kv.prefault_scratch = not self.backend.assembles_in_place
            self._kv.cold_cut = True   # the engine prefills what a restore leaves as its cold run did
            self._kv.cut_rule = cut_verdicts.rule_for(self.settings, self.backend.model_file(), fingerprint)
            if self.settings.explain_misses:
                self._kv.misses.learn_namespaces()
        elif self.backend.kv_mode != "full":
            self._index = ShadowIndex(self.store, self.namespace, seed, self.settings.chunk_size)

    def _probe_state(self):
        """A tiny real state of the engine (the probe also warms it up); the engine's cache is dropped after."""
        # at most half the context, so the smallest context the settings allow still starts
        tokens = self.backend.tokenize(PROBE_TEXT)[: max(2, self.settings.ctx_size // 2)]
        prompt = Prompt(text=PROBE_TEXT, tokens=tuple(tokens))
        report = EngineReport()
        for _ in self.backend.generate(prompt, n_predict=1, temperature=0.0, use_native_cache=False, report=report):
            pass
        try:
            return self.backend.save_state().data
        finally:
            self.backend.reset_native_cache()

    @property
    def cut_rule(self) -> CutRule:
        """Where this engine's restores end (kvbridge.engine.cold_cut): the cut probe's verdict for its model,
        build and CPU, or the fixed grid of 8 where none was proven (and before the engine has started)."""
        return self._kv.cut_rule if self._kv is not None else DEFAULT_RULE

    # status --------------------------------------------------------------------------------
    def status(self) -> dict:
        spec_label = self.backend.key
        try:
            from kvbridge.backends.registry import resolve_engine

            spec_label = resolve_engine(self.backend.key).label
        except KVBridgeError:
            pass
        return {
            "engine": self.backend.key,
            "label": spec_label,
            "location": self.backend.describe(),
            "kv_mode": self.backend.kv_mode,
            "namespace": self.namespace,
            "namespace_short": short_namespace(self.namespace) if self.namespace else "",
            "kv_layout": self._layout_summary(),
            "model": self.traits.summary() if self.traits else "",
            "kv_refusal": self.kv_refusal,
            "cut_rule": self.cut_rule.describe() if self._kv is not None else "",
            "started": self.started,
            "store": self.store.stats(),
            "metrics": self.metrics.snapshot(),
        }

    def _layout_summary(self) -> str:
        if self.backend.kv_mode != "full":
            return "none (shadow)"
        if self.kv_refusal:
            return "refused: uncached"
        return self.geometry.summary() if self.geometry else "whole snapshots"

    # requests ------------------------------------------------------------------------------
    def prepare(self, prompt: str | Sequence[Message]) -> Prompt:
        """Text or chat messages -> the rendered text and its token ids."""
        if isinstance(prompt, str):
            text, messages = prompt, None
        else:
            messages = tuple(dict(m) for m in prompt)
            text = self.backend.render(messages)
        approx = bool(getattr(self.backend, "approx_tokens", False))
        # a prompt cut by the blend separator is tokenized segment by segment in every mode, so cold,
        # lmcache and blend run the same ids (kvbridge.engine.segments); the separator never reaches the model
        segmented = tokenize_segments(text, self.settings.blend_separator, self.backend.tokenize)
        if segmented is not None:
            return Prompt(text=segmented.text, tokens=segmented.tokens, messages=messages, approx_tokens=approx,
                          segments=segmented.starts)
        tokens = self.backend.tokenize(text)
        return Prompt(text=text, tokens=tuple(tokens), messages=messages, approx_tokens=approx)

    def infer(self, prompt: str | Sequence[Message], mode: str = "lmcache", n_predict: int | None = None,
              temperature: float = 0.0, *, scenario: str = "", label: str = "", request_index: int = 0,
              on_text: Callable[[str], None] | None = None) -> RequestRecord:
        """Run one request in `mode`; errors the user must act on end up in record.error, never raised."""
        spec = mode_spec(mode)
        n_predict = self.settings.n_predict if n_predict is None else n_predict
        record = RequestRecord(mode=mode, engine=self.backend.key, kv_mode=self.backend.kv_mode,
                               scenario=scenario, label=label, request_index=request_index)
        with self._lock:
            if not self.started:
                self.start()
            t0 = time.perf_counter()
            try:
                with self.store.quiet():   # the store's writes behind earlier requests wait until this one is answered
                    self._run(prompt, spec, n_predict, temperature, record, t0, on_text)
            except KVBridgeError as exc:
                record.error = str(exc)
                self.metrics.inc("errors")
            record.total_ms = (time.perf_counter() - t0) * 1000
        self._record_metrics(record)
        return record

    def _run(self, prompt, spec: ModeSpec, n_predict, temperature, record: RequestRecord, t0: float, on_text) -> None:
        said = prompt.strip() if isinstance(prompt, str) else any(str(m.get("content") or "").strip() for m in prompt)
        if not said:
            raise EmptyPrompt("The prompt is empty: type a question or pick a scenario; there is nothing to answer.")
        timer = StageTimer()
        with timer.stage("tokenize"):
            p = self.prepare(prompt)
        tokens = list(p.tokens)
        record.prompt_tokens = len(tokens)
        if not tokens:
            raise EmptyPrompt("The prompt has no tokens for this engine's tokenizer; there is nothing to answer.")
        record.approx = p.approx_tokens
        if p.approx_tokens:
            record.add_note("approx: token figures from an approximate tokenizer")
        spec.run(self, ModeRequest(p, n_predict, temperature, record, t0, timer, on_text))

    def mode_runner(self, mode: str):
        """What `mode` keeps on this engine (blend: its BlendRunner, a second llama.cpp context), made on first
        use by the mode (which may refuse, with a message for a person) and closed with the engine."""
        with self._lock:
            if mode not in self._mode_runners:
                spec = mode_spec(mode)
                if spec.make_runner is None:
                    raise ValueError(f"mode {mode!r} keeps nothing per engine")
                self._mode_runners[mode] = spec.make_runner(self)
            return self._mode_runners[mode]

    def _blend_runner(self):
        """The blend mode's runner on this engine (the blend tests and bench reach it by this name)."""
        return self.mode_runner("blend")

    def run_exact_prefix(self, request: ModeRequest) -> None:
        """The exact prefix modes (cold, native, lmcache; record.mode says which): restore the longest stored
        prefix where the mode asks it, prefill the rest, generate, store after the answer."""
        p, record, timer, t0 = request.prompt, request.record, request.timer, request.t0
        mode, tokens = record.mode, list(p.tokens)
        with timer.stage("hash"):
            hashes = self.hasher.chunk_hashes(tokens)
        record.chunks_total = len(hashes)
        full = self.backend.kv_mode == "full"
        restored = 0
        # lmcache on a full engine models eviction: the engine's own cache is gone and ours restores
        # (a restore replaces whatever the context held, so only a miss needs the explicit drop).
        # A shadow engine keeps its cache, since its cached-token count is the ground truth we predict.
        if mode == "cold":
            MissExplainer.fixed("cold", "", hit_tiers={}).apply(record)
            with timer.stage("reset"):
                self.backend.reset_native_cache()
        elif mode == "lmcache" and full and self.kv_refusal:
            record.add_note(f"KV caching refused: {self.kv_refusal}")
            MissExplainer.fixed("refused", f"the architecture is refused: {self.kv_refusal}").apply(record)
            self.metrics.inc("kv_refused")
            with timer.stage("reset"):
                self.backend.reset_native_cache()
        elif mode == "lmcache" and full:
            restored = self._restore(tokens, hashes, record, timer)
            if not restored:
                with timer.stage("reset"):
                    self.backend.reset_native_cache()
        elif mode == "lmcache":
            with timer.stage("lookup"):
                record.chunks_hit, record.predicted_reuse_tokens, record.tier = self._index.predict(tokens, hashes)
            record.matched_tokens = record.predicted_reuse_tokens
            self._explain(tokens, hashes, self._index_plan(record), record)
        report = EngineReport()
        pieces: list[str] = []
        first = True
        # only a request whose prompt is stored afterwards pays for the recurrent captures
        self.backend.boundary_step = self._boundary_step if mode == "lmcache" else 0
        engine_started = time.perf_counter()
        for piece in self.backend.generate(p, n_predict=request.n_predict, temperature=request.temperature,
                                           use_native_cache=(mode != "cold"), report=report):
            if first:
                record.ttft_ms = (time.perf_counter() - t0) * 1000
                engine_ms = (time.perf_counter() - engine_started) * 1000
                first = False
            pieces.append(piece)
            if request.on_text is not None and piece:
                request.on_text(piece)
        if first:   # nothing generated: TTFT is when the engine finished
            record.ttft_ms = (time.perf_counter() - t0) * 1000
            engine_ms = (time.perf_counter() - engine_started) * 1000
        record_stages(record, timer, report, engine_ms)
        record.text = "".join(pieces)
        record.gen_tokens = report.completion_tokens if report.completion_tokens is not None else len(pieces)
        record.engine_cached_tokens = report.engine_cached_tokens
        if report.engine_prefill_tokens is not None:
            record.prefill_tokens = report.engine_prefill_tokens
        else:
            record.prefill_tokens = len(tokens) - (report.engine_cached_tokens or 0)
        for note in report.notes:
            record.add_note(note)
        if mode == "native":
            reused = report.engine_cached_tokens or 0
            if reused < len(tokens) - 1:
                MissExplainer.fixed("none_stored", f"native mode: the engine's own cache held {reused} of this prompt's "
                                    f"{len(tokens)} tokens; KVBridge's store is not read in this mode",
                                    at_token=reused, hit_tiers={"engine": reused}).apply(record)
        if restored and report.engine_cached_tokens is not None and report.engine_cached_tokens < restored - 1:
            record.restore_ok = False
            record.add_note(f"restore ineffective: engine reused {report.engine_cached_tokens} of {restored} restored tokens")
            self.metrics.inc("restore_ineffective")
        if mode == "lmcache" and not (full and self.kv_refusal):
            self._store_after(tokens, hashes, record)

    def _restore(self, tokens: list[int], hashes: list[bytes], record: RequestRecord, timer: StageTimer) -> int:
        """Find and confirm the stored prefix (lookup, fetch), assemble it and hand it to the engine."""
        try:
            plan = self._kv.find_prefix(tokens, hashes, timer=timer)
        except (LayoutError, StoreFault) as exc:   # storage faults degrade to a miss
            log.warning("lookup failed, recomputing: %s", exc, exc_info=True)
            record.add_note(f"lookup failed ({exc}); recomputed")
            self.metrics.inc("lookup_failed")
            self._explain(tokens, hashes, None, record, fault=f"lookup failed: {exc}")
            return 0
        record.store_calls = plan.store_calls   # before the explainer adds the round trips its probe sent
        self._explain(tokens, hashes, plan, record)
        for note in plan.notes:
            record.add_note(note)
        record.fetch_bytes = sum(plan.fetched.values())
        record.fetch_tiers = " ".join(f"{tier}={size}" for tier, size in plan.fetched.items())
        if not plan.matched_tokens:
            plan.release()
            return 0
        try:
            with timer.stage("handoff"):   # loading the previous restore file again is the whole handoff
                reused = self.backend.reuse_last_restore(plan.tokens)
            if reused:
                plan.release()
                record.add_note("restore file reused: the engine's restore file already held this prefix, loaded again without rebuilding it")
            else:
                with timer.stage("assemble"):
                    state = self._kv.assemble(plan, buffer_for=self.backend.state_buffer)
                if plan.hot:
                    self.metrics.inc("hot_restores")   # the state was assembled already: one copy, not two
                with timer.stage("handoff"):
                    self.backend.restore_state(state, plan.tokens)
        except (LayoutError, StoreFault, StateTransferError) as exc:
            log.warning("restore failed, recomputing the prompt: %s", exc)
            record.add_note(f"restore failed ({exc}); recomputed")
            self._restore_failed(record, exc)
            record.restore_ok = False
            self.metrics.inc("restore_failed")
            with timer.stage("reset"):
                self.backend.reset_native_cache()
            return 0
        finally:
            plan.release()
        with timer.stage("handoff"):
            held = self.backend.held_tokens()
        expected = len(plan.tokens)
        if held is not None and held != expected:
            # The engine's own account of its context disagrees with what we restored: never generate on it.
            log.warning("restore ineffective: the engine holds %d positions, %d were restored", held, expected)
            record.add_note(f"restore ineffective: the engine holds {held} positions after restoring {expected} tokens; recomputed")
            MissExplainer.fixed("refused", f"the engine refused the restored state: it holds {held} positions after "
                                f"restoring {expected} tokens; recomputed").apply(record)
            record.restore_ok = False
            self.metrics.inc("restore_ineffective")
            with timer.stage("reset"):
                self.backend.reset_native_cache()
            return 0
        record.restore_ok = True
        record.chunks_hit = plan.chunks_hit
        record.matched_tokens = plan.matched_tokens
        record.tier = plan.tier
        return plan.matched_tokens

    def _explain(self, tokens: list[int], hashes: list[bytes], plan, record: RequestRecord, fault: str = "") -> None:
        """Name the cause of the tokens `plan` does not cover (kvbridge.engine.misses): free on a hit, one store
        call on a miss; KVB_EXPLAIN_MISSES=false keeps the store call out (the cause is then found from the plan)."""
        explainer = self._kv.misses if self._kv is not None else self._index.misses
        explainer.detokenize = self.backend.detokenize
        report = explainer.explain(tokens, hashes, plan, fault=fault, probe=self.settings.explain_misses)
        report.apply(record)
        if report.round_trips:
            record.store_calls += report.round_trips

    @staticmethod
    def _restore_failed(record: RequestRecord, exc: Exception) -> None:
        """A restore that was planned and then failed: the whole prompt is recomputed, for this cause."""
        if isinstance(exc, StoreFault):
            why = "lease_busy" if "lease" in str(exc) else "tier_down"
            MissExplainer.fixed(why, f"the restore read a stored object that failed ({exc}); recomputed").apply(record)
        else:
            MissExplainer.fixed("refused", f"the engine or the layout refused the restored state ({exc}); "
                                "recomputed").apply(record)

    @staticmethod
    def _index_plan(record: RequestRecord):
        """A shadow engine's prediction as a plan the explainer reads."""
        from kvbridge.engine.restore_plan import RestorePlan

        plan = RestorePlan(matched_tokens=record.matched_tokens or 0, chunks_hit=record.chunks_hit)
        plan.add_tokens(record.tier, plan.matched_tokens)
        return plan

    def _store_after(self, tokens: list[int], hashes: list[bytes], record: RequestRecord) -> None:
        """After generation: keep the prompt's cells as chunk and tail objects (full) or index it (shadow)."""
        t = time.perf_counter()
        try:
            if self.backend.kv_mode == "full":
                before = self._kv.incomplete
                record.stored_objects = self._kv.store_prompt(self.backend.save_state(), tokens, hashes,
                                                              capture=self.backend.capture_window,
                                                              boundary=self.backend.boundary_state)
                if self._kv.incomplete > before:
                    what = "recurrent state at their end" if self.geometry.recurrent else "sliding-window rows"
                    record.add_note(f"{self._kv.incomplete - before} object(s) not stored: the engine no longer held "
                                    f"their {what}")
                    self.metrics.inc("store_window_incomplete", self._kv.incomplete - before)
            else:
                record.stored_objects = self._index.record(tokens, hashes)
        except ForeignState as exc:
            log.warning("not storing KV: %s", exc)
            record.add_note(f"nothing stored: {exc} (another client may have used the engine in between)")
            self.metrics.inc("store_skipped_foreign_state")
        except (LayoutError, StoreFault, StateTransferError) as exc:
            log.warning("storing KV failed (the answer is unaffected): %s", exc)
            record.add_note(f"store failed ({exc})")
            self.metrics.inc("store_failed")
        record.store_ms = (time.perf_counter() - t) * 1000

    def _record_metrics(self, r: RequestRecord) -> None:
        """Metrics are recorded here and nowhere else."""
        m = self.metrics
        for name, count in self.backend.take_counters().items():
            m.inc(name, count)
        # objects read from writes not landed yet, waits for them and their ms (kvbridge.store.tiered_inflight);
        # a cache server's store has no write-behind queue of this process, so nothing to take
        for name, count in getattr(self.store, "take_inflight", dict)().items():
            m.inc(name, count)
        m.inc(f"requests_{r.mode}")
        if r.error:
            return
        m.record(f"ttft_ms_{r.mode}", r.ttft_ms)
        hit_tiers = parse_hit_tiers(r.hit_tiers)
        if r.miss_reason:   # what the request computed instead of restoring, by cause (any mode: cold is "cold")
            m.inc(f"{MISS_REASON_PREFIX}{r.miss_reason}")
            m.inc(f"{MISS_TOKENS_PREFIX}{r.miss_reason}", max(0, r.prompt_tokens - sum(hit_tiers.values())))
        if r.mode == "lmcache":
            m.inc(PROMPT_TOKENS, r.prompt_tokens)   # tier_hit_rates(): restored tokens by tier over these
            for tier, n in hit_tiers.items():
                m.inc(f"{HIT_TOKENS_PREFIX}{tier}", n)
            m.inc(f"hits_{r.tier}" if r.matched_tokens else "misses")
            m.record("lookup_ms", r.lookup_ms)
            if r.restore_ms:
                m.record("restore_ms", r.restore_ms)
            m.record("store_ms", r.store_ms)
