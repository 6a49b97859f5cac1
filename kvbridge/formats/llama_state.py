"""llama.cpp sequence-state layout: parse and validate it into per-layer views (ParsedState).

Place in the flow: ... -> generate -> save_state -> **parse_state** -> cut into chunk payloads
(kvbridge.formats.llama_chunks) -> store; lookup -> fetch -> assemble a valid sequence state
(llama_chunks) -> restore_state -> suffix prefill. This module also holds what both halves share:
the KV geometry that chunks must agree on, and LayoutError.

The layout (llama.cpp as vendored in llama-cpp-python 0.3.36, src/llama-context.cpp and
src/llama-kv-cache.cpp) of `llama_state_seq_get_data` for one sequence:

    u32 io_magic 0xaf143cd8, i32 seq_id, u32 n_stream,
    per stream: u32 cell_count, per cell (i32 pos, u32 n_seq_id, i32 seq_id * n_seq_id),
                u32 v_trans, u32 n_layer,
                per layer: i32 k_type, u64 k_size_row, cell_count * k_size_row bytes
                V, not transposed: per layer i32 v_type, u64 v_size_row, cell_count * v_size_row bytes
                V, transposed:     per layer i32 v_type, u32 v_size_el, u32 n_embd_v_gqa,
                                   then n_embd_v_gqa runs of cell_count * v_size_el bytes

A model with sliding-window attention (Gemma 3) keeps two caches (`llama_kv_cache_iswa`): the
state is the global layers' cache in the layout above, then the sliding-window layers' cache in the
same layout, holding only the cells of the last n_swa positions (llama.cpp skips the masked ones).
Chunks hold the rows of every layer for every cell (the sliding-window rows of earlier positions
are captured separately: with_window_rows), so a restore at any position can give the window the
rows it needs; assemble_state (llama_chunks) writes every cell of both caches (the layout a cold prefill leaves in
a full-size sliding-window cache), or with window_only exactly the cells llama.cpp itself writes.

M-RoPE models (Qwen3.5) write 12 more bytes per cell after n_seq_id (llama_kv_cell_ext: the 2D
position and the token id); they travel with the chunk as the cell's "ext" bytes.

A recurrent or hybrid model (llama_memory_recurrent / llama_memory_hybrid) ends its state with a
recurrent section: u32 cell_count (1 for one sequence), i32 pos, u32 n_seq_id (0), u32 s_trans,
u32 n_layer, then its rows (r then s per layer). Its size does not grow with the sequence: it is the
state after the last position `pos`, and it cannot be cut. A hybrid state is the attention cache in the
layout above followed by that section; a purely recurrent one is the section alone.
`llama_state_seq_get_data_ext(..., LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)` writes the header and the
section only (parse_recurrent_capture): taken where a chunk ends, it is what that chunk restores.

Every cell's K row and V elements are independent of the others, so cells can be sliced by
position and concatenated again. What is deliberately not handled (parse raises LayoutError and
nothing is stored or restored): several streams, cells shared by several sequences, holes in
positions, a transposed recurrent section, any layout the model's architecture does not announce
(kvbridge.formats.architectures decides which is expected).
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

STATE_IO_MAGIC = 0xAF143CD8
LAYOUT_VERSION = "llama.cpp-seq-v1"


class LayoutError(ValueError):
    """The bytes are not a sequence state (or chunk) this module understands; never restore them."""


# The KV cache types llama.cpp accepts (--cache-type-k/-v), name -> ggml type id: the one list that
# validation, the in-process engine and llama-server's command line all read.
KV_CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20, "q5_0": 6, "q5_1": 7}
UNQUANTISED_KV_TYPES = frozenset({"f32", "f16", "bf16"})

@dataclass(frozen=True)
class KVGeometry:
    """What must be identical for chunks to be assembled into one state (and restored into an engine).

    The per-layer tuples run over every layer of every cache, in the order llama.cpp writes them. A
    model with one plain cache has one section; an iSWA model (Gemma 3: `llama_kv_cache_iswa`) has
    two, the global layers' cache and then the sliding-window layers' cache, whose state holds only
    the cells the last `window` positions need (llama.cpp drops the masked ones when it writes).
    """

    v_trans: int
    n_layer: int
    k_types: tuple[int, ...]
    k_rows: tuple[int, ...]         # bytes per cell per layer (K)
    v_types: tuple[int, ...]
    v_rows: tuple[int, ...]         # bytes per cell per layer (V; for transposed V: el * n_embd)
    v_els: tuple[int, ...]          # transposed V: element size; 0 otherwise
    v_embds: tuple[int, ...]        # transposed V: n_embd_v_gqa; 0 otherwise
    sections: tuple[int, ...] = ()  # layers per cache in write order; () = one plain cache of n_layer
    window: int = 0                 # the last section's sliding window (n_swa); 0 = none
    cell_ext: int = 0               # extra bytes per cell in the cells' metadata (M-RoPE); 0 = none
    recurrent: int = 0              # bytes of the recurrent section that ends the state; 0 = none

    @property
    def bytes_per_cell(self) -> int:
        return sum(self.k_rows) + sum(self.v_rows)

    @property
    def section_layers(self) -> tuple[int, ...]:
        return self.sections or (self.n_layer,)

    @property
    def windowed_layers(self) -> range:
        """Indices of the layers whose cells a state holds only for the last `window` positions."""
        if not self.window:
            return range(0)
        return range(self.n_layer - self.section_layers[-1], self.n_layer)

    def digest(self) -> bytes:
        # a plain cache keeps the digest it always had, so stored chunks stay valid
        plain = (f"KVGeometry(v_trans={self.v_trans!r}, n_layer={self.n_layer!r}, k_types={self.k_types!r}, "
                 f"k_rows={self.k_rows!r}, v_types={self.v_types!r}, v_rows={self.v_rows!r}, "
                 f"v_els={self.v_els!r}, v_embds={self.v_embds!r})")
        text = plain if not self.sections else f"{plain}|sections={self.sections!r}|window={self.window}"
        if self.cell_ext or self.recurrent:
            text += f"|cell_ext={self.cell_ext}|recurrent={self.recurrent}"
        return hashlib.blake2b(text.encode(), digest_size=16).digest()

    def summary(self) -> str:
        k_types = sorted(set(self.k_types))
        v_types = sorted(set(self.v_types))
        caches = ""
        if self.window:
            caches = f" caches=global:{self.section_layers[0]}+sliding:{self.section_layers[-1]}(window {self.window})"
        if self.recurrent:
            caches += f" recurrent={self.recurrent} bytes per chunk boundary"
        return (f"layers={self.n_layer} k_type={k_types} v_type={v_types} v_trans={self.v_trans} "
                f"bytes/token={self.bytes_per_cell}{caches}")


@dataclass
class ParsedState:
    """A validated single-sequence state with cells ordered by position 0..n-1 (numpy views).

    Windowed layers (iSWA) hold only positions window_start..n-1: their arrays start at window_start.
    """

    geometry: KVGeometry
    seq_id: int
    n_cells: int
    k: list[np.ndarray]   # per layer (n_cells, k_row) uint8
    v: list[np.ndarray]   # per layer: (n_cells, v_row) uint8, or transposed (n_embd, n_cells, el) uint8
    window_start: int = 0
    ext: np.ndarray | None = None              # (n_cells, cell_ext) uint8: each cell's extra metadata
    recurrent: "RecurrentSection | None" = None  # the recurrent section at the state's end


class _Reader:
    def __init__(self, data: bytes | memoryview):
        self.buf = memoryview(data)
        self.off = 0

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.off + size > len(self.buf):
            raise LayoutError("sequence state ends early")
        values = struct.unpack_from(fmt, self.buf, self.off)
        self.off += size
        return values

    def array(self, count: int) -> np.ndarray:
        if count < 0 or self.off + count > len(self.buf):
            raise LayoutError("sequence state ends early")
        arr = np.frombuffer(self.buf, dtype=np.uint8, count=count, offset=self.off)
        self.off += count
        return arr


MAX_STREAMS = 4096   # llama.cpp's sequence ids a non-unified cache may give a stream each


@dataclass
class _Cache:
    """One cache's section of a sequence state: cells ordered by position first_pos..first_pos+n-1."""

    first_pos: int
    n_cells: int
    geometry: KVGeometry
    k: list[np.ndarray]
    v: list[np.ndarray]
    ext: np.ndarray | None = None


def _read_cache(r: _Reader, seq_id: int, cell_ext: int = 0) -> _Cache:
    """One cache's section: its streams, of which one holds the sequence's cells (a unified cache has one
    stream; a non-unified one, KVB_SCHED_EXACT's, a stream per sequence id, the others written empty)."""
    (n_stream,) = r.unpack("<I")
    if not 1 <= n_stream <= MAX_STREAMS:
        raise LayoutError(f"{n_stream} KV streams; 1 to {MAX_STREAMS} are understood")
    cache = None
    for _ in range(n_stream):
        (n_cells,) = r.unpack("<I")
        if n_cells == 0:
            continue
        if cache is not None:
            raise LayoutError("cells in more than one KV stream: not one sequence's state")
        cache = _read_stream(r, seq_id, cell_ext, n_cells)
    if cache is None:
        raise LayoutError("empty sequence state")
    return cache


def _read_stream(r: _Reader, seq_id: int, cell_ext: int, n_cells: int) -> _Cache:
    width = 12 + cell_ext   # pos, n_seq_id, the cell's extra bytes, seq_id
    raw = r.array(width * n_cells).reshape(n_cells, width)
    meta = raw.view("<i4")
    if not (meta[:, 1] == 1).all() or not (meta[:, -1] == seq_id).all():
        raise LayoutError("cells with unexpected extra data or shared by several sequences")
    ext = raw[:, 8:8 + cell_ext] if cell_ext else None
    positions = meta[:, 0]
    order = np.argsort(positions, kind="stable")
    first = int(positions[order[0]])
    if first < 0 or not np.array_equal(positions[order], np.arange(first, first + n_cells, dtype=positions.dtype)):
        raise LayoutError("cell positions are not one run without holes")
    in_order = bool((order == np.arange(n_cells)).all())

    v_trans, n_layer = r.unpack("<II")
    if v_trans not in (0, 1) or n_layer == 0 or n_layer > 4096:
        raise LayoutError(f"implausible header v_trans={v_trans} n_layer={n_layer}")
    k_types, k_rows, k = [], [], []
    for _ in range(n_layer):
        k_type, k_row = r.unpack("<iQ")
        if k_row == 0 or k_row > 1 << 24:
            raise LayoutError(f"implausible K row size {k_row}")
        k_types.append(k_type)
        k_rows.append(k_row)
        k.append(r.array(n_cells * k_row).reshape(n_cells, k_row))
    v_types, v_rows, v_els, v_embds, v = [], [], [], [], []
    for _ in range(n_layer):
        if v_trans:
            v_type, v_el, n_embd = r.unpack("<iII")
            if v_el == 0 or n_embd == 0:
                raise LayoutError("implausible transposed V sizes")
            v_types.append(v_type)
            v_els.append(v_el)
            v_embds.append(n_embd)
            v_rows.append(v_el * n_embd)
            v.append(r.array(n_cells * v_el * n_embd).reshape(n_embd, n_cells, v_el))
        else:
            v_type, v_row = r.unpack("<iQ")
            if v_row == 0 or v_row > 1 << 24:
                raise LayoutError(f"implausible V row size {v_row}")
            v_types.append(v_type)
            v_rows.append(v_row)
            v_els.append(0)
            v_embds.append(0)
            v.append(r.array(n_cells * v_row).reshape(n_cells, v_row))
    if not in_order:  # cells reused after edits: reorder so cell i holds position first + i
        k = [layer[order] for layer in k]
        v = [layer[:, order] if v_trans else layer[order] for layer in v]
        ext = ext[order] if ext is not None else None
    geometry = KVGeometry(v_trans, n_layer, tuple(k_types), tuple(k_rows), tuple(v_types),
                          tuple(v_rows), tuple(v_els), tuple(v_embds), cell_ext=cell_ext)
    return _Cache(first, n_cells, geometry, k, v, ext)


_RECURRENT_HEAD = struct.Struct("<IiIII")   # cell_count, pos, n_seq_id, s_trans, n_layer


@dataclass(frozen=True)
class RecurrentSection:
    """A recurrent section as llama.cpp writes it for one sequence: the state after position `pos`."""

    pos: int
    n_layer: int       # every layer of the model (the section says so even for layers with no recurrent rows)
    data: memoryview   # the whole section, header included, exactly as written


def _read_recurrent(r: _Reader) -> RecurrentSection:
    """The recurrent section from r's offset to the end of the state (nothing may follow it)."""
    start = r.off
    cell_count, pos, n_seq_id, s_trans, n_layer = r.unpack(_RECURRENT_HEAD.format)
    if cell_count != 1 or n_seq_id != 0:
        raise LayoutError(f"a recurrent section with {cell_count} cells and {n_seq_id} sequence ids, not one sequence's")
    if pos < 0 or s_trans != 0 or n_layer == 0 or n_layer > 4096 or len(r.buf) - r.off < 12:
        raise LayoutError(f"implausible recurrent section (pos {pos}, s_trans {s_trans}, {n_layer} layers)")
    r.off = len(r.buf)
    return RecurrentSection(pos, n_layer, r.buf[start:])


def parse_recurrent_capture(data: bytes | memoryview, geometry: KVGeometry) -> RecurrentSection:
    """A capture taken where a chunk ends (`LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`: the header and the recurrent
    section only); LayoutError unless it is one sequence's section of this geometry's size."""
    if not geometry.recurrent:
        raise LayoutError("the model keeps no recurrent state")
    r = _Reader(data)
    _read_header(r)
    section = _read_recurrent(r)
    if len(section.data) != geometry.recurrent:
        raise LayoutError(f"a recurrent section of {len(section.data)} bytes, the engine's is {geometry.recurrent}")
    return section


def _read_header(r: _Reader) -> int:
    magic, seq_id = r.unpack("<Ii")
    if magic != STATE_IO_MAGIC:
        raise LayoutError(f"unknown sequence-state magic {magic:#x}")
    return seq_id


def parse_state(data: bytes | memoryview, expected_n_layer: int | None = None, *, window: int = 0,
                cell_ext: int = 0, recurrent: bool = False, attention: bool = True) -> ParsedState:
    """Parse and validate `llama_state_seq_get_data` bytes; raise LayoutError on anything unexpected.

    window=0: one plain cache is expected. window=n_swa (> 0): the iSWA layout is expected, exactly
    two caches (global, then sliding-window), the second holding the last positions of the first
    and no more than `window` of them. cell_ext: extra bytes per cell (M-RoPE). recurrent: a recurrent
    section ends the state, after a plain attention cache (attention=True: hybrid) or alone (a purely
    recurrent model), and it must hold the state after the last position. What the model is decides
    which: never the bytes. expected_n_layer: the layers that keep KV of their own.
    """
    r = _Reader(data)
    seq_id = _read_header(r)
    caches: list[_Cache] = []
    if attention:
        base = _read_cache(r, seq_id, cell_ext)
        if base.first_pos != 0:
            raise LayoutError("cell positions do not start at 0")
        caches.append(base)
    if window:
        if r.off == len(r.buf):
            raise LayoutError("sliding-window model, but the state holds one cache, not two")
        swa = _read_cache(r, seq_id, cell_ext)
        end = swa.first_pos + swa.n_cells
        if end != base.n_cells or swa.n_cells > window or swa.geometry.v_trans != base.geometry.v_trans:
            raise LayoutError(f"the sliding-window cache holds positions {swa.first_pos}..{end - 1}, "
                              f"not the last ones of {base.n_cells} within a window of {window}")
        caches.append(swa)
    section = _read_recurrent(r) if recurrent else None
    if r.off != len(r.buf):
        raise LayoutError(f"{len(r.buf) - r.off} unexpected trailing bytes in sequence state")
    if section is not None and caches and section.pos != caches[0].n_cells - 1:
        raise LayoutError(f"the recurrent state is at position {section.pos}, the attention cache ends at "
                          f"{caches[0].n_cells - 1}")
    if not caches:   # purely recurrent: no per-position KV at all
        if expected_n_layer is not None and section.n_layer != expected_n_layer:
            raise LayoutError(f"{section.n_layer} layers in the recurrent section, model has {expected_n_layer}")
        geometry = KVGeometry(0, 0, (), (), (), (), (), (), recurrent=len(section.data))
        return ParsedState(geometry, seq_id, section.pos + 1, [], [], recurrent=section)
    geometry = _joined(caches, window)
    if section is not None:
        geometry = replace(geometry, recurrent=len(section.data))
    if expected_n_layer is not None and section is not None and section.n_layer != expected_n_layer:
        raise LayoutError(f"{section.n_layer} layers in the recurrent section, model has {expected_n_layer}")
    if expected_n_layer is not None and section is None and geometry.n_layer != expected_n_layer:
        raise LayoutError(f"{geometry.n_layer} layers in state, model has {expected_n_layer}")
    if expected_n_layer is not None and section is not None and geometry.n_layer > expected_n_layer:
        raise LayoutError(f"{geometry.n_layer} attention layers in a hybrid state of {expected_n_layer} layers")
    k = [layer for cache in caches for layer in cache.k]
    v = [layer for cache in caches for layer in cache.v]
    return ParsedState(geometry, seq_id, caches[0].n_cells, k, v, window_start=caches[-1].first_pos,
                       ext=caches[0].ext, recurrent=section)


def _joined(caches: list[_Cache], window: int) -> KVGeometry:
    if len(caches) == 1:
        return caches[0].geometry
    gs = [c.geometry for c in caches]
    return KVGeometry(gs[0].v_trans, sum(g.n_layer for g in gs),
                      *(sum((getattr(g, name) for g in gs), ()) for name in
                        ("k_types", "k_rows", "v_types", "v_rows", "v_els", "v_embds")),
                      sections=tuple(g.n_layer for g in gs), window=window, cell_ext=gs[0].cell_ext)


@dataclass
class WindowRows:
    """Sliding-window layers' rows for positions first_pos..first_pos+n_cells-1 (from a sliding-window-only
    save: `llama_state_seq_get_data_ext` with LLAMA_STATE_SEQ_FLAGS_SWA_ONLY, or a slot file's second cache)."""

    first_pos: int
    n_cells: int
    k: list[np.ndarray]
    v: list[np.ndarray]

    def first(self, n: int) -> "WindowRows":
        """Only the first n cells (the rest were recomputed and are not to be trusted)."""
        n = max(0, min(n, self.n_cells))
        trans = bool(self.v and self.v[0].ndim == 3)
        return WindowRows(self.first_pos, n, [k[:n] for k in self.k], [v[:, :n] if trans else v[:n] for v in self.v])


def parse_window_rows(data: bytes | memoryview, geometry: KVGeometry, *, whole_state: bool = False) -> WindowRows:
    """The sliding-window cache's rows of a state: a sliding-window-only save, or (whole_state=True) a
    whole iSWA state whose first cache is skipped. LayoutError unless they match `geometry`."""
    if not geometry.window:
        raise LayoutError("the model has no sliding-window cache")
    r = _Reader(data)
    seq_id = _read_header(r)
    if whole_state:
        _read_cache(r, seq_id, geometry.cell_ext)
    cache = _read_cache(r, seq_id, geometry.cell_ext)
    if r.off != len(r.buf):
        raise LayoutError(f"{len(r.buf) - r.off} unexpected trailing bytes in sliding-window state")
    layers = geometry.windowed_layers
    g = cache.geometry
    expected = tuple(tuple(getattr(geometry, name)[i] for i in layers)
                     for name in ("k_types", "k_rows", "v_types", "v_rows", "v_els", "v_embds"))
    if g.v_trans != geometry.v_trans or (g.k_types, g.k_rows, g.v_types, g.v_rows, g.v_els, g.v_embds) != expected:
        raise LayoutError("the sliding-window state does not match the engine's sliding-window cache")
    return WindowRows(cache.first_pos, cache.n_cells, cache.k, cache.v)


def with_window_rows(state: ParsedState, rows: Sequence[WindowRows]) -> ParsedState:
    """`state` with its windowed layers' rows extended back by `rows` (captured at earlier positions),
    as far as they reach without a hole.

    The result's window_start says how far back the rows now go; nothing is guessed: a position
    whose rows no capture holds stays out, and encode_chunk refuses a chunk that needs it.
    """
    layers = state.geometry.windowed_layers
    if not layers:
        return state
    trans = bool(state.geometry.v_trans)
    segments: list[tuple[int, int, WindowRows | None]] = [(state.window_start, state.n_cells, None)]
    start = state.window_start
    for part in sorted(rows, key=lambda w: -w.first_pos):
        if part.first_pos < start <= part.first_pos + part.n_cells:
            segments.insert(0, (part.first_pos, start, part))
            start = part.first_pos
    if start == state.window_start:
        return state
    k, v = list(state.k), list(state.v)
    for j, il in enumerate(layers):
        k_parts, v_parts = [], []
        for lo, hi, part in segments:
            if part is None:
                k_parts.append(state.k[il])
                v_parts.append(state.v[il])
            else:
                a, b = lo - part.first_pos, hi - part.first_pos
                k_parts.append(part.k[j][a:b])
                v_parts.append(part.v[j][:, a:b] if trans else part.v[j][a:b])
        k[il] = np.concatenate(k_parts, axis=0)
        v[il] = np.concatenate(v_parts, axis=1 if trans else 0)
    return replace(state, k=k, v=v, window_start=start)
