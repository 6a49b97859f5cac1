"""Chunk payloads of a llama.cpp sequence state: cut a parsed state into chunks, check them, assemble them back.

Place in the flow: ... -> generate -> save_state -> parse_state (kvbridge.formats.llama_state) ->
**encode_chunk per chunk** -> store; lookup -> fetch -> **decode_chunk -> assemble_state: one valid
sequence state** -> restore_state -> suffix prefill.

A chunk payload is our own format: a header (CHUNK_MAGIC, cell count, token-id count, the digest
of the KV geometry it was cut under), the chunk's token ids (to confirm a hit), the cells' extra
metadata where the model has it (M-RoPE), then K and V rows of every layer, and for a recurrent or
hybrid model the recurrent section captured where the chunk ends. Every cell's K row and V elements
are independent of the others, so cells cut at any position concatenate again into the layout
llama.cpp reads (described in llama_state); a recurrent section cannot be cut, so a restore ends where
a whole piece ends and takes that piece's section.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kvbridge.formats.llama_state import STATE_IO_MAGIC, KVGeometry, LayoutError, ParsedState, RecurrentSection

CHUNK_MAGIC = b"KVBCHNK1"     # our per-chunk payload; bump the digit when the payload layout changes
_CHUNK_HEADER = struct.Struct("<8sII16s")   # magic, n_cells, n_token_ids, geometry digest


def encode_chunk(state: ParsedState, start: int, stop: int, token_ids: Sequence[int],
                 recurrent: RecurrentSection | None = None) -> bytes:
    """The payload for cells [start, stop): header, the token ids (to confirm a hit), the cells' extra bytes,
    K then V per layer, and (recurrent models) `recurrent`, the section captured after position stop - 1."""
    n = stop - start
    if not 0 <= start < stop <= state.n_cells or len(token_ids) != n:
        raise LayoutError("chunk range and token ids disagree")
    g = state.geometry
    if g.recurrent and (recurrent is None or recurrent.pos != stop - 1 or len(recurrent.data) != g.recurrent):
        raise LayoutError(f"the recurrent state after position {stop - 1} was not captured; a chunk without it "
                          "could not be restored exactly")
    if g.window and start < state.window_start:
        raise LayoutError(f"the sliding-window rows of positions {start}..{state.window_start - 1} were not "
                          "captured; a chunk without them could not be restored exactly")
    windowed = g.windowed_layers
    ws = state.window_start

    def cells(il: int) -> tuple[int, int]:
        return (start - ws, stop - ws) if il in windowed else (start, stop)

    parts = [_CHUNK_HEADER.pack(CHUNK_MAGIC, n, n, g.digest()),
             np.asarray(token_ids, dtype="<i4").tobytes()]
    if g.cell_ext:
        parts.append(state.ext[start:stop].tobytes())
    for il, layer in enumerate(state.k):
        a, b = cells(il)
        parts.append(layer[a:b].tobytes())
    for il, layer in enumerate(state.v):
        a, b = cells(il)
        parts.append(layer[:, a:b].tobytes() if g.v_trans else layer[a:b].tobytes())
    if g.recurrent:
        parts.append(bytes(recurrent.data))
    return b"".join(parts)


@dataclass(frozen=True)
class ChunkView:
    """A decoded chunk payload (views into the stored bytes, no copies)."""

    n_cells: int
    token_ids: np.ndarray
    k: list[np.ndarray]
    v: list[np.ndarray]
    ext: np.ndarray | None = None        # (n_cells, cell_ext): the cells' extra metadata (M-RoPE)
    recurrent: memoryview | None = None  # the recurrent section after the chunk's last position

    @property
    def recurrent_pos(self) -> int:
        """The position the recurrent section follows (-1: none)."""
        return struct.unpack_from("<i", self.recurrent, 4)[0] if self.recurrent is not None else -1


def decode_chunk(payload: bytes, geometry: KVGeometry) -> ChunkView:
    """Check a chunk payload against the engine's geometry and return views; LayoutError if it is not ours."""
    if len(payload) < _CHUNK_HEADER.size:
        raise LayoutError("chunk payload too short")
    magic, n_cells, n_ids, digest = _CHUNK_HEADER.unpack_from(payload, 0)
    if magic != CHUNK_MAGIC or digest != geometry.digest() or n_ids != n_cells or n_cells == 0:
        raise LayoutError("chunk payload from another format or KV geometry")
    expected = (_CHUNK_HEADER.size + n_cells * (4 + geometry.cell_ext + geometry.bytes_per_cell)
                + geometry.recurrent)
    if len(payload) != expected:
        raise LayoutError(f"chunk payload is {len(payload)} bytes, expected {expected}")
    buf = memoryview(payload)
    off = _CHUNK_HEADER.size
    ids = np.frombuffer(buf, dtype="<i4", count=n_cells, offset=off)
    off += 4 * n_cells
    ext = None
    if geometry.cell_ext:
        ext = np.frombuffer(buf, np.uint8, n_cells * geometry.cell_ext, off).reshape(n_cells, geometry.cell_ext)
        off += n_cells * geometry.cell_ext
    k, v = [], []
    for row in geometry.k_rows:
        k.append(np.frombuffer(buf, np.uint8, n_cells * row, off).reshape(n_cells, row))
        off += n_cells * row
    for row, el, embd in zip(geometry.v_rows, geometry.v_els, geometry.v_embds):
        arr = np.frombuffer(buf, np.uint8, n_cells * row, off)
        v.append(arr.reshape(embd, n_cells, el) if geometry.v_trans else arr.reshape(n_cells, row))
        off += n_cells * row
    recurrent = buf[off:off + geometry.recurrent] if geometry.recurrent else None
    return ChunkView(n_cells, ids, k, v, ext, recurrent)


def _section_cells(geometry: KVGeometry, n_cells: int, window_only: bool) -> list[tuple[range, int]]:
    """(layer indices, first cell) of each cache in a restore of n_cells cells: every cell, or with
    window_only, for the sliding-window cache the last `window` positions (what llama.cpp writes)."""
    out, at = [], 0
    if not geometry.n_layer:   # a purely recurrent model: no attention cache
        return out
    for count in geometry.section_layers:
        layers = range(at, at + count)
        windowed = window_only and geometry.window and at + count == geometry.n_layer
        first = max(0, n_cells - geometry.window) if windowed else 0
        out.append((layers, first))
        at += count
    return out


def assembled_size(geometry: KVGeometry, n_cells: int, window_only: bool = False, n_stream: int = 1) -> int:
    """Bytes of a sequence state holding n_cells cells of this geometry."""
    g = geometry
    size = 8
    for layers, first in _section_cells(g, n_cells, window_only):
        cells = n_cells - first
        size += 8 + (12 + g.cell_ext) * cells + 8 + sum(24 + cells * (g.k_rows[i] + g.v_rows[i]) for i in layers)
        size += 4 * (n_stream - 1)   # the other streams' empty cell counts
    return size + g.recurrent


def assemble_state(geometry: KVGeometry, pieces: Sequence[tuple[ChunkView, int]], seq_id: int = 0,
                   out: np.ndarray | None = None, run: Callable[[list[Callable[[], None]]], None] | None = None,
                   window_only: bool = False, first_pos: int = 0, n_stream: int = 1) -> memoryview:
    """Concatenate the first `keep` cells of each chunk into one valid sequence state for `seq_id`.

    Writes into `out` (a uint8 buffer at least assembled_size() long, reused across restores to avoid
    page faults) or a fresh buffer, and returns a writable memoryview of exactly the state (ctypes can
    point into it: no second copy). `run` executes the per-layer copy jobs, e.g. on two threads
    (numpy releases the GIL while copying); by default they run here, one after another.

    A sliding-window cache gets every cell too, by default: the context then has the cell layout a
    cold prefill leaves in a full-size SWA cache (swa_full), and llama.cpp's CPU kernels, whose
    rounding depends on how many cells attention runs over, answer as after that prefill. Given
    only the window's cells (window_only, exactly the bytes llama.cpp itself writes), Gemma 3 answered
    1 of 12 document questions differently from both cold and native reuse (Docs/Research.md §13).

    first_pos: the position of the first cell (blend mode restores a passage where it was computed,
    after its instruction, into a scratch sequence, then shifts it; kvbridge.blend.runner).

    n_stream: the streams of the cache it is loaded into (a non-unified cache, KVB_SCHED_EXACT's, has one
    per sequence id); the cells are written as the first stream's, the others empty, and llama.cpp puts
    them in the stream of the sequence it loads into.

    A recurrent model's state ends with the last piece's recurrent section, which must be kept whole
    and follow the last position restored: a section cannot be cut.
    """
    keeps = [keep for _, keep in pieces]
    if not pieces or any(keep < 1 or keep > view.n_cells for view, keep in pieces):
        raise LayoutError("nothing to assemble, or a keep count outside its chunk")
    n = sum(keeps)
    g = geometry
    last, last_keep = pieces[-1]
    if g.recurrent and (first_pos or last_keep != last.n_cells or last.recurrent_pos != n - 1):
        raise LayoutError(f"a recurrent state restores only where a stored piece ends with its section "
                          f"(position {n - 1} asked, the last piece's section follows {last.recurrent_pos})")
    size = assembled_size(g, n, window_only, n_stream)
    if out is None or len(out) < size:
        out = np.empty(size, dtype=np.uint8)
    out = out[:size]
    out[:8] = np.frombuffer(struct.pack("<Ii", STATE_IO_MAGIC, seq_id), np.uint8)
    off = 8
    jobs: list[Callable[[], None]] = []
    for layers, first in _section_cells(g, n, window_only):
        off = _write_section(out, off, g, pieces, layers, first, n, seq_id, jobs, first_pos, n_stream)
    if g.recurrent:
        out[off: off + g.recurrent] = np.frombuffer(last.recurrent, np.uint8)
        off += g.recurrent
    assert off == size
    if run is None:
        for job in jobs:
            job()
    else:
        run(jobs)
    return memoryview(out)


def _write_section(out: np.ndarray, off: int, g: KVGeometry, pieces: Sequence[tuple[ChunkView, int]],
                   layers: range, first: int, n: int, seq_id: int, jobs: list, first_pos: int = 0,
                   n_stream: int = 1) -> int:
    """One cache's cells first..n-1: headers written now, the row copies appended to `jobs`."""
    cells = n - first
    out[off: off + 8] = np.frombuffer(struct.pack("<II", n_stream, cells), np.uint8)
    off += 8
    width = 12 + g.cell_ext   # pos, n_seq_id, the cell's extra bytes, seq_id
    raw = out[off: off + width * cells].reshape(cells, width)
    meta = raw.view("<i4")
    meta[:, 0] = np.arange(first + first_pos, n + first_pos, dtype="<i4")
    meta[:, 1] = 1
    meta[:, -1] = seq_id
    if g.cell_ext:
        _rows_job(raw[:, 8:8 + g.cell_ext], [(pieces[p][0].ext, lo, hi) for p, lo, hi in _spans(pieces, first)])()
    off += width * cells
    out[off: off + 8] = np.frombuffer(struct.pack("<II", g.v_trans, len(layers)), np.uint8)
    off += 8
    spans = _spans(pieces, first)   # (piece index, lo, hi): which cells of which chunk, in order
    for il in layers:
        row = g.k_rows[il]
        out[off: off + 12] = np.frombuffer(struct.pack("<iQ", g.k_types[il], row), np.uint8)
        off += 12
        jobs.append(_rows_job(out[off: off + cells * row].reshape(cells, row),
                              [(pieces[p][0].k[il], lo, hi) for p, lo, hi in spans]))
        off += cells * row
    for il in layers:
        row = g.v_rows[il]
        if g.v_trans:
            el, embd = g.v_els[il], g.v_embds[il]
            out[off: off + 12] = np.frombuffer(struct.pack("<iII", g.v_types[il], el, embd), np.uint8)
            off += 12
            # (embd, cells*el) 2-D views: each dimension's run is one contiguous block per chunk
            dst = out[off: off + cells * row].reshape(embd, cells * el)
            jobs.append(_rows_job(dst, [(pieces[p][0].v[il].reshape(embd, pieces[p][0].n_cells * el), lo * el, hi * el)
                                        for p, lo, hi in spans], columns=True))
        else:
            out[off: off + 12] = np.frombuffer(struct.pack("<iQ", g.v_types[il], row), np.uint8)
            off += 12
            jobs.append(_rows_job(out[off: off + cells * row].reshape(cells, row),
                                  [(pieces[p][0].v[il], lo, hi) for p, lo, hi in spans]))
        off += cells * row
    if n_stream > 1:
        out[off: off + 4 * (n_stream - 1)] = 0   # the other streams: no cells
        off += 4 * (n_stream - 1)
    return off


def _spans(pieces: Sequence[tuple[ChunkView, int]], first: int) -> list[tuple[int, int, int]]:
    spans, at = [], 0
    for p, (_, keep) in enumerate(pieces):
        lo = max(0, first - at)
        if lo < keep:
            spans.append((p, lo, keep))
        at += keep
    return spans


def _rows_job(dst: np.ndarray, sources: list[tuple[np.ndarray, int, int]], columns: bool = False) -> Callable[[], None]:
    """Copy src[lo:hi] of each source one after another into dst's rows (or columns)."""
    def job() -> None:
        at = 0
        for src, lo, hi in sources:
            width = hi - lo
            if columns:
                dst[:, at: at + width] = src[:, lo:hi]
            else:
                dst[at: at + width] = src[lo:hi]
            at += width
    return job
