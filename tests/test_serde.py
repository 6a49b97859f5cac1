"""KV codecs (kvbridge.store.serde): lossless round trips, int8's error bound, the frame's checks.

Real chunk objects come from the embedded model (a short prompt, one 32-cell chunk); bf16,
quantised and non-transposed layouts are built synthetically, since the model makes only f16
with transposed V here.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import needs_model
from kvbridge.errors import BadSettings
from kvbridge.formats.llama_state import KVGeometry, ParsedState, decode_chunk, encode_chunk, parse_state
from kvbridge.store.objects import CorruptObject
from kvbridge.store.serde import (
    Codec,
    CodecMeta,
    CodecOptions,
    UnknownCodecError,
    base,
    codec_names,
    get_codec,
    pack,
    read_frame,
    register_codec,
    unpack,
)
from kvbridge.store.serde.int8 import quantise_rows, stored_reason

CHUNK_CELLS = 32
# rounding to the nearest of 127 steps (half a step: absmax/254), then to f16 (2**-11 relative)
INT8_BOUND = 1 / 254 + 2 ** -11
LOSSLESS = ["raw", "zstd"]


@pytest.fixture(autouse=True)
def codec_registry():
    """A fake codec a test registers is gone after it."""
    codec_names()
    saved = dict(base._CODECS)
    yield
    base._CODECS.clear()
    base._CODECS.update(saved)


@pytest.fixture(scope="module")
def real_chunk(tmp_path_factory):
    """(chunk payload, geometry) of the first 32 cells of a real state from the embedded model."""
    import dataclasses

    from kvbridge.backends import make_backend
    from kvbridge.backends.base import EngineReport, Prompt
    from kvbridge.settings import Settings

    settings = dataclasses.replace(Settings(), ctx_size=256, l2_dir=str(tmp_path_factory.mktemp("l2")))
    backend = make_backend("llamacpp", settings)
    backend.start()
    try:
        tokens = backend.tokenize("The quick brown fox jumps over the lazy dog. " * 4)
        for _ in backend.generate(Prompt(text="", tokens=tuple(tokens)), n_predict=1, temperature=0.0,
                                  use_native_cache=False, report=EngineReport()):
            pass
        parsed = parse_state(bytes(backend.save_state().data))
    finally:
        backend.stop()
    return encode_chunk(parsed, 0, CHUNK_CELLS, tokens[:CHUNK_CELLS]), parsed.geometry


def synthetic_chunk(k_type: int = 1, v_type: int = 1, v_trans: int = 0, n: int = 8, n_layer: int = 2):
    """A chunk payload of random KV in any layout: 2 heads x 8 dims, el bytes per element."""
    rng = np.random.default_rng(7)
    el = {0: 4, 1: 2, 30: 2, 8: 1}
    embd = 16
    k_rows = tuple(embd * el[k_type] for _ in range(n_layer))
    v_rows = tuple(embd * el[v_type] for _ in range(n_layer))
    g = KVGeometry(v_trans, n_layer, (k_type,) * n_layer, k_rows, (v_type,) * n_layer, v_rows,
                   (el[v_type] if v_trans else 0,) * n_layer, (embd if v_trans else 0,) * n_layer)

    def values(count: int, type_id: int) -> np.ndarray:
        """`count` elements as bytes: normal floats for f32/f16, any bytes for bf16 and q8_0."""
        if type_id not in (0, 1):
            return rng.integers(0, 256, count * el[type_id], dtype=np.uint8)
        return rng.normal(0, 2, count).astype("<f4" if type_id == 0 else "<f2").view(np.uint8)

    k = [values(n * embd, k_type).reshape(n, -1) for _ in range(n_layer)]
    v = [values(n * embd, v_type).reshape((embd, n, el[v_type]) if v_trans else (n, -1)) for _ in range(n_layer)]
    state = ParsedState(g, 0, n, k, v)
    return encode_chunk(state, 0, n, list(range(100, 100 + n))), g


def _floats(view, geometry: KVGeometry):
    """Per layer (values, cell axis) pairs of a decoded chunk: K rows, then V (cells as columns if transposed)."""
    dtypes = {0: "<f4", 1: "<f2"}
    out = [(k.view(dtypes[t]).astype(np.float32), 0) for t, k in zip(geometry.k_types, view.k)]
    for t, v in zip(geometry.v_types, view.v):
        if geometry.v_trans:
            out.append((v.reshape(v.shape[0], -1).view(dtypes[t]).astype(np.float32), 1))
        else:
            out.append((v.view(dtypes[t]).astype(np.float32), 0))
    return out


def _worst_error(original: bytes, restored: bytes, geometry: KVGeometry) -> float:
    """The largest |x - x'| / absmax of x's row (a row: one cell's K or V values in one layer)."""
    worst = 0.0
    before, after = (_floats(decode_chunk(data, geometry), geometry) for data in (original, restored))
    pairs = zip(before, after)
    for (x, axis), (y, _) in pairs:
        absmax = np.abs(x).max(axis=1 - axis)
        err = np.abs(x - y).max(axis=1 - axis)
        worst = max(worst, float((err / np.where(absmax > 0, absmax, 1)).max()))
    return worst


@needs_model
@pytest.mark.parametrize("name", LOSSLESS)
def test_lossless_codecs_round_trip_a_real_chunk_bit_exact(real_chunk, name):
    payload, geometry = real_chunk
    framed = pack(name, payload, CodecMeta("chunk", geometry))
    assert unpack(framed) == (name, payload)
    assert not read_frame(framed).lossy


@needs_model
@pytest.mark.parametrize("name", ["zstd", "int8"])
def test_zstd_and_int8_make_real_kv_smaller(real_chunk, name):
    payload, geometry = real_chunk
    ratio = len(payload) / len(pack(name, payload, CodecMeta("chunk", geometry)))
    assert ratio > 1.0, f"{name} ratio {ratio:.3f}"
    if name == "int8":
        assert ratio > 1.8     # f16 -> int8 plus one f32 scale per 192-value row


@needs_model
def test_int8_round_trip_of_a_real_chunk_keeps_layout_and_bounds_the_error(real_chunk):
    payload, geometry = real_chunk
    assert geometry.v_trans == 1                 # the model's layout here: transposed V
    framed = pack("int8", payload, CodecMeta("chunk", geometry))
    assert read_frame(framed).lossy and stored_reason(read_frame(framed).encoded) is None
    name, restored = unpack(framed)
    assert name == "int8" and len(restored) == len(payload)
    head = 32 + 4 * CHUNK_CELLS                  # chunk header and token ids: untouched
    assert restored[:head] == payload[:head]
    assert restored != payload
    worst = _worst_error(payload, restored, geometry)
    assert worst <= INT8_BOUND, f"max |error| is {worst:.5f} of the row's absmax"


@pytest.mark.parametrize("k_type,v_type,v_trans", [(1, 1, 0), (1, 1, 1), (0, 0, 0), (0, 0, 1), (1, 0, 1)])
def test_int8_quantises_f16_and_f32_in_both_v_layouts(k_type, v_type, v_trans):
    payload, geometry = synthetic_chunk(k_type, v_type, v_trans)
    name, restored = unpack(pack("int8", payload, CodecMeta("tail", geometry)))
    assert len(restored) == len(payload) and restored[:32 + 4 * 8] == payload[:32 + 4 * 8]
    assert _worst_error(payload, restored, geometry) <= INT8_BOUND


@pytest.mark.parametrize("k_type,v_type,why", [(30, 30, "bf16"), (8, 8, "q8_0 is quantised already"),
                                               (1, 8, "V cache type q8_0")])
def test_int8_stores_bf16_and_quantised_kv_losslessly_and_says_why(k_type, v_type, why):
    payload, geometry = synthetic_chunk(k_type, v_type, v_trans=1)
    framed = pack("int8", payload, CodecMeta("chunk", geometry))
    assert why in stored_reason(read_frame(framed).encoded)
    assert unpack(framed) == ("int8", payload)


@pytest.mark.parametrize("meta,why", [(None, "no KV geometry"), (CodecMeta("snapshot", None), "not a chunk payload"),
                                      ("snapshot", "not a chunk payload"), ("other-geometry", "not a chunk of this")])
def test_int8_stores_what_is_not_a_chunk_losslessly(meta, why):
    payload, geometry = synthetic_chunk()
    if meta == "snapshot":
        meta = CodecMeta("snapshot", geometry)
    elif meta == "other-geometry":
        meta = CodecMeta("chunk", synthetic_chunk(n_layer=3)[1])
    framed = pack("int8", payload, meta)
    assert why in stored_reason(read_frame(framed).encoded)
    assert unpack(framed)[1] == payload


def test_int8_stores_non_finite_kv_losslessly():
    payload, geometry = synthetic_chunk(k_type=1)
    damaged = bytearray(payload)
    damaged[32 + 4 * 8: 32 + 4 * 8 + 2] = np.array([np.inf], "<f2").tobytes()
    framed = pack("int8", bytes(damaged), CodecMeta("chunk", geometry))
    assert "non-finite" in stored_reason(read_frame(framed).encoded)
    assert unpack(framed)[1] == bytes(damaged)


def test_quantise_rows_golden_case():
    scales, q = quantise_rows(np.array([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]], np.float32), axis=1)
    assert np.allclose(scales, [2 / 127, 0.0])
    assert q.tolist() == [[64, -127, 32], [0, 0, 0]]     # 63.5 rounds to the even 64; a zero row stays 0


@pytest.mark.parametrize("damage", ["payload_bit", "name", "magic", "version", "truncate", "trailing", "decoded_len"])
def test_a_damaged_frame_is_corrupt(damage):
    payload, geometry = synthetic_chunk()
    data = bytearray(pack("zstd", payload, CodecMeta("chunk", geometry)))
    if damage == "payload_bit":
        data[-5] ^= 0x10
    elif damage == "name":
        data[60] ^= 0x01          # inside "zstd": "zsud" is no codec, but the checksum fails first
    elif damage == "magic":
        data[0] ^= 0xFF
    elif damage == "version":
        data[8] = 9
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "trailing":
        data += b"\0"
    elif damage == "decoded_len":
        data[12] ^= 0x01
    with pytest.raises(CorruptObject):
        unpack(bytes(data))


def test_a_frame_whose_codec_decodes_to_another_length_is_corrupt():
    @register_codec
    class Short(Codec):
        name = "short"

        def encode(self, payload, meta=None):
            return bytes(payload)

        def decode(self, data, meta=None):
            return bytes(data)[:-1]

    with pytest.raises(CorruptObject, match="decoded"):
        unpack(pack("short", b"abcdef"))


def test_an_unknown_codec_name_is_a_clear_error_listing_the_known_ones():
    with pytest.raises(UnknownCodecError) as caught:
        get_codec("lz4", setting="KVB_L2_SERDE")
    assert isinstance(caught.value, BadSettings)
    assert str(caught.value) == "unknown KV codec 'lz4' (from KVB_L2_SERDE); known codecs: int8, raw, zstd"


def test_a_frame_from_a_codec_this_reader_lacks_is_corrupt():
    @register_codec
    class Plugin(Codec):
        name = "plugin"

        def encode(self, payload, meta=None):
            return bytes(payload)[::-1]

        def decode(self, data, meta=None):
            return bytes(data)[::-1]

    framed = pack("plugin", b"kv bytes")
    assert unpack(framed) == ("plugin", b"kv bytes")
    base.unregister_codec("plugin")
    with pytest.raises(CorruptObject, match="plugin"):
        unpack(framed)


def test_codec_names_are_checked_and_not_taken_twice():
    class Bad(Codec):
        name = "Has Spaces"

    with pytest.raises(ValueError):
        register_codec(Bad)

    class Clash(Codec):
        name = "raw"

    with pytest.raises(ValueError, match="already registered"):
        register_codec(Clash)


def test_zstd_level_comes_from_the_options_and_is_checked():
    payload = bytes(range(256)) * 64
    fast, small = (pack(get_codec("zstd", CodecOptions(zstd_level=lvl)), payload) for lvl in (1, 19))
    assert unpack(fast)[1] == unpack(small)[1] == payload
    with pytest.raises(BadSettings, match="zstd level"):
        get_codec("zstd", CodecOptions(zstd_level=99))
