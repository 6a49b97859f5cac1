"""llama.cpp sequence-state layout: parse it, cut it into per-chunk objects, and assemble them back.

Place in the flow: ... -> generate -> **save_state -> split into chunk + tail objects** -> store;
lookup -> fetch -> **assemble a valid sequence state** -> restore_state -> suffix prefill.

The layout (llama.cpp as vendored in llama-cpp-python 0.3.36, src/llama-context.cpp and
src/llama-kv-cache.cpp) of `llama_state_seq_get_data` for one sequence:

    u32 io_magic 0xaf143cd8, i32 seq_id, u32 n_stream,
    per stream: u32 cell_count, per cell (i32 pos, u32 n_seq_id, i32 seq_id * n_seq_id),
                u32 v_trans, u32 n_layer,
                per layer: i32 k_type, u64 k_size_row, cell_count * k_size_row bytes
                V, not transposed: per layer i32 v_type, u64 v_size_row, cell_count * v_size_row bytes
                V, transposed:     per layer i32 v_type, u32 v_size_el, u32 n_embd_v_gqa,
                                   then n_embd_v_gqa runs of cell_count * v_size_el bytes

Every cell's K row and V elements are independent of the others, so cells can be sliced by
position and concatenated again. What is deliberately not handled (and makes parse() raise
LayoutError, so the engine falls back to whole-sequence snapshots): several streams, cells with
extra per-cell data (M-RoPE / PLE models), cells shared by several sequences, holes in positions.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

STATE_IO_MAGIC = 0xAF143CD8
CHUNK_MAGIC = b"KVBCHNK1"     # our per-chunk payload; bump the digit when the payload layout changes
LAYOUT_VERSION = "llama.cpp-seq-v1"
_CHUNK_HEADER = struct.Struct("<8sII16s")   # magic, n_cells, n_token_ids, geometry digest


class LayoutError(ValueError):
    """The bytes are not a sequence state (or chunk) this module understands; never restore them."""


# The KV cache types llama.cpp accepts (--cache-type-k/-v), name -> ggml type id: the one list that
# validation, the in-process engine and llama-server's command line all read.
KV_CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20, "q5_0": 6, "q5_1": 7}
UNQUANTISED_KV_TYPES = frozenset({"f32", "f16", "bf16"})

@dataclass(frozen=True)
class KVGeometry:
    """What must be identical for chunks to be assembled into one state (and restored into an engine)."""

    v_trans: int
    n_layer: int
    k_types: tuple[int, ...]
    k_rows: tuple[int, ...]         # bytes per cell per layer (K)
    v_types: tuple[int, ...]
    v_rows: tuple[int, ...]         # bytes per cell per layer (V; for transposed V: el * n_embd)
    v_els: tuple[int, ...]          # transposed V: element size; 0 otherwise
    v_embds: tuple[int, ...]        # transposed V: n_embd_v_gqa; 0 otherwise

    @property
    def bytes_per_cell(self) -> int:
        return sum(self.k_rows) + sum(self.v_rows)

    def digest(self) -> bytes:
        return hashlib.blake2b(repr(self).encode(), digest_size=16).digest()

    def summary(self) -> str:
        k_types = sorted(set(self.k_types))
        v_types = sorted(set(self.v_types))
        return (f"layers={self.n_layer} k_type={k_types} v_type={v_types} v_trans={self.v_trans} "
                f"bytes/token={self.bytes_per_cell}")


@dataclass
class ParsedState:
    """A validated single-sequence state with cells ordered by position 0..n-1 (numpy views)."""

    geometry: KVGeometry
    seq_id: int
    n_cells: int
    k: list[np.ndarray]   # per layer (n_cells, k_row) uint8
    v: list[np.ndarray]   # per layer: (n_cells, v_row) uint8, or transposed (n_embd, n_cells, el) uint8


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


def parse_state(data: bytes | memoryview, expected_n_layer: int | None = None) -> ParsedState:
    """Parse and validate `llama_state_seq_get_data` bytes; raise LayoutError on anything unexpected."""
    r = _Reader(data)
    magic, seq_id, n_stream = r.unpack("<IiI")
    if magic != STATE_IO_MAGIC:
        raise LayoutError(f"unknown sequence-state magic {magic:#x}")
    if n_stream != 1:
        raise LayoutError(f"{n_stream} KV streams; only one is supported")
    (n_cells,) = r.unpack("<I")
    if n_cells == 0:
        raise LayoutError("empty sequence state")
    meta = r.array(12 * n_cells).view("<i4").reshape(n_cells, 3)  # pos, n_seq_id, seq_id
    if not (meta[:, 1] == 1).all() or not (meta[:, 2] == seq_id).all():
        raise LayoutError("cells with extra data or shared by several sequences")
    positions = meta[:, 0]
    order = np.argsort(positions, kind="stable")
    if not np.array_equal(positions[order], np.arange(n_cells, dtype=positions.dtype)):
        raise LayoutError("cell positions are not exactly 0..n-1")
    in_order = bool((order == np.arange(n_cells)).all())

    v_trans, n_layer = r.unpack("<II")
    if v_trans not in (0, 1) or n_layer == 0 or n_layer > 4096:
        raise LayoutError(f"implausible header v_trans={v_trans} n_layer={n_layer}")
    if expected_n_layer is not None and n_layer != expected_n_layer:
        raise LayoutError(f"{n_layer} layers in state, model has {expected_n_layer}")
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
    if r.off != len(r.buf):
        raise LayoutError(f"{len(r.buf) - r.off} unexpected trailing bytes in sequence state")
    if not in_order:  # cells reused after edits: reorder so cell i holds position i
        k = [layer[order] for layer in k]
        v = [layer[:, order] if v_trans else layer[order] for layer in v]
    geometry = KVGeometry(v_trans, n_layer, tuple(k_types), tuple(k_rows), tuple(v_types),
                          tuple(v_rows), tuple(v_els), tuple(v_embds))
    return ParsedState(geometry, seq_id, n_cells, k, v)


def encode_chunk(state: ParsedState, start: int, stop: int, token_ids: Sequence[int]) -> bytes:
    """The payload for cells [start, stop): header, the token ids (to confirm a hit), K then V per layer."""
    n = stop - start
    if not 0 <= start < stop <= state.n_cells or len(token_ids) != n:
        raise LayoutError("chunk range and token ids disagree")
    g = state.geometry
    parts = [_CHUNK_HEADER.pack(CHUNK_MAGIC, n, n, g.digest()),
             np.asarray(token_ids, dtype="<i4").tobytes()]
    parts += [layer[start:stop].tobytes() for layer in state.k]
    if g.v_trans:
        parts += [layer[:, start:stop].tobytes() for layer in state.v]
    else:
        parts += [layer[start:stop].tobytes() for layer in state.v]
    return b"".join(parts)


@dataclass(frozen=True)
class ChunkView:
    """A decoded chunk payload (views into the stored bytes, no copies)."""

    n_cells: int
    token_ids: np.ndarray
    k: list[np.ndarray]
    v: list[np.ndarray]


def decode_chunk(payload: bytes, geometry: KVGeometry) -> ChunkView:
    """Check a chunk payload against the engine's geometry and return views; LayoutError if it is not ours."""
    if len(payload) < _CHUNK_HEADER.size:
        raise LayoutError("chunk payload too short")
    magic, n_cells, n_ids, digest = _CHUNK_HEADER.unpack_from(payload, 0)
    if magic != CHUNK_MAGIC or digest != geometry.digest() or n_ids != n_cells or n_cells == 0:
        raise LayoutError("chunk payload from another format or KV geometry")
    expected = _CHUNK_HEADER.size + 4 * n_cells + n_cells * geometry.bytes_per_cell
    if len(payload) != expected:
        raise LayoutError(f"chunk payload is {len(payload)} bytes, expected {expected}")
    buf = memoryview(payload)
    off = _CHUNK_HEADER.size
    ids = np.frombuffer(buf, dtype="<i4", count=n_cells, offset=off)
    off += 4 * n_cells
    k, v = [], []
    for row in geometry.k_rows:
        k.append(np.frombuffer(buf, np.uint8, n_cells * row, off).reshape(n_cells, row))
        off += n_cells * row
    for row, el, embd in zip(geometry.v_rows, geometry.v_els, geometry.v_embds):
        arr = np.frombuffer(buf, np.uint8, n_cells * row, off)
        v.append(arr.reshape(embd, n_cells, el) if geometry.v_trans else arr.reshape(n_cells, row))
        off += n_cells * row
    return ChunkView(n_cells, ids, k, v)


def assembled_size(geometry: KVGeometry, n_cells: int) -> int:
    """Bytes of a sequence state holding n_cells cells of this geometry."""
    g = geometry
    return 16 + 12 * n_cells + 8 + sum(12 + n_cells * row for row in g.k_rows) + sum(12 + n_cells * row for row in g.v_rows)


def assemble_state(geometry: KVGeometry, pieces: Sequence[tuple[ChunkView, int]], seq_id: int = 0,
                   out: np.ndarray | None = None, run: Callable[[list[Callable[[], None]]], None] | None = None) -> memoryview:
    """Concatenate the first `keep` cells of each chunk into one valid sequence state for `seq_id`.

    Writes into `out` (a uint8 buffer at least assembled_size() long, reused across restores to avoid
    page faults) or a fresh buffer, and returns a writable memoryview of exactly the state (ctypes can
    point into it: no second copy). `run` executes the per-layer copy jobs, e.g. on two threads
    (numpy releases the GIL while copying); by default they run here, one after another.
    """
    keeps = [keep for _, keep in pieces]
    if not pieces or any(keep < 1 or keep > view.n_cells for view, keep in pieces):
        raise LayoutError("nothing to assemble, or a keep count outside its chunk")
    n = sum(keeps)
    g = geometry
    size = assembled_size(g, n)
    if out is None or len(out) < size:
        out = np.empty(size, dtype=np.uint8)
    out = out[:size]
    out[:16] = np.frombuffer(struct.pack("<IiII", STATE_IO_MAGIC, seq_id, 1, n), np.uint8)
    off = 16
    meta = out[off: off + 12 * n].view("<i4").reshape(n, 3)
    meta[:, 0] = np.arange(n, dtype="<i4")
    meta[:, 1] = 1
    meta[:, 2] = seq_id
    off += 12 * n
    out[off: off + 8] = np.frombuffer(struct.pack("<II", g.v_trans, g.n_layer), np.uint8)
    off += 8
    jobs: list[Callable[[], None]] = []
    for il, row in enumerate(g.k_rows):
        out[off: off + 12] = np.frombuffer(struct.pack("<iQ", g.k_types[il], row), np.uint8)
        off += 12
        jobs.append(_rows_job(out[off: off + n * row].reshape(n, row), [(v.k[il], keep) for v, keep in pieces]))
        off += n * row
    for il, row in enumerate(g.v_rows):
        if g.v_trans:
            el, embd = g.v_els[il], g.v_embds[il]
            out[off: off + 12] = np.frombuffer(struct.pack("<iII", g.v_types[il], el, embd), np.uint8)
            off += 12
            # (embd, n*el) 2-D views: each dimension's run is one contiguous block per chunk
            dst = out[off: off + n * row].reshape(embd, n * el)
            jobs.append(_runs_job(dst, [(v.v[il].reshape(embd, v.n_cells * el), keep * el) for v, keep in pieces]))
        else:
            out[off: off + 12] = np.frombuffer(struct.pack("<iQ", g.v_types[il], row), np.uint8)
            off += 12
            jobs.append(_rows_job(out[off: off + n * row].reshape(n, row), [(v.v[il], keep) for v, keep in pieces]))
        off += n * row
    assert off == size
    if run is None:
        for job in jobs:
            job()
    else:
        run(jobs)
    return memoryview(out)


def _rows_job(dst: np.ndarray, sources: list[tuple[np.ndarray, int]]) -> Callable[[], None]:
    def job() -> None:
        at = 0
        for src, keep in sources:
            dst[at: at + keep] = src[:keep]
            at += keep
    return job


def _runs_job(dst: np.ndarray, sources: list[tuple[np.ndarray, int]]) -> Callable[[], None]:
    def job() -> None:
        at = 0
        for src, width in sources:
            dst[:, at: at + width] = src[:, :width]
            at += width
    return job
