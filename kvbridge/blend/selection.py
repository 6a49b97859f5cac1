"""The selection pass of KVB_BLEND_RECOMPUTE_AT=deviation: CacheBlend's rule on llama.cpp. Which reused tokens
to recompute is decided by how far their stored KV deviates from what the prompt itself computes in an early
layer.

Place in the flow: BlendRunner.place (kvbridge.blend.runner) has placed every stored passage whole -> the
**selection pass**: the prompt up to its last placed passage is decoded in a context of its own (this
module's, on the same model file; the instruction and the first passage, which stand where they were
computed, are restored there from their stored KV, not decoded) whose graph stops after the first
KVB_BLEND_SELECT_LAYERS layers: a ggml
eval callback reads each layer's fresh K (after RoPE) and V as llama.cpp computes them, and ends the graph at
the next layer's first node, so the pass costs about layers / n_layer of a prefill -> **deviation** per
reused token: |fresh - stored| / |fresh| of K (the stored K rotated by the passage's shift, as llama.cpp's K
shift rotates it) plus that of V, at the last selected layer -> the runner recomputes the most deviant
tokens at full depth, up to KVB_BLEND_RECOMPUTE_RATIO of the reused tokens, and the gate reads the
deviation left in the tokens it keeps (`Selection.drift`).

Why a context of its own: a pass stopped by the callback leaves its cells' later layers unwritten (llama_decode
still reports success), so it may not share cells with an answer; and an eval callback set on the answer's
context would be called for every node of every decode. Here the pass's cells are dropped after each prompt.

Calibrated once per pass, on a short probe decoded at position 0 and again further on: which layer of the
stored state holds the compared layer (a sliding-window model's state writes its global layers' cache first,
then the sliding-window layers': Gemma 3's layer 2 is not the state's third), and which RoPE base rotates it
(Gemma 3's sliding-window layers rotate with base 10,000, its global ones with the GGUF's 1,000,000). Layer 0's
K depends on the token and its position alone, so the probe's K at the later position must equal its K at 0
rotated here. Where it does not (a RoPE this module does not rotate: M-RoPE, YaRN, frequency factors), K is
left out and V alone ranks the tokens; the selection says so in its `note`.
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvbridge.backends.llama_context import BATCH_TOKENS, LlamaContext
from kvbridge.errors import KVBridgeError
from kvbridge.formats.llama_chunks import assemble_state
from kvbridge.formats.llama_state import KVGeometry
from kvbridge.settings import Settings

CELL_STEP = 512         # the pass's context grows to the prompts it has read, in these steps, up to KVB_CTX_SIZE
ROTATION_CHECK = 0.02   # layer 0's K of a shifted passage, rotated, must match the fresh one within this (f16: ~1e-3)
LAYER_MATCH = 0.01      # a stored layer holds the probe's fresh K and V within f16 rounding (~5e-4)
PROBE = "The selection pass reads each layer's keys and values as llama.cpp computes them, then stops."
PROBE_SHIFT = 97        # the probe's second position: far enough that a wrong base rotates visibly
FLOAT_TYPES = {0: np.float32, 1: np.float16}   # ggml type ids of the KV types a selection (and the probe) reads


class SelectionUnavailable(KVBridgeError):
    """The selection pass cannot read this model's K and V; the runner falls back to a fixed rule and says so."""


class GgmlTensor(ctypes.Structure):
    """struct ggml_tensor as the pinned ggml lays it out (include/ggml.h): what the eval callback reads."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


def tensor_array(t: GgmlTensor, n_tokens: int) -> np.ndarray:
    """A float32 tensor of the graph as (n_tokens, row), copied out of ggml's compute buffer."""
    if t.type != 0:
        raise SelectionUnavailable(f"graph tensor {t.name.decode(errors='replace')} is ggml type {t.type}, not f32")
    ne, nb = list(t.ne), list(t.nb)
    span = sum((n - 1) * s for n, s in zip(ne, nb)) + 4
    flat = np.ctypeslib.as_array((ctypes.c_float * (span // 4)).from_address(t.data))
    arr = np.lib.stride_tricks.as_strided(flat, shape=tuple(reversed(ne)), strides=tuple(reversed(nb)))
    return np.array(arr, dtype=np.float32).reshape(n_tokens, -1)


def _layer_of(name: bytes) -> int | None:
    """The layer a node belongs to by llama.cpp's naming ("Kcur-3", "attn_norm-12"); None for the others."""
    head, sep, tail = name.rpartition(b"-")
    return int(tail) if sep and head and tail.isdigit() else None


class _Capture:
    """The eval callback's state for one ubatch: the wanted tensors' data, and the graph stopped after layer
    `last` (at the first node of a later layer)."""

    def __init__(self, last: int) -> None:
        self.last = last
        self.compared = {b"Kcur-%d" % last, b"Vcur-%d" % last}
        self.want = self.compared   # the calibration's probe also wants layer 0's K (SelectionPass.calibration)
        self.n_tokens = 0
        self.got: dict[bytes, np.ndarray] = {}
        self.stopped = False
        self.error: Exception | None = None

    def reset(self, n_tokens: int) -> None:
        self.n_tokens, self.got, self.stopped, self.error = n_tokens, {}, False, None

    def __call__(self, t_ptr, ask, _user) -> bool:
        try:
            t = GgmlTensor.from_address(t_ptr)
            name = t.name
            layer = _layer_of(name)
            if ask:
                return name in self.want or (layer is not None and layer > self.last)
            if layer is not None and layer > self.last:
                self.stopped = True
                return False     # ends the graph here: later layers stay uncomputed in this context
            # a name may be given twice (K before and after RoPE): the later node, the one the cache stores, wins
            self.got[name] = tensor_array(t, self.n_tokens)
            return True
        except Exception as exc:   # an exception cannot cross into C: stop the graph and report it
            self.error = exc
            return False


@dataclass(frozen=True)
class Rope:
    """How llama.cpp rotates K by position on this model (NORM: adjacent pairs; NEOX: halves)."""

    neox: bool
    n_rot: int
    head_dim: int
    freq_base: float
    freq_scale: float
    swa_base: float = 10000.0   # a sliding-window layer's base (llama.cpp's for Gemma 3 unless the GGUF says)

    def bases(self) -> list[tuple[float, float]]:
        """The (base, scale) pairs a layer may rotate with: the model's, or a sliding-window layer's (unscaled)."""
        return list(dict.fromkeys([(self.freq_base, self.freq_scale), (self.swa_base, 1.0),
                                   (self.swa_base, self.freq_scale)]))

    def rotate(self, k: np.ndarray, delta: int, base: tuple[float, float] | None = None) -> np.ndarray:
        """K rows (n, n_head_kv * head_dim) rotated by `delta` positions, as llama.cpp's K shift does; `base`:
        a layer's own (freq_base, freq_scale) where it differs from the model's (a sliding-window layer's)."""
        if not delta:
            return k
        freq_base, freq_scale = base or (self.freq_base, self.freq_scale)
        n = k.shape[0]
        heads = k.reshape(n, -1, self.head_dim).copy()
        half = self.n_rot // 2
        theta = freq_scale * delta * freq_base ** (-2.0 * np.arange(half) / self.n_rot)
        cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
        if self.neox:
            x0, x1 = heads[..., :half].copy(), heads[..., half:self.n_rot].copy()
            heads[..., :half], heads[..., half:self.n_rot] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
        else:
            x0, x1 = heads[..., 0:self.n_rot:2].copy(), heads[..., 1:self.n_rot:2].copy()
            heads[..., 0:self.n_rot:2], heads[..., 1:self.n_rot:2] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
        return heads.reshape(n, -1)


def rope_of(ctx: LlamaContext) -> Rope | None:
    """The model's RoPE when it is one this module rotates (NORM or NEOX); None otherwise (V alone ranks)."""
    import llama_cpp

    model = ctx.model
    kind = llama_cpp.llama_model_rope_type(model)
    if kind not in (llama_cpp.LLAMA_ROPE_TYPE_NORM, llama_cpp.LLAMA_ROPE_TYPE_NEOX):
        return None

    def meta(key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    arch = meta("general.architecture") or "llama"
    head_dim = int(meta(f"{arch}.attention.key_length")
                   or llama_cpp.llama_model_n_embd(model) // llama_cpp.llama_model_n_head(model))
    swa_base = meta(f"{arch}.rope.freq_base_swa")
    return Rope(neox=kind == llama_cpp.LLAMA_ROPE_TYPE_NEOX,
                n_rot=int(meta(f"{arch}.rope.dimension_count") or head_dim), head_dim=head_dim,
                freq_base=float(meta(f"{arch}.rope.freq_base") or 10000.0),
                freq_scale=float(llama_cpp.llama_model_rope_freq_scale_train(model)),
                swa_base=float(swa_base) if swa_base else 10000.0)


@dataclass
class PlacedPassage:
    """A stored passage placed whole: where it stands, where it was computed, and its stored cells."""

    start: int
    end: int
    computed_at: int
    view: object      # kvbridge.formats.llama_chunks.ChunkView


@dataclass(frozen=True)
class _Calibration:
    index: dict[int, int]                                  # model layer -> the stored state's layer holding it
    rotation: dict[int, tuple[float, float]] | None        # model layer -> (freq_base, freq_scale); None: V alone


@dataclass
class Selection:
    positions: np.ndarray      # prompt positions to recompute, ascending
    scores: np.ndarray         # the deviation of every reused token, passages in order
    drift: float               # mean deviation left in the reused tokens kept (the selected count as 0)
    pass_ms: float             # the selection pass (the stopped prefill)
    score_ms: float            # the deviations and the choice
    with_k: bool               # K took part (else V alone)
    note: str = ""


def _rows(arrays: list[np.ndarray], layer: int, type_id: int, n: int, v_trans: bool = False) -> np.ndarray:
    raw = arrays[layer]
    if v_trans:   # (n_embd, n_cells, el) -> (n_cells, n_embd * el)
        raw = np.ascontiguousarray(raw.transpose(1, 0, 2)).reshape(n, -1)
    return raw.view(FLOAT_TYPES[type_id]).astype(np.float32)


def relative_deviation(stored: np.ndarray, fresh: np.ndarray) -> np.ndarray:
    """Per row: |stored - fresh| / |fresh| (L2 over the whole row)."""
    return np.linalg.norm(stored - fresh, axis=1) / np.maximum(np.linalg.norm(fresh, axis=1), 1e-12)


class SelectionPass:
    """A context of the blend runner's model whose decodes stop after `layers` layers, and the choice it informs."""

    def __init__(self, settings: Settings, geometry: KVGeometry, rope: Rope | None, layers: int) -> None:
        bad = [t for t in (*geometry.k_types, *geometry.v_types) if t not in FLOAT_TYPES]
        if bad:
            raise SelectionUnavailable("the deviation rule reads f16 or f32 KV, and this cache is quantised "
                                       "(KVB_CACHE_TYPE_K / KVB_CACHE_TYPE_V)")
        self.settings = settings
        self.geometry = geometry
        self.rope = rope
        self.layer = max(1, min(layers, geometry.n_layer)) - 1   # the layer compared: the last one computed
        self._capture = _Capture(self.layer)
        import llama_cpp

        self._callback = llama_cpp.ggml_backend_sched_eval_callback(self._capture)
        self.ctx: LlamaContext | None = None
        self._calibrated: _Calibration | SelectionUnavailable | None = None   # a failure is kept too

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.close()
            self.ctx = None

    def _context(self, n_tokens: int) -> LlamaContext:
        if self.ctx is None or self.ctx.n_cells < n_tokens:
            cells = -(-n_tokens // CELL_STEP) * CELL_STEP
            if self.ctx is not None:
                self.ctx.close()
                self.ctx = None
            self.ctx = LlamaContext(self.settings, cells, 1, eval_callback=self._callback)
        return self.ctx

    def _decode(self, ctx: LlamaContext, tokens: Sequence[int], at: int) -> dict[bytes, np.ndarray]:
        """Decode `tokens` at positions at.. of sequence 0 (one ubatch) and return what the callback read."""
        self._capture.reset(len(tokens))
        code = ctx.decode([(int(t), at + i, 0, False) for i, t in enumerate(tokens)])
        if self._capture.error is not None:
            raise SelectionUnavailable(f"the selection pass could not read the graph: {self._capture.error}")
        if code != 0:
            raise SelectionUnavailable(f"llama_decode returned {code} in the selection pass")
        missing = self._capture.want - set(self._capture.got)
        if missing:
            raise SelectionUnavailable("the selection pass found no " + ", ".join(sorted(m.decode() for m in missing))
                                       + " in this model's graph")
        return dict(self._capture.got)

    def calibration(self) -> "_Calibration":
        """Once per pass (PROBE at position 0, then at PROBE_SHIFT): the stored layers that hold model layers 0
        and `layer`, and the (base, scale) each rotates with; rotation None where no candidate reproduces
        llama.cpp's K at the later position (then V alone ranks)."""
        if isinstance(self._calibrated, SelectionUnavailable):
            raise self._calibrated
        if self._calibrated is not None:
            return self._calibrated
        try:
            self._calibrated = self._calibrate()
        except SelectionUnavailable as exc:
            self._calibrated = exc
            raise
        return self._calibrated

    def _calibrate(self) -> "_Calibration":
        from kvbridge.formats.llama_state import parse_state

        ctx = self._context(CELL_STEP)
        probe = ctx.tokenize(PROBE)[:BATCH_TOKENS]
        g, layers = self.geometry, (0, self.layer)
        ctx.seq_rm(0)
        self._capture.want = self._capture.compared | {b"Kcur-0"}
        try:
            at0 = self._decode(ctx, probe, 0)
            state = parse_state(ctx.save_seq(0), window=g.window)
            ctx.seq_rm(0)
            later = self._decode(ctx, probe, PROBE_SHIFT)
        finally:
            ctx.seq_rm(0)
            self._capture.want = self._capture.compared
        n = len(probe)
        index = {}
        for il in layers:
            k, v = at0[b"Kcur-%d" % il], at0[b"Vcur-%d" % il] if il == self.layer else None
            # the stored layer whose K (and V) are this layer's fresh ones, f16-rounded; -1: none
            fits = [j for j in range(g.n_layer) if g.k_rows[j] == k.shape[1] * np.dtype(FLOAT_TYPES[g.k_types[j]]).itemsize
                    and float(np.median(relative_deviation(_rows(state.k, j, g.k_types[j], n), k))) < LAYER_MATCH
                    and (v is None or float(np.median(relative_deviation(
                        _rows(state.v, j, g.v_types[j], n, g.v_trans), v))) < LAYER_MATCH)]
            if len(fits) != 1:
                raise SelectionUnavailable(f"the selection pass found {len(fits)} stored layers holding layer "
                                           f"{il}'s K and V, not one")
            index[il] = fits[0]
        rotation: dict[int, tuple[float, float]] | None = None
        if self.rope is not None:
            rotation = {}
            for il in layers:
                k0, k1 = at0[b"Kcur-%d" % il], later[b"Kcur-%d" % il]
                # deeper layers carry the rounding of attention at other positions: the best base, checked on layer 0
                best = min(self.rope.bases(), key=lambda b: float(np.median(relative_deviation(
                    self.rope.rotate(k0, PROBE_SHIFT, b), k1))))
                err = float(np.median(relative_deviation(self.rope.rotate(k0, PROBE_SHIFT, best), k1)))
                if err >= (ROTATION_CHECK if il == 0 else 5 * ROTATION_CHECK):
                    rotation = None
                    break
                rotation[il] = best
        return _Calibration(index=index, rotation=rotation)

    def fresh(self, tokens: Sequence[int], prefix: Sequence[PlacedPassage] = ()) -> tuple[int, dict[bytes, np.ndarray]]:
        """The compared layer's K and V of `tokens`, from the position after the
        segments `prefix` (stored where they were computed, so their KV is the prompt's own: restored, not
        decoded); (that position, arrays indexed from it)."""
        ctx = self._context(len(tokens))
        out: dict[bytes, list[np.ndarray]] = {}
        ctx.seq_rm(0)
        start = 0
        try:
            if prefix:
                ctx.load_seq(0, assemble_state(self.geometry, [(p.view, p.view.n_cells) for p in prefix], seq_id=0))
                start = prefix[-1].end
            for lo in range(start, len(tokens), BATCH_TOKENS):
                for name, arr in self._decode(ctx, tokens[lo: lo + BATCH_TOKENS], lo).items():
                    out.setdefault(name, []).append(arr)
        finally:
            ctx.seq_rm(0)
        return start, {name: np.concatenate(parts) for name, parts in out.items()}

    def select(self, tokens: Sequence[int], placed: Sequence[PlacedPassage], count: int,
               prefix: Sequence[PlacedPassage] = ()) -> Selection:
        """The `count` reused tokens of `placed` (shifted passages) whose stored KV deviates most from the
        prompt's own at the compared layer, and the deviation the rest keep. `prefix`: the stored segments
        that stand where they were computed, in order from position 0 (restored in the pass, not decoded)."""
        t0 = time.perf_counter()
        cal = self.calibration()
        prefix = list(prefix) if prefix and prefix[-1].end <= placed[0].start else []
        at, fresh = self.fresh(tokens[: max(p.end for p in placed)], prefix)
        t1 = time.perf_counter()
        g, layer, j = self.geometry, self.layer, cal.index[self.layer]
        k_fresh, v_fresh = fresh[b"Kcur-%d" % layer], fresh[b"Vcur-%d" % layer]
        with_k = cal.rotation is not None
        scores = []
        for p in placed:
            n, lo, hi = p.end - p.start, p.start - at, p.end - at
            dv = relative_deviation(_rows(p.view.v, j, g.v_types[j], n, g.v_trans), v_fresh[lo:hi])
            if with_k:
                stored_k = self.rope.rotate(_rows(p.view.k, j, g.k_types[j], n), p.start - p.computed_at,
                                            cal.rotation[layer])
                dv = dv + relative_deviation(stored_k, k_fresh[lo:hi])
            scores.append(dv)
        score = np.concatenate(scores)
        positions = np.concatenate([np.arange(p.start, p.end) for p in placed])
        count = max(0, min(count, len(score)))
        chosen = np.sort(np.argsort(-score, kind="stable")[:count])
        kept = score.copy()
        kept[chosen] = 0.0
        note = "" if with_k else ("deviation: V alone ranks the tokens (this model's K rotation is not one the "
                                  "selection reproduces)")
        return Selection(positions=positions[chosen], scores=score, drift=float(kept.mean()) if len(kept) else 0.0,
                         pass_ms=(t1 - t0) * 1000, score_ms=(time.perf_counter() - t1) * 1000, with_k=with_k,
                         note=note)


def runs_of(positions: np.ndarray) -> list[tuple[int, int]]:
    """Ascending positions as maximal runs (start, stop) of consecutive ones."""
    out: list[tuple[int, int]] = []
    for p in positions.tolist():
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out
