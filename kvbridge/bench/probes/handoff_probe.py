"""What a restore's handoff costs against one copy of its bytes, and what the rest is (issue 47, deliverable 3).

    python -m kvbridge.bench.probes.handoff_probe                        # both embedded models, 7,600 tokens
    python -m kvbridge.bench.probes.handoff_probe --models gemma3-270m --tokens 7600 --reps 21
    python -m kvbridge.bench.probes.handoff_probe --engine llama-server      # the slot-file path

Place in the flow: ... lookup -> fetch -> assemble -> **handoff** (LlamaCppBackend.restore_state: reset the
cache, `llama_state_seq_set_data`, the token list) -> suffix prefill. A hot restore (the same prefix again,
kvbridge.engine.assembly_buffer) skips assembly, so the handoff is the whole restore that bench-floor holds to
one copy of the same bytes (its long-context row).

Per model, one process, interleaved repeat by repeat so that load on the machine falls on every column alike:
- copy: one copy of the state's bytes into memory already touched (bench-floor's baseline);
- layout: the same bytes written by numpy into arrays shaped as llama.cpp's KV tensors are (per layer the K
  rows, then the V rows, transposed without flash attention: one run per V dimension, into a row of the
  context's length), both caches of a sliding-window model: the bytes' own cost in the engine's layout;
- set_data: the `llama_state_seq_set_data` call alone, after a reset;
- handoff: restore_state as a restore runs it (the reset, set_data, the token list).
set_data - layout is what llama.cpp does per cell beyond the bytes (find_slot, apply_ubatch: node-based sets of
used cells and of each sequence's positions, one insert per cell per cache; a sliding-window model has two
caches). The state is a valid layout of N cells holding random KV bytes (set_data reads no values), so no
prefill is needed; nothing is decoded after it.

With --engine llama-server the restore goes through KVBridge's own llama-server (slot files): the state is
assembled once straight into the mapped restore file (state_buffer), then restored again and again as a hot
restore is (reuse_last_restore: `POST /slots/0?action=restore` of that file); columns: copy, the restore as the
client waits for it (server_restore) and the server's own `timings.restore_ms` (server_ms: it maps the file,
patches/llama.cpp/0001, and runs set_data's reader on it).

--loop-s S then repeats the handoff alone for S seconds after each model's line (its pid is printed first), so a
profiler sees nothing else: `perf record -g -p PID -- sleep 8`, then `perf report --no-children --sort symbol`.

Which libllama runs is llama-cpp-python's choice: LLAMA_CPP_LIB_PATH points it at another build (a patched one
in a scratch directory); the path used is printed. Figures are ms, the minimum of the repeats (the least
disturbed), with medians beside them.
"""
from __future__ import annotations

import ctypes
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvbridge.settings import Settings
from kvbridge.settings.cmdline import Parser
from kvbridge.settings.models import EMBEDDED_MODELS

COLUMNS = ("copy", "layout", "set_data", "handoff")
SERVER_COLUMNS = ("copy", "server_restore", "server_ms")


@dataclass
class HandoffResult:
    model: str
    tokens: int
    state_bytes: int
    times: dict[str, list[float]] = field(default_factory=dict)   # column -> ms per repeat

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(self.times)

    def best(self, column: str) -> float:
        return min(self.times[column])

    def median(self, column: str) -> float:
        return statistics.median(self.times[column])

    def line(self) -> str:
        copy = self.best("copy")
        cols = "  ".join(f"{c} {self.best(c):6.2f} [{self.median(c):6.2f}] {self.best(c) / copy:4.2f}x"
                         for c in self.columns)
        beyond = (f"  set_data beyond the bytes {self.best('set_data') - self.best('layout'):5.2f} ms"
                  if "set_data" in self.times else "")
        return f"{self.model:13} {self.tokens:5} tokens {self.state_bytes / 1e6:6.1f} MB  {cols}{beyond}"


def synthetic_state(geometry, n_cells: int, seed: int = 0) -> np.ndarray:
    """A valid sequence state of n_cells cells (every cell of every cache, as a restore writes it) with random KV."""
    from kvbridge.formats.llama_chunks import ChunkView, assemble_state, assembled_size

    rng = np.random.default_rng(seed)
    g = geometry
    k = [rng.integers(0, 256, (n_cells, row), dtype=np.uint8) for row in g.k_rows]
    v = [rng.integers(0, 256, (embd, n_cells, el), dtype=np.uint8) if g.v_trans
         else rng.integers(0, 256, (n_cells, row), dtype=np.uint8)
         for row, el, embd in zip(g.v_rows, g.v_els, g.v_embds)]
    out = np.zeros(assembled_size(g, n_cells), dtype=np.uint8)
    assemble_state(g, [(ChunkView(n_cells, np.zeros(n_cells, dtype="<i4"), k, v), n_cells)], out=out)
    return out


class EngineLayout:
    """Arrays shaped as the engine's KV tensors (kv_size cells per layer), written as set_data writes them."""

    def __init__(self, geometry, kv_size: int, n_cells: int):
        g = geometry
        self.n = n_cells
        self.k = [np.ones((kv_size, row), dtype=np.uint8) for row in g.k_rows]
        self.v = [np.ones((embd, kv_size * el), dtype=np.uint8) if g.v_trans else np.ones((kv_size, row), dtype=np.uint8)
                  for row, el, embd in zip(g.v_rows, g.v_els, g.v_embds)]
        self.v_trans = bool(g.v_trans)
        self.v_runs = [n_cells * el for el in g.v_els] if g.v_trans else []

    def write(self, source: np.ndarray) -> None:
        """The state's KV bytes (a flat array of exactly those bytes, K then V per layer) into the tensors."""
        at, n = 0, self.n
        for k in self.k:
            size = n * k.shape[1]
            k[:n] = source[at: at + size].reshape(n, k.shape[1])
            at += size
        for il, v in enumerate(self.v):
            if self.v_trans:
                run = self.v_runs[il]
                v[:, :run] = source[at: at + v.shape[0] * run].reshape(v.shape[0], run)
                at += v.shape[0] * run
            else:
                size = n * v.shape[1]
                v[:n] = source[at: at + size].reshape(n, v.shape[1])
                at += size


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


def probe_model(settings: Settings, model: str, n_tokens: int, reps: int, loop_s: float = 0.0,
                say=print) -> HandoffResult:
    """The four columns for one model, interleaved over `reps` repeats (then loop_s seconds of handoffs alone)."""
    import llama_cpp

    from kvbridge.backends import make_backend
    from kvbridge.backends.base import SeqState
    from kvbridge.engine.cached_engine import CachedEngine

    ctx = -(-(n_tokens + 64) // 256) * 256   # llama.cpp pads the context to 256 cells
    with tempfile.TemporaryDirectory(prefix="kvb-handoff-") as tmp:
        model_settings = settings.replace(model=model, model_path="", ctx_size=ctx, l2_dir=tmp)
        with CachedEngine(model_settings, make_backend("llama.cpp", model_settings)) as engine:
            g = engine.geometry
            backend = engine.backend
            state = synthetic_state(g, n_tokens)
            size = len(state)
            kv_bytes = n_tokens * g.bytes_per_cell   # every cell of every cache
            source = np.ones(size, dtype=np.uint8)
            target = np.empty_like(source)
            target.fill(1)
            layout = EngineLayout(g, ctx, n_tokens)
            kv_source = np.ones(kv_bytes, dtype=np.uint8)
            c_ctx = backend._llm._ctx.ctx
            c_buf = (ctypes.c_uint8 * size).from_buffer(state)
            seq_state = SeqState(data=memoryview(state), n_tokens=n_tokens)
            tokens = [1] * n_tokens

            def set_data() -> None:
                read = llama_cpp.llama_state_seq_set_data(c_ctx, c_buf, size, 0)
                if read != size:
                    raise RuntimeError(f"llama_state_seq_set_data read {read} of {size} bytes")

            result = HandoffResult(model, n_tokens, size, {c: [] for c in COLUMNS})
            for _ in range(reps):
                result.times["copy"].append(_timed(lambda: np.copyto(target, source)))
                result.times["layout"].append(_timed(lambda: layout.write(kv_source)))
                backend.reset_native_cache()
                result.times["set_data"].append(_timed(set_data))
                result.times["handoff"].append(_timed(lambda: backend.restore_state(seq_state, tokens)))
            say(result.line())
            if loop_s > 0:
                say(f"handoffs alone for {loop_s:g} s (pid {os.getpid()})")
                until = time.monotonic() + loop_s
                while time.monotonic() < until:
                    backend.restore_state(seq_state, tokens)
            backend.reset_native_cache()
            return result


def probe_server(settings: Settings, model: str, n_tokens: int, reps: int) -> HandoffResult:
    """copy, and a hot restore through llama-server's slot file (client wall and the server's own time)."""
    from kvbridge.backends import make_backend
    from kvbridge.backends.base import SeqState
    from kvbridge.engine.cached_engine import CachedEngine

    ctx = -(-(n_tokens + 64) // 256) * 256
    with tempfile.TemporaryDirectory(prefix="kvb-handoff-") as tmp:
        model_settings = settings.replace(model=model, model_path="", ctx_size=ctx, l2_dir=tmp)
        with CachedEngine(model_settings, make_backend("llama-server", model_settings)) as engine:
            backend = engine.backend
            state = synthetic_state(engine.geometry, n_tokens)
            size = len(state)
            tokens = [1] * n_tokens
            buffer = backend.state_buffer(size, tokens)
            if buffer is None:
                raise RuntimeError("this llama-server's slot directory is not on this machine")
            np.copyto(buffer[:size], state)
            backend.restore_state(SeqState(data=buffer[:size], n_tokens=n_tokens), tokens)   # the file is complete
            source = np.ones(size, dtype=np.uint8)
            target = np.empty_like(source)
            target.fill(1)
            result = HandoffResult(model, n_tokens, size, {c: [] for c in SERVER_COLUMNS})
            for _ in range(reps):
                result.times["copy"].append(_timed(lambda: np.copyto(target, source)))
                started = time.perf_counter()   # the restore drops the slot's cells itself, as in a request
                if not backend.reuse_last_restore(tokens):
                    raise RuntimeError("the restore file no longer holds the state")
                result.times["server_restore"].append((time.perf_counter() - started) * 1000)
                result.times["server_ms"].append(backend.last_restore_ms or float("nan"))
            backend.reset_native_cache()
            return result


def loaded_library() -> str:
    """The libllama this process loaded (LLAMA_CPP_LIB_PATH or llama-cpp-python's own)."""
    import llama_cpp.llama_cpp as binding

    return getattr(getattr(binding, "_lib", None), "_name", "?")


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="python -m kvbridge.bench.probes.handoff_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(EMBEDDED_MODELS), help="comma-separated embedded models")
    parser.add_argument("--tokens", type=int, default=7600, help="cells in the restored state (default 7600)")
    parser.add_argument("--reps", type=int, default=15, help="interleaved repeats (default 15)")
    parser.add_argument("--loop-s", type=float, default=0.0,
                        help="in-process: then the handoff alone for this many seconds, to profile (default 0)")
    parser.add_argument("--engine", choices=("llama.cpp", "llama-server"), default="llama.cpp",
                        help="in-process (default) or through llama-server's slot files")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in EMBEDDED_MODELS]
    if bad or args.tokens < 1 or args.reps < 1 or args.loop_s < 0:
        parser.error(f"--models takes {', '.join(EMBEDDED_MODELS)}; --tokens and --reps at least 1, --loop-s not below 0"
                     + (f" (unknown: {', '.join(bad)})" if bad else ""))
    settings = Settings.from_env()
    print("ms, minimum of the repeats [median], and x one copy:")
    def say(line: str) -> None:
        print(line, flush=True)

    for model in models:
        if args.engine == "llama.cpp":
            probe_model(settings, model, args.tokens, args.reps, args.loop_s, say)
        else:
            say(probe_server(settings, model, args.tokens, args.reps).line())
    if args.engine == "llama.cpp":
        print(f"libllama: {loaded_library()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
