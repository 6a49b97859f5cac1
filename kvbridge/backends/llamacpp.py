"""LlamaCppBackend: llama.cpp in-process through llama-cpp-python, with full KV access.

KV leaves and re-enters through the sequence-level state API (`llama_state_seq_get_data` /
`llama_state_seq_set_data` on sequence 0): about 45x faster than `Llama.save_state()`, which copies
the whole context and its logits. After a restore, llama-cpp-python's own token bookkeeping
(`input_ids`, `n_tokens`) is set to the restored tokens, so its prefix matching evaluates only the
suffix.

A recurrent or hybrid model is prefilled chunk by chunk (KVB_CHUNK_SIZE tokens a step, each step in pieces of
BATCH_TOKENS as llama.cpp splits any batch) in every mode, cold included: a chunk's end is then a place where
every run's batch ends, so the recurrent state captured there (lmcache mode) and a restore that ends there leave
the engine the rest of the prompt to compute in the very steps of a cold run, the last token among them
(Docs/Research.md §30). Its state cannot be cut back by position, which is why the cut is a chunk's end.
"""
from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Iterator, Sequence

from kvbridge.settings import Settings
from kvbridge.errors import BadSettings, EngineUnavailable, StateTransferError
from kvbridge.backends.build_check import ensure_llama_cpp_runs
from kvbridge.backends.llama_cpp_model import (cache_type_problems, check_model_file, ggml_type_id,
                                              llama_cpp_fingerprint, model_file_problems, model_path_for)
from kvbridge.backends.base import (BATCH_TOKENS, Backend, EngineReport, Message, Prompt, Sampling, SeqState,
                                    WindowCapture)
from kvbridge.backends.model_traits import traits_of_model
from kvbridge.backends.chat_template import ChatTemplate, template_of_llama
from kvbridge.backends.registry import EngineSpec, register_engine
from kvbridge.backends.text_decoding import Utf8Decoder


class LlamaCppBackend(Backend):
    key = "llamacpp"
    kv_mode = "full"
    captures_recurrent = True

    @classmethod
    def settings_problems(cls, settings: Settings, environ: Mapping[str, str]) -> list[str]:
        return model_file_problems(settings, ollama_model_ok=True) + cache_type_problems(settings)

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.llm = None
        self.model_path: Path | None = None
        self._template: ChatTemplate | None = None
        self._boundaries: dict[int, bytes] = {}   # recurrent state after the last prompt's first n tokens, by n
        self._prefill_step = 0   # a recurrent or hybrid model: prompts are prefilled this many tokens a step
        # an oracle's switch: keep the logits of each prompt's last position (prompt_logits), a vocabulary's floats
        self.keep_prompt_logits = False
        self.prompt_logits = None

    # lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self.llm is not None:
            return
        import llama_cpp  # heavy import: only when an engine really starts

        path = model_path_for(self.settings)
        check_model_file(path)
        # a build that crashes on this CPU must crash in a child process, not in the GUI or the caller's script
        ensure_llama_cpp_runs(path)
        type_k = ggml_type_id(self.settings.cache_type_k, "KVB_CACHE_TYPE_K")
        type_v = ggml_type_id(self.settings.cache_type_v, "KVB_CACHE_TYPE_V")
        # the load is the one long wait of a start (seconds for a large GGUF, cold from disk): say what and how long
        print(f"loading model {path.name} ({path.stat().st_size / 1e6:.1f} MB) into llama.cpp…", file=sys.stderr,
              flush=True)
        load_started = time.perf_counter()
        try:
            self.llm = llama_cpp.Llama(
                model_path=str(path), n_ctx=self.settings.ctx_size, n_threads=self.settings.resolved_threads(),
                n_batch=BATCH_TOKENS, flash_attn=self.settings.flash_attn, type_k=type_k, type_v=type_v, verbose=False,
                # a sliding-window model keeps every cell (llama.cpp's full-size SWA cache), so the window
                # rows of earlier positions can still be captured after the prefill (capture_window)
                swa_full=True)
        except (ValueError, RuntimeError) as exc:
            raise EngineUnavailable(f"llama.cpp could not load {path} (KVB_MODEL_PATH): {exc}") from exc
        print(f"model {path.name} loaded in {time.perf_counter() - load_started:.1f} s", file=sys.stderr, flush=True)
        self.model_path = path
        self._template = None
        traits = self.model_traits()
        self._prefill_step = self.settings.chunk_size if (traits.recurrent or traits.hybrid) else 0
        self._time_evals(self.llm)

    def _time_evals(self, llm) -> None:
        """Llama.generate evaluates the prompt through Llama.eval: timed here, it is the record's prefill
        stage, and the time from its end to the first piece the first-token stage."""
        evaluate = llm.eval
        self._eval_ms, self._eval_end = 0.0, 0.0

        def timed_eval(tokens):
            started = time.perf_counter()
            try:
                return evaluate(tokens)
            finally:
                self._eval_end = time.perf_counter()
                self._eval_ms += (self._eval_end - started) * 1000

        llm.eval = timed_eval

    def stop(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None

    def describe(self) -> str:
        path = self.model_path or model_path_for(self.settings)
        return f"in-process llama.cpp, {path.name}"

    @property
    def _llm(self):
        if self.llm is None:
            raise EngineUnavailable("The llama.cpp engine is not started; connect it first.")
        return self.llm

    # prompts -------------------------------------------------------------------------------
    def render(self, messages: Sequence[Message]) -> str:
        return self._chat_template().render(messages)

    @property
    def has_chat_template(self) -> bool:
        """The model's GGUF carries a chat template (a base model's, Gemma 3 270M's here, does not: chat falls
        back to ChatML, which such a model only continues)."""
        return self._chat_template().has_template

    def _chat_template(self) -> ChatTemplate:
        if self._template is None:
            self._template = template_of_llama(self._llm, self.counters, (self.model_path or Path("model")).name)
        return self._template

    def tokenize(self, text: str) -> list[int]:
        return self._llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._llm.detokenize(list(tokens)).decode("utf-8", errors="replace")

    # generation ----------------------------------------------------------------------------
    def generate(self, prompt: Prompt, *, n_predict: int, temperature: float, use_native_cache: bool,
                 report: EngineReport) -> Iterator[str]:
        import llama_cpp

        llm = self._llm
        tokens = list(prompt.tokens)
        if len(tokens) + n_predict > llm.n_ctx():
            raise BadSettings(f"The prompt ({len(tokens)} tokens) plus {n_predict} new tokens does not fit "
                              f"the context of {llm.n_ctx()} tokens (KVB_CTX_SIZE).")
        if not use_native_cache:
            self.reset_native_cache()
        self._boundaries.clear()
        self.prompt_logits = None
        stepped = self._prefill_step > 0
        cached = self._extendable_prefix(tokens) if stepped else self._reusable_prefix(tokens)
        report.engine_cached_tokens = cached
        report.engine_prefill_tokens = len(tokens) - cached
        report.prompt_tokens = len(tokens)
        vocab = llm._model.vocab
        decoder = Utf8Decoder()
        produced = 0
        sampling = Sampling.for_temperature(temperature)
        self._eval_ms = 0.0
        if stepped:
            # the whole prompt is evaluated here, in steps that end where chunks end; Llama.generate then finds
            # it cached and samples at once (it could not cut a recurrent state back to re-evaluate a token)
            self._prefill_by_chunks(tokens, cached)
        for token in llm.generate(tokens, temp=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                  min_p=sampling.min_p, repeat_penalty=sampling.repeat_penalty, reset=True):
            if report.prefill_ms is None:
                report.prefill_ms = self._eval_ms
                if self.keep_prompt_logits:   # the first token is sampled, not yet evaluated: these are the prompt's
                    self.prompt_logits = self._last_logits()
            if llama_cpp.llama_vocab_is_eog(vocab, token):
                break
            produced += 1
            piece = decoder.feed(llm.detokenize([token], special=False))
            if report.first_token_ms is None:
                report.first_token_ms = (time.perf_counter() - self._eval_end) * 1000
            yield piece
            if produced >= n_predict:
                break
        tail = decoder.flush()
        if tail:
            yield tail
        report.completion_tokens = produced

    def _reusable_prefix(self, tokens: list[int]) -> int:
        """How many prompt tokens llama-cpp-python's prefix matching will keep (mirrors Llama.generate)."""
        llm = self._llm
        n = 0
        for a, b in zip(llm._input_ids, tokens):
            if a != b:
                break
            n += 1
        return min(n, len(tokens) - 1)

    def _extendable_prefix(self, tokens: list[int]) -> int:
        """Recurrent state cannot be cut back: the context is kept only when the prompt continues all of it
        (after a restore, or a previous prompt) by at least one token; otherwise it is dropped."""
        llm = self._llm
        held = llm.n_tokens
        if 0 < held < len(tokens) and [int(t) for t in llm.input_ids[:held]] == tokens[:held]:
            return held
        self.reset_native_cache()
        return 0

    def _prefill_by_chunks(self, tokens: list[int], start: int) -> None:
        """Evaluate tokens[start:] in steps ending at each multiple of the chunk size and at the prompt's end, as
        every run of this model does (cold included); in lmcache mode (boundary_step) the recurrent state is kept
        (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) after each step that ends on a chunk's end (boundary_state)."""
        import llama_cpp

        llm, step, n = self._llm, self._prefill_step, len(tokens)
        ends = [*range((start // step + 1) * step, n, step), n]
        ctx = llm._ctx.ctx
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        keep = self.boundary_step > 0

        def capture(at: int) -> None:
            started = time.perf_counter()
            size = llama_cpp.llama_state_seq_get_size_ext(ctx, 0, flags)
            buf = (ctypes.c_uint8 * size)()
            if llama_cpp.llama_state_seq_get_data_ext(ctx, buf, size, 0, flags) == size:
                self._boundaries[at] = bytes(buf)
            self._eval_ms += (time.perf_counter() - started) * 1000   # the capture is part of the prefill

        if keep and start:
            capture(start)   # where a restore ended: its objects are stored again as they were
        at = start
        for end in ends:
            llm.eval(tokens[at:end])
            at = end
            if keep and end % step == 0:
                capture(end)

    def _last_logits(self):
        """A copy of the logits of the last position llama.cpp computed (the oracle compares them bit for bit)."""
        import llama_cpp
        import numpy as np

        llm = self._llm
        pointer = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(llm.n_vocab(),)).copy()

    def boundary_state(self, n_tokens: int) -> bytes | None:
        return self._boundaries.get(n_tokens)

    def reset_native_cache(self) -> None:
        import llama_cpp

        llm = self._llm
        llm.reset()
        # data=False: forget every cell without zeroing the buffers (a ~100 MB memset that would
        # otherwise be charged to cold and lmcache requests); freed cells are never read.
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), False)

    # full KV access ------------------------------------------------------------------------
    def kv_fingerprint(self) -> dict[str, str]:
        fingerprint = llama_cpp_fingerprint(self.settings, self.model_traits())
        if self._prefill_step:
            # a recurrent model's stored bytes follow the steps its prefill took: never mixed with others' steps
            fingerprint["recurrent_prefill"] = f"by chunk of {self._prefill_step}"
        return fingerprint

    def model_file(self) -> Path | None:
        return self.model_path

    def model_traits(self):
        return traits_of_model(self._llm.model)

    def capture_window(self, n_tokens: int) -> WindowCapture | None:
        import llama_cpp

        llm = self._llm
        ctx = llm._ctx.ctx
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, n_tokens, -1)
        llm.n_tokens = min(llm.n_tokens, n_tokens)
        llm._requires_eval = True   # the last logits belong to a dropped position
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_SWA_ONLY
        size = llama_cpp.llama_state_seq_get_size_ext(ctx, 0, flags)
        buf = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data_ext(ctx, buf, size, 0, flags)
        if written != size:
            raise StateTransferError(f"llama_state_seq_get_data_ext wrote {written} of {size} bytes")
        return WindowCapture(data=memoryview(buf).cast("B"), whole_state=False, trusted_end=n_tokens)

    def held_tokens(self) -> int:
        """llama.cpp's own position range for sequence 0 (pos_max + 1; 0 when it is empty)."""
        import llama_cpp

        memory = llama_cpp.llama_get_memory(self._llm._ctx.ctx)
        return int(llama_cpp.llama_memory_seq_pos_max(memory, 0)) + 1

    def context_tokens(self) -> list[int]:
        llm = self._llm
        return [int(t) for t in llm.input_ids[: llm.n_tokens]]

    def save_state(self) -> SeqState:
        import llama_cpp

        ctx = self._llm._ctx.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0)
        if written != size:
            raise StateTransferError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        llm = self._llm
        return SeqState(data=memoryview(buf).cast("B"), n_tokens=llm.n_tokens,
                        token_ids=tuple(int(t) for t in llm.input_ids[: llm.n_tokens]))

    def restore_state(self, state: SeqState, tokens: Sequence[int]) -> None:
        import llama_cpp

        llm = self._llm
        # Forget every cell first (metadata only, no memset), not just sequence 0's: set_data then
        # places the restored cells from the start of the cache. Dropping only the sequence left the
        # cache's head where the last request ended, so each restore landed further in and every
        # following decode attended over a longer, emptier range (warm TTFT crept up 88 -> 130 ms
        # over eleven questions while native stayed at 77 ms).
        self.reset_native_cache()
        view = memoryview(state.data).cast("B")
        if view.readonly:
            view = memoryview(bytearray(view))
        buf = (ctypes.c_uint8 * len(view)).from_buffer(view)
        read = llama_cpp.llama_state_seq_set_data(llm._ctx.ctx, buf, len(view), 0)
        if read == 0:
            self.reset_native_cache()
            raise StateTransferError("llama_state_seq_set_data refused the state")
        n = len(tokens)
        llm.input_ids[:n] = list(tokens)
        llm.n_tokens = n
        llm._requires_eval = True  # logits are stale: Llama.generate must decode at least one token


register_engine(EngineSpec(
    key="llamacpp",
    label="llama.cpp in-process (full KV)",
    cls=LlamaCppBackend,
    blurb="llama-cpp-python in this process: real KV leaves the engine and is restored from L1/L2.",
    aliases=("llama", "llama.cpp"),
    fields=("model_path", "ctx_size", "threads", "chunk_size", "flash_attn"),
))
