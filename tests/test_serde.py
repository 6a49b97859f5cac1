"""KV codecs (kvbridge.store.serde): lossless round trips, int8's error bound, and TierCodec, the way
a tier applies its codec (the codec named in ObjectMeta, lossy sticky, declines stored raw).

Real chunk objects come from the embedded model (a short prompt, one 32-cell chunk); bf16,
quantised and non-transposed layouts are built synthetically, since the model makes only f16
with transposed V here. Damage is the tier's to detect (its checked header), so that test writes
a real L2 file.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import needs_model
from kvbridge.errors import BadSettings
from kvbridge.formats.llama_chunks import decode_chunk, encode_chunk
from kvbridge.formats.llama_state import KVGeometry, ParsedState, parse_state
from kvbridge.settings import codecs as codec_table
from kvbridge.settings.codecs import UnknownCodecError, codec_names
from kvbridge.store import DiskTier
from kvbridge.store.objects import CorruptObject, ObjectMeta
from kvbridge.store.serde import (
    Codec,
    CodecMeta,
    CodecOptions,
    TierCodec,
    base,
    get_codec,
    register_codec,
    remember_geometry,
)
from kvbridge.store.serde.int8 import quantise_rows, stored_reason

CHUNK_CELLS = 32
# rounding to the nearest of 127 steps (half a step: absmax/254), then to f16 (2**-11 relative)
INT8_BOUND = 1 / 254 + 2 ** -11
LOSSLESS = ["raw", "zstd"]


@pytest.fixture(autouse=True)
def codec_registry():
    """A fake codec or a geometry a test registers is gone after it."""
    codec_names()
    saved, geometries = dict(codec_table._CODECS), dict(base._GEOMETRIES)
    yield
    codec_table._CODECS.clear()
    codec_table._CODECS.update(saved)
    base._GEOMETRIES.clear()
    base._GEOMETRIES.update(geometries)


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


def object_meta(kind: str = "chunk", lossy: str = "") -> ObjectMeta:
    return ObjectMeta("serde-test", 8, bytes(16), kind=kind, lossy=lossy)


def round_trip(name: str, payload: bytes, meta: CodecMeta | None = None) -> tuple[bytes, bytes]:
    """(encoded, decoded) of `payload` through the codec registered as `name`."""
    codec = get_codec(name)
    encoded = codec.encode(payload, meta)
    return encoded, codec.decode(encoded, meta)


# -- the codecs themselves ---------------------------------------------------------------------

@needs_model
@pytest.mark.parametrize("name", LOSSLESS)
def test_lossless_codecs_round_trip_a_real_chunk_bit_exact(real_chunk, name):
    payload, geometry = real_chunk
    encoded, restored = round_trip(name, payload, CodecMeta("chunk", geometry))
    assert restored == payload
    assert get_codec(name).lossless and get_codec(name).declined(encoded) is None


@needs_model
@pytest.mark.parametrize("name", ["zstd", "int8"])
def test_zstd_and_int8_make_real_kv_smaller(real_chunk, name):
    payload, geometry = real_chunk
    ratio = len(payload) / len(get_codec(name).encode(payload, CodecMeta("chunk", geometry)))
    assert ratio > 1.0, f"{name} ratio {ratio:.3f}"
    if name == "int8":
        assert ratio > 1.8     # f16 -> int8 plus one f32 scale per 192-value row


@needs_model
def test_int8_round_trip_of_a_real_chunk_keeps_layout_and_bounds_the_error(real_chunk):
    payload, geometry = real_chunk
    assert geometry.v_trans == 1                 # the model's layout here: transposed V
    encoded, restored = round_trip("int8", payload, CodecMeta("chunk", geometry))
    assert not get_codec("int8").lossless and stored_reason(encoded) is None
    assert len(restored) == len(payload)
    head = 32 + 4 * CHUNK_CELLS                  # chunk header and token ids: untouched
    assert restored[:head] == payload[:head]
    assert restored != payload
    worst = _worst_error(payload, restored, geometry)
    assert worst <= INT8_BOUND, f"max |error| is {worst:.5f} of the row's absmax"


@pytest.mark.parametrize("k_type,v_type,v_trans", [(1, 1, 0), (1, 1, 1), (0, 0, 0), (0, 0, 1), (1, 0, 1)])
def test_int8_quantises_f16_and_f32_in_both_v_layouts(k_type, v_type, v_trans):
    payload, geometry = synthetic_chunk(k_type, v_type, v_trans)
    encoded, restored = round_trip("int8", payload, CodecMeta("tail", geometry))
    assert stored_reason(encoded) is None
    assert len(restored) == len(payload) and restored[:32 + 4 * 8] == payload[:32 + 4 * 8]
    assert _worst_error(payload, restored, geometry) <= INT8_BOUND


@pytest.mark.parametrize("k_type,v_type,why", [(30, 30, "bf16"), (8, 8, "q8_0 is quantised already"),
                                               (1, 8, "V cache type q8_0")])
def test_int8_stores_bf16_and_quantised_kv_losslessly_and_says_why(k_type, v_type, why):
    payload, geometry = synthetic_chunk(k_type, v_type, v_trans=1)
    encoded, restored = round_trip("int8", payload, CodecMeta("chunk", geometry))
    assert why in stored_reason(encoded) and get_codec("int8").declined(encoded) == stored_reason(encoded)
    assert restored == payload


@pytest.mark.parametrize("meta,why", [(None, "no KV geometry"), (CodecMeta("snapshot", None), "not a chunk payload"),
                                      ("snapshot", "not a chunk payload"), ("other-geometry", "not a chunk of this")])
def test_int8_stores_what_is_not_a_chunk_losslessly(meta, why):
    payload, geometry = synthetic_chunk()
    if meta == "snapshot":
        meta = CodecMeta("snapshot", geometry)
    elif meta == "other-geometry":
        meta = CodecMeta("chunk", synthetic_chunk(n_layer=3)[1])
    encoded, restored = round_trip("int8", payload, meta)
    assert why in stored_reason(encoded)
    assert restored == payload


def test_int8_finds_a_registered_geometry_by_the_chunk_digest():
    payload, geometry = synthetic_chunk()
    assert "no KV geometry" in stored_reason(get_codec("int8").encode(payload, CodecMeta("chunk")))
    remember_geometry(geometry)
    encoded, restored = round_trip("int8", payload, CodecMeta("chunk"))
    assert stored_reason(encoded) is None and len(restored) == len(payload)


def test_int8_stores_non_finite_kv_losslessly():
    payload, geometry = synthetic_chunk(k_type=1)
    damaged = bytearray(payload)
    damaged[32 + 4 * 8: 32 + 4 * 8 + 2] = np.array([np.inf], "<f2").tobytes()
    encoded, restored = round_trip("int8", bytes(damaged), CodecMeta("chunk", geometry))
    assert "non-finite" in stored_reason(encoded)
    assert restored == bytes(damaged)


def test_quantise_rows_golden_case():
    scales, q = quantise_rows(np.array([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]], np.float32), axis=1)
    assert np.allclose(scales, [2 / 127, 0.0])
    assert q.tolist() == [[64, -127, 32], [0, 0, 0]]     # 63.5 rounds to the even 64; a zero row stays 0


def test_an_unknown_codec_name_is_a_clear_error_listing_the_known_ones():
    with pytest.raises(UnknownCodecError) as caught:
        get_codec("lz4", setting="KVB_L2_SERDE")
    assert isinstance(caught.value, BadSettings)
    assert str(caught.value) == "unknown KV codec 'lz4' (from KVB_L2_SERDE); known codecs: int8, raw, zstd"


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
    fast, small = (get_codec("zstd", CodecOptions(zstd_level=level)) for level in (1, 19))
    assert fast.decode(fast.encode(payload)) == small.decode(small.encode(payload)) == payload
    with pytest.raises(BadSettings, match="zstd level"):
        get_codec("zstd", CodecOptions(zstd_level=99))


# -- TierCodec: how a tier applies its codec -----------------------------------------------------

def test_raw_passes_the_very_same_object_through():
    blob = bytearray(b"kv bytes" * 100)
    codec = TierCodec()
    assert codec.name == "raw" and codec.label() == "raw"
    stored, meta = codec.encode(blob, object_meta())
    assert stored is blob and (meta.codec, meta.lossy) == ("raw", "")
    assert TierCodec.decode(stored, meta) is blob


def test_zstd_names_itself_in_the_metadata_and_is_not_lossy():
    blob = bytes(range(256)) * 64
    stored, meta = TierCodec.named("zstd", zstd_level=3, setting="KVB_L2_SERDE").encode(blob, object_meta())
    assert (meta.codec, meta.lossy) == ("zstd", "") and len(stored) < len(blob)
    assert TierCodec.decode(stored, meta) == blob


def test_an_unknown_tier_codec_names_its_setting():
    with pytest.raises(UnknownCodecError, match="KVB_L3_SERDE"):
        TierCodec.named("lz4", setting="KVB_L3_SERDE")


@needs_model
def test_int8_quantises_a_real_chunk_whose_geometry_the_engine_registered(real_chunk):
    payload, geometry = real_chunk
    remember_geometry(geometry)                  # what CachedEngine does when it opens its namespace
    codec = TierCodec.named("int8")
    assert codec.label() == "int8 (lossy)"
    stored, meta = codec.encode(payload, object_meta())
    assert (meta.codec, meta.lossy) == ("int8", "int8") and not codec.declined
    assert len(stored) < len(payload)
    restored = TierCodec.decode(stored, meta)
    assert len(restored) == len(payload) and _worst_error(payload, restored, geometry) <= INT8_BOUND


@pytest.mark.parametrize("k_type,why", [(30, "bf16"), (8, "quantised already")])
def test_int8_declines_what_it_cannot_quantise_and_stores_it_raw(k_type, why):
    payload, geometry = synthetic_chunk(k_type, k_type, v_trans=1)
    remember_geometry(geometry)                  # declined for its cache type, not for a missing geometry
    codec = TierCodec.named("int8")
    for _ in range(2):
        stored, meta = codec.encode(payload, object_meta())
        assert stored is payload and (meta.codec, meta.lossy) == ("raw", "")
    [(reason, count)] = codec.declined.items()
    assert why in reason and count == 2
    assert TierCodec.decode(stored, meta) == payload


@pytest.mark.parametrize("name", LOSSLESS)
def test_lossy_is_sticky_through_a_lossless_codec(name):
    """KV that once went through int8 stays marked lossy when a lossless tier stores it again."""
    stored, meta = TierCodec.named(name).encode(b"kv bytes" * 100, object_meta(lossy="int8"))
    assert (meta.codec, meta.lossy) == (name, "int8")


def test_an_object_written_by_a_codec_this_reader_lacks_is_corrupt_and_named():
    @register_codec
    class Plugin(Codec):
        name = "plugin"

        def encode(self, payload, meta=None):
            return bytes(payload)[::-1]

        def decode(self, data, meta=None):
            return bytes(data)[::-1]

    stored, meta = TierCodec.named("plugin").encode(b"kv bytes", object_meta())
    assert meta.codec == "plugin" and TierCodec.decode(stored, meta) == b"kv bytes"
    base.unregister_codec("plugin")
    with pytest.raises(CorruptObject, match="plugin"):
        TierCodec.decode(stored, meta)


@pytest.mark.parametrize("name", ["zstd", "int8"])
@pytest.mark.parametrize("damage", ["empty", "garbage", "truncated"])
def test_bytes_a_codec_cannot_decode_are_corrupt(name, damage):
    """Every codec's decode raises CorruptObject, never another error, for bytes it cannot read."""
    payload, geometry = synthetic_chunk()
    remember_geometry(geometry)
    stored, meta = TierCodec.named(name).encode(payload, object_meta())
    assert meta.codec == name
    stored = {"empty": b"", "garbage": b"\x5a" * 64, "truncated": stored[:-7]}[damage]
    with pytest.raises(CorruptObject):
        TierCodec.decode(stored, meta)


@pytest.mark.parametrize("where", ["first", "last"])
def test_damaged_stored_bytes_in_an_l2_file_are_corrupt_on_get(tmp_path, where):
    """The tier's header checksum covers the stored (encoded) bytes: damage never reaches zstd."""
    tier = DiskTier(tmp_path, 1 << 20, codec=TierCodec.named("zstd"))
    key, blob = b"k" * 32, bytes(range(256)) * 64
    assert tier.put(key, blob, object_meta())
    assert tier.meta(key).codec == "zstd" and tier.get(key)[0] == blob
    path = tier.path_for(key)
    data = bytearray(path.read_bytes())
    data[len(data) - tier.size(key) if where == "first" else -1] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptObject, match="checksum"):
        tier.get(key)
    assert not tier.contains(key)
