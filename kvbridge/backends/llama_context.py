"""One llama.cpp context whose unified KV cache several sequences share, driven by the low-level API.

The door to llama.cpp of the scheduler and of blend mode (kvbridge.blend), and their sampler: a batch carries tokens of several sequences (each with its
position, its sequence id and whether its logits are wanted), and the sequence operations
`seq_cp` (share cells), `seq_rm` (free them), `seq_pos_max` and the per-sequence state copy used
for swap. Tokenizing and the chat template come from a vocab-only `llama_cpp.Llama` (no weights),
the same template code the in-process engine uses. Not thread-safe: one thread (the scheduler's
loop) calls it. The build is checked in a child process first, as the in-process engine does.
"""
from __future__ import annotations

import ctypes
from collections import Counter
from pathlib import Path
from typing import Sequence

import numpy as np

from kvbridge.backends.base import BATCH_TOKENS, Message   # prefill pieces share it with decode steps
from kvbridge.backends.build_check import ensure_llama_cpp_runs
from kvbridge.backends.chat_template import template_of_llama
from kvbridge.backends.llama_cpp_model import check_model_file, ggml_type_id, model_path_for
from kvbridge.errors import EngineUnavailable, StateTransferError
from kvbridge.settings import Settings

TOP_K = 40    # llama.cpp's usual top-k when sampling at a temperature (kvbridge.backends.base.Sampling)


class Sampler:
    """Greedy at temperature 0, else top-k 40 then top-p (nucleus) sampling from a seeded generator."""

    def __init__(self, temperature: float, top_p: float, seed: int | None) -> None:
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self._rng = np.random.default_rng(seed)

    def pick(self, logits: np.ndarray) -> int:
        if self.temperature <= 0:
            return int(np.argmax(logits))
        top = np.argpartition(logits, -TOP_K)[-TOP_K:]
        top = top[np.argsort(logits[top])[::-1]]
        scaled = logits[top].astype(np.float64) / self.temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        # top_p = 1 can land past the end when the cumulative sum rounds to just under 1
        keep = min(int(np.searchsorted(np.cumsum(probs), self.top_p) + 1), len(probs))
        probs = probs[:keep] / probs[:keep].sum()
        return int(top[self._rng.choice(keep, p=probs)])


class LlamaContext:
    def __init__(self, settings: Settings, n_cells: int, n_seq: int, exact: bool = False,
                 eval_callback=None) -> None:
        """n_cells: the KV budget of every sequence together (the unified cache's size). eval_callback: a
        ggml_backend_sched_eval_callback that sees the graph's nodes (blend's selection pass, which reads
        the first layers' K and V and stops the graph there; kept alive here). exact: one stream of
        cells per sequence id instead (non-unified), each filled from cell 0 as a fresh context is and each
        holding the longest request (min(n_cells, KVB_CTX_SIZE)), so a sequence's attention never depends on
        the cells beside it (kvbridge.scheduler.exact); n_seq times the memory, and cells reach another
        sequence by a state copy, not by sharing."""
        import llama_cpp

        self._llama = llama_cpp
        path = model_path_for(settings)
        check_model_file(path)
        ensure_llama_cpp_runs(path)
        self.model_path: Path = path
        self.n_seq = n_seq
        self.counters: Counter[str] = Counter()
        self._vocab_llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        self._template = None
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise EngineUnavailable(f"llama.cpp could not load {path} (KVB_MODEL_PATH)")
        params = llama_cpp.llama_context_default_params()
        self.exact = exact
        stream_cells = -(-min(n_cells, settings.ctx_size) // 256) * 256   # llama.cpp pads a stream to 256 cells
        params.n_ctx = stream_cells * n_seq if exact else n_cells
        self.stream_cells = stream_cells if exact else n_cells   # the most one sequence may hold
        params.n_batch = params.n_ubatch = BATCH_TOKENS
        # a recurrent or hybrid model's recurrent memory has n_seq_max cells, one per sequence id, each holding
        # that sequence's whole state: every sequence id the scheduler hands out has room, nothing more is needed
        # (seq_cp shares a cell; llama.cpp copies it into the destination's own cell at its next decode)
        params.n_seq_max = n_seq
        params.kv_unified = not exact      # one pool of cells for every sequence: the KV budget
        params.swa_full = True             # a sliding-window model keeps every cell, as the in-process engine does
        params.n_threads = params.n_threads_batch = settings.resolved_threads()
        self._eval_callback = eval_callback
        if eval_callback is not None:
            params.cb_eval = eval_callback
        params.type_k = ggml_type_id(settings.cache_type_k, "KVB_CACHE_TYPE_K")
        params.type_v = ggml_type_id(settings.cache_type_v, "KVB_CACHE_TYPE_V")
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attn
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise EngineUnavailable(f"llama.cpp could not make a context of {n_cells} cells for {n_seq} sequences "
                                    "(KVB_SCHED_KV_CELLS, KVB_SCHED_MAX_RUNNING)")
        # the ledger's budget: the unified cache's cells, or in exact mode the budget the streams are held to
        self.n_cells = n_cells if exact else int(llama_cpp.llama_n_ctx(self.ctx))
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self._batch = llama_cpp.llama_batch_init(BATCH_TOKENS, 0, n_seq)

    # -- text ---------------------------------------------------------------------------------------
    def render(self, messages: Sequence[Message]) -> str:
        if self._template is None:
            self._template = template_of_llama(self._vocab_llm, self.counters, self.model_path.name)
        return self._template.render(messages)

    def tokenize(self, text: str) -> list[int]:
        return self._vocab_llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)

    def piece(self, token: int) -> bytes:
        return self._vocab_llm.detokenize([token], special=False)

    def is_end(self, token: int) -> bool:
        return bool(self._llama.llama_vocab_is_eog(self.vocab, token))

    # -- decoding -----------------------------------------------------------------------------------
    def decode(self, entries: Sequence[tuple[int, int, int, bool]]) -> int:
        """One llama_decode of (token, position, seq id, wants logits); llama.cpp's return code
        (0 ok, 1 no room for these cells: the caller frees some and retries)."""
        if not 0 < len(entries) <= BATCH_TOKENS:
            raise ValueError(f"a batch holds 1..{BATCH_TOKENS} tokens, got {len(entries)}")
        batch = self._batch
        for i, (token, pos, seq, wants) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = wants
        batch.n_tokens = len(entries)
        return int(self._llama.llama_decode(self.ctx, batch))

    def logits(self, index: int) -> np.ndarray:
        """A copy of the logits of the batch entry `index` (which asked for them)."""
        pointer = self._llama.llama_get_logits_ith(self.ctx, index)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).copy()

    # -- sequences ----------------------------------------------------------------------------------
    def seq_cp(self, src: int, dst: int, n_tokens: int) -> None:
        """Share positions [0, n_tokens) of `src` with `dst` (one set of cells, two sequences); in exact mode
        `dst` (empty) gets a copy in its own stream, at the cell indices `src` has them."""
        if self.exact:
            self._copy_across_streams(src, dst, 0, n_tokens)
            return
        self._llama.llama_memory_seq_cp(self.memory, src, dst, 0, n_tokens)

    def seq_cp_range(self, src: int, dst: int, start: int, stop: int) -> None:
        """Share positions [start, stop) of `src` with `dst` (blend mode places a passage's cells this way)."""
        if self.exact:
            self._copy_across_streams(src, dst, start, stop)
            return
        self._llama.llama_memory_seq_cp(self.memory, src, dst, start, stop)

    def _copy_across_streams(self, src: int, dst: int, start: int, stop: int) -> None:
        """Positions [start, stop) of `src` into the empty sequence `dst` of another stream, at once: the whole
        sequence's state read and written (llama.cpp's own cross-stream seq_cp copies whole streams, and only
        at the next decode, too late for a state read in between), then the rest removed."""
        self.load_seq(dst, self.save_seq(src))
        if stop >= 0:
            self.seq_rm(dst, stop, -1)
        if start > 0:
            self.seq_rm(dst, 0, start)

    def seq_add(self, seq: int, start: int, stop: int, delta: int) -> None:
        """Move positions [start, stop) of `seq` by `delta`; llama.cpp re-rotates their K at the next decode."""
        self._llama.llama_memory_seq_add(self.memory, seq, start, stop, delta)

    def can_shift(self) -> bool:
        """Whether llama.cpp can move cells to other positions in this context (llama_memory_can_shift)."""
        return bool(self._llama.llama_memory_can_shift(self.memory))

    def seq_rm(self, seq: int, start: int = -1, stop: int = -1) -> None:
        self._llama.llama_memory_seq_rm(self.memory, seq, start, stop)

    def seq_len(self, seq: int) -> int:
        return int(self._llama.llama_memory_seq_pos_max(self.memory, seq)) + 1

    def save_seq(self, seq: int) -> memoryview:
        """The sequence's KV as llama_state_seq_get_data writes it (the format CachedEngine stores)."""
        size = self._llama.llama_state_seq_get_size(self.ctx, seq)
        # a fresh, uninitialised buffer per call (ctypes arrays are zeroed first: ~10 ms for 45 MB with
        # the GIL held), which the caller may keep: nobody writes into it again
        buf = np.empty(size, dtype=np.uint8)
        written = self._llama.llama_state_seq_get_data(self.ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                                       size, seq)
        if written != size:
            raise StateTransferError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        return memoryview(buf).cast("B")

    def save_recurrent(self, seq: int) -> bytes:
        """A recurrent or hybrid model: the recurrent state of `seq` after its last position
        (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: the header and the recurrent section, no attention cells), which
        a chunk ending there carries (kvbridge.engine.chunks). A few KB to a few MB: copied out at once."""
        llama = self._llama
        flags = llama.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = llama.llama_state_seq_get_size_ext(self.ctx, seq, flags)
        buf = np.empty(size, dtype=np.uint8)
        written = llama.llama_state_seq_get_data_ext(self.ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                                     size, seq, flags)
        if written != size:
            raise StateTransferError(f"llama_state_seq_get_data_ext wrote {written} of {size} bytes")
        return buf.tobytes()

    def save_window(self, seq: int, scratch: int, end: int, spare: int | None = None) -> memoryview:
        """A sliding-window model: the window rows of `seq` for the window ending at position end - 1,
        read through `scratch` (an empty sequence) sharing seq's first `end` positions, so nothing of
        `seq` changes (its cells keep every row: the SWA cache is full-size). In exact mode `scratch` is
        another stream: llama.cpp copies seq's whole stream into it (a state copy would hold only seq's
        last window), at the next decode, which a token decoded into the empty sequence `spare` and removed
        again brings about (no logits)."""
        llama = self._llama
        flags = llama.LLAMA_STATE_SEQ_FLAGS_SWA_ONLY
        if self.exact:
            if spare is None:
                raise StateTransferError("no spare sequence to read a window through in exact mode")
            llama.llama_memory_seq_cp(self.memory, seq, scratch, -1, -1)
            self.seq_rm(scratch, end, -1)
            rc = self.decode([(0, 0, spare, False)])
            self.seq_rm(spare)
            if rc != 0:
                self.seq_rm(scratch)
                raise StateTransferError(f"llama_decode returned {rc} while copying a stream for a window")
        else:
            self.seq_cp(seq, scratch, end)
        try:
            size = llama.llama_state_seq_get_size_ext(self.ctx, scratch, flags)
            buf = np.empty(size, dtype=np.uint8)
            written = llama.llama_state_seq_get_data_ext(self.ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                                         size, scratch, flags)
        finally:
            self.seq_rm(scratch)
        if written != size:
            raise StateTransferError(f"llama_state_seq_get_data_ext wrote {written} of {size} bytes")
        return memoryview(buf).cast("B")

    def load_seq(self, seq: int, data) -> None:
        """Put a saved state into sequence `seq` (which must be empty); StateTransferError when refused."""
        view = memoryview(data).cast("B")
        if view.readonly:
            view = memoryview(bytearray(view))
        buf = (ctypes.c_uint8 * len(view)).from_buffer(view)
        if self._llama.llama_state_seq_set_data(self.ctx, buf, len(view), seq) == 0:
            self.seq_rm(seq)
            raise StateTransferError("llama_state_seq_set_data refused the state (no room, or another layout)")

    def close(self) -> None:
        llama = self._llama
        if getattr(self, "_batch", None) is not None:
            llama.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "ctx", None):
            llama.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            llama.llama_model_free(self.model)
            self.model = None
        if getattr(self, "_vocab_llm", None) is not None:
            self._vocab_llm.close()
            self._vocab_llm = None
