"""`int8`: lossy, f16/f32 K and V stored as int8 with one f32 absmax scale per cell and layer.

Only chunk payloads (kvbridge.formats.llama_state.encode_chunk: chunks and tails) are quantised;
the chunk's header and token ids are kept verbatim, so a hit is confirmed exactly as before, and
decoding gives back the same length and layout in the original dtype. Scales are per cell (one
token's K row, one token's V vector): for transposed V, whose bytes run dimension by dimension,
the scale is still taken across a cell's dimensions, not along a dimension's run of cells, so
both V layouts quantise identically, a tail of one cell costs one scale, and the result does not
depend on where chunk boundaries fall. Measured on SmolLM2 KV (256-cell chunks), a per-dimension
scale would lower V's mean squared error by only ~15% (K's by ~7x: K has outlier channels, as KIVI
reports) while its scales cost as much as the values in a one-cell tail; a per-channel K codec is
left for another module. Error: |x - x'| <= scale/2 + the dtype's rounding, scale = absmax/127,
i.e. at most absmax * (1/254 + 2**-11) for f16 (measured: absmax * 0.00433).

The geometry comes from CodecMeta when given; otherwise (a tier's TierCodec gives none) from the
digest in the chunk's header, looked up among the geometries engines registered (known_geometry).
What it cannot quantise it stores losslessly and says why (stored_reason): a cache type that is
already quantised (q8_0, q4_0, ...) or bf16, non-finite values, no geometry given or registered,
a payload that is not a chunk. Encoded layout (little-endian), after the sub-header `<4sBBI`
(magic b"KVQ8", version, mode, extra_len):

    mode 1, stored:    extra = the reason (UTF-8), then the payload as it was
    mode 0, quantised: extra = u32 v_trans, u32 n_layer, per layer <iQiQII (k_type, k_row,
                       v_type, v_row, v_el, v_embd); then the chunk header and token ids verbatim;
                       per K layer: f32 scales[n], int8[n, elements per row];
                       per V layer: f32 scales[n], int8[n, els] (or [n_embd, n] when transposed)

The store layer knows nothing of llama.cpp's layout, so kvbridge.formats is imported late, only
by this codec and only when it runs.
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.store.objects import CorruptObject
from kvbridge.store.serde.base import Codec, CodecMeta, known_geometry, register_codec

if TYPE_CHECKING:
    from kvbridge.formats.llama_state import KVGeometry

MAGIC = b"KVQ8"
VERSION = 1
MODE_QUANTISED, MODE_STORED = 0, 1
QMAX = 127
_SUB = struct.Struct("<4sBBI")
_GEOMETRY_HEAD = struct.Struct("<II")
_LAYER = struct.Struct("<iQiQII")
_FLOAT_TYPES = {0: np.dtype("<f4"), 1: np.dtype("<f2")}    # ggml type id -> element dtype
CHUNK_KINDS = ("chunk", "tail")


def _registered_geometry(payload: Any) -> "KVGeometry | None":
    """The geometry an engine registered for the digest in this chunk's header (None: not a chunk, or unknown)."""
    from kvbridge.formats.llama_chunks import CHUNK_MAGIC, _CHUNK_HEADER

    if memoryview(payload).nbytes < _CHUNK_HEADER.size:
        return None
    magic, _, _, digest = _CHUNK_HEADER.unpack_from(payload, 0)
    return known_geometry(digest) if magic == CHUNK_MAGIC else None


def _type_name(type_id: int) -> str:
    from kvbridge.formats.llama_state import KV_CACHE_TYPES

    return next((name for name, tid in KV_CACHE_TYPES.items() if tid == type_id), f"ggml type {type_id}")


def _why_not(geometry: "KVGeometry") -> str | None:
    """Why this geometry cannot be quantised, or None."""
    if geometry.recurrent or geometry.cell_ext:
        # a recurrent section (or per-cell metadata) is not K/V rows: quantising around it is not worth a format
        return "a recurrent or per-cell section, which int8 does not quantise"
    for what, types in (("K", geometry.k_types), ("V", geometry.v_types)):
        for t in types:
            if t not in _FLOAT_TYPES:
                kind = "has no int8 path that beats storing it exactly" if t == 30 else "is quantised already"
                return f"{what} cache type {_type_name(t)} {kind}"
    sizes = zip(geometry.k_types, geometry.k_rows, geometry.v_types, geometry.v_rows, geometry.v_els)
    for k_type, k_row, v_type, v_row, v_el in sizes:
        if k_row % _FLOAT_TYPES[k_type].itemsize or v_row % _FLOAT_TYPES[v_type].itemsize or (
                geometry.v_trans and v_el != _FLOAT_TYPES[v_type].itemsize):
            return "row sizes that do not match their element type"
    return None


def quantise_rows(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(f32 scales, int8 values): one absmax scale per index along the other axis of 2-D `x`."""
    x = x.astype(np.float32)
    scales = np.abs(x).max(axis=axis) / QMAX
    safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
    q = np.rint(x / np.expand_dims(safe, axis)).clip(-QMAX, QMAX).astype(np.int8)
    return scales.astype("<f4"), q


def dequantise_rows(scales: np.ndarray, q: np.ndarray, axis: int, dtype: np.dtype) -> np.ndarray:
    return (q.astype(np.float32) * np.expand_dims(scales, axis)).astype(dtype)


def _stored(reason: str, payload: Any) -> bytes:
    text = reason.encode("utf-8")
    return b"".join((_SUB.pack(MAGIC, VERSION, MODE_STORED, len(text)), text, bytes(payload)))


def stored_reason(data: Any) -> str | None:
    """Why an int8-encoded object was stored losslessly, or None if it was quantised."""
    buf = memoryview(data).cast("B")
    if len(buf) < _SUB.size:
        return None
    magic, version, mode, extra_len = _SUB.unpack_from(buf, 0)
    if magic != MAGIC or mode != MODE_STORED:
        return None
    return bytes(buf[_SUB.size:_SUB.size + extra_len]).decode("utf-8", "replace")


def _geometry_bytes(g: "KVGeometry") -> bytes:
    layers = zip(g.k_types, g.k_rows, g.v_types, g.v_rows, g.v_els, g.v_embds)
    return _GEOMETRY_HEAD.pack(g.v_trans, g.n_layer) + b"".join(_LAYER.pack(*layer) for layer in layers)


def _read_geometry(extra: memoryview) -> "KVGeometry":
    from kvbridge.formats.llama_state import KVGeometry

    v_trans, n_layer = _GEOMETRY_HEAD.unpack_from(extra, 0)
    if len(extra) != _GEOMETRY_HEAD.size + n_layer * _LAYER.size:
        raise ValueError("geometry record of the wrong length")
    layers = [_LAYER.unpack_from(extra, _GEOMETRY_HEAD.size + i * _LAYER.size) for i in range(n_layer)]
    columns = list(zip(*layers)) or [()] * 6
    return KVGeometry(v_trans, n_layer, *(tuple(c) for c in columns))


@register_codec
class Int8Codec(Codec):
    name = "int8"
    lossless = False
    blurb = "lossy: f16/f32 K and V as int8 with a per-token scale (about half the bytes)"

    def encode(self, payload: Any, meta: CodecMeta | None = None) -> bytes:
        from kvbridge.formats.llama_chunks import decode_chunk
        from kvbridge.formats.llama_state import LayoutError

        if meta is not None and meta.kind not in CHUNK_KINDS:
            return _stored(f"a {meta.kind} object is not a chunk payload", payload)
        g = meta.geometry if meta is not None and meta.geometry is not None else _registered_geometry(payload)
        if g is None:
            return _stored("no KV geometry given or registered for this chunk", payload)
        reason = _why_not(g)
        if reason:
            return _stored(reason, payload)
        try:
            view = decode_chunk(bytes(payload), g)
        except LayoutError as error:
            return _stored(f"not a chunk of this geometry ({error})", payload)
        n = view.n_cells
        parts: list[bytes] = []
        for k_type, k in zip(g.k_types, view.k):
            parts.append(self._quantise(k.view(_FLOAT_TYPES[k_type]), axis=1))
        for v_type, v in zip(g.v_types, view.v):
            if g.v_trans:   # (n_embd, n, el) bytes -> (n_embd, n) values; a cell is a column
                parts.append(self._quantise(v.reshape(v.shape[0], -1).view(_FLOAT_TYPES[v_type]), axis=0))
            else:
                parts.append(self._quantise(v.view(_FLOAT_TYPES[v_type]), axis=1))
        if any(p is None for p in parts):
            return _stored("non-finite K or V values", payload)
        extra = _geometry_bytes(g)
        head_len = len(payload) - n * g.bytes_per_cell      # chunk header + token ids, kept verbatim
        return b"".join([_SUB.pack(MAGIC, VERSION, MODE_QUANTISED, len(extra)), extra,
                         bytes(memoryview(payload)[:head_len]), *parts])

    def declined(self, encoded: Any) -> str | None:
        return stored_reason(encoded)

    @staticmethod
    def _quantise(x: np.ndarray, axis: int) -> bytes | None:
        if not np.isfinite(x).all():
            return None
        scales, q = quantise_rows(x, axis)
        return scales.tobytes() + q.tobytes()

    def decode(self, data: Any, meta: CodecMeta | None = None) -> bytes:
        try:
            return self._decode(memoryview(data).cast("B"))
        except (struct.error, ValueError) as error:    # LayoutError is a ValueError
            raise CorruptObject(f"int8: {error}") from error

    def _decode(self, buf: memoryview) -> bytes:
        from kvbridge.formats.llama_chunks import CHUNK_MAGIC, _CHUNK_HEADER

        magic, version, mode, extra_len = _SUB.unpack_from(buf, 0)
        if magic != MAGIC or version != VERSION or mode not in (MODE_QUANTISED, MODE_STORED):
            raise ValueError("not an int8 object of a version this KVBridge reads")
        at = _SUB.size + extra_len
        if mode == MODE_STORED:
            return bytes(buf[at:])
        g = _read_geometry(buf[_SUB.size:at])
        chunk_magic, n, n_ids, digest = _CHUNK_HEADER.unpack_from(buf, at)
        if chunk_magic != CHUNK_MAGIC or n != n_ids or n == 0 or digest != g.digest():
            raise ValueError("chunk header does not match the recorded geometry")
        head_len = _CHUNK_HEADER.size + 4 * n
        out = np.empty(head_len + n * g.bytes_per_cell, np.uint8)
        out[:head_len] = np.frombuffer(buf, np.uint8, head_len, at)
        at += head_len
        put = head_len
        shapes = [((n, row // _FLOAT_TYPES[t].itemsize), 1, t) for t, row in zip(g.k_types, g.k_rows)]
        for t, row, embd in zip(g.v_types, g.v_rows, g.v_embds):
            width = row // _FLOAT_TYPES[t].itemsize
            shapes.append(((embd, n), 0, t) if g.v_trans else ((n, width), 1, t))
        for shape, axis, t in shapes:
            scales = np.frombuffer(buf, "<f4", n, at)
            at += 4 * n
            count = shape[0] * shape[1]
            q = np.frombuffer(buf, np.int8, count, at).reshape(shape)
            at += count
            values = dequantise_rows(scales, q, axis, _FLOAT_TYPES[t])
            out[put:put + values.nbytes] = values.reshape(-1).view(np.uint8)
            put += values.nbytes
        if at != len(buf):
            raise ValueError(f"{len(buf) - at} unexpected trailing bytes")
        return out.tobytes()
