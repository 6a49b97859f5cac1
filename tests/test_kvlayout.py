"""llama.cpp's sequence-state layout, on real states from the embedded model: parse, split, assemble."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from conftest import needs_model
from kvbridge.backends import make_backend
from kvbridge.backends.base import EngineReport, Prompt
from kvbridge.formats.llama_chunks import assemble_state, decode_chunk, encode_chunk
from kvbridge.formats.llama_state import LayoutError, parse_state

pytestmark = [needs_model, pytest.mark.live]


@pytest.fixture(scope="module")
def real_state(tmp_path_factory):
    import dataclasses

    from kvbridge.settings import Settings

    settings = dataclasses.replace(Settings(), ctx_size=1024, l2_dir=str(tmp_path_factory.mktemp("l2")))
    backend = make_backend("llamacpp", settings)
    backend.start()
    tokens = backend.tokenize("The quick brown fox jumps over the lazy dog. " * 6)
    for _ in backend.generate(Prompt(text="", tokens=tuple(tokens)), n_predict=1, temperature=0.0,
                              use_native_cache=False, report=EngineReport()):
        pass
    state = bytes(backend.save_state().data)
    backend.stop()
    return state, tokens


def test_parse_matches_the_model(real_state):
    data, tokens = real_state
    parsed = parse_state(data)
    assert parsed.n_cells == len(tokens)
    g = parsed.geometry
    assert g.n_layer == 30 and g.v_trans == 1            # SmolLM2-135M, flash attention off
    assert g.bytes_per_cell == 30 * (384 + 384)          # 3 KV heads x 64 dims x f16, K and V


def test_split_and_assemble_round_trip_is_byte_identical(real_state):
    data, tokens = real_state
    parsed = parse_state(data)
    n = parsed.n_cells
    cuts = [0, 16, 32, 48, n]
    views = [decode_chunk(encode_chunk(parsed, a, b, tokens[a:b]), parsed.geometry) for a, b in zip(cuts, cuts[1:])]
    rebuilt = assemble_state(parsed.geometry, [(v, v.n_cells) for v in views])
    assert bytes(rebuilt) == data


def test_assemble_a_trimmed_prefix_is_a_valid_shorter_state(real_state):
    data, tokens = real_state
    parsed = parse_state(data)
    a = decode_chunk(encode_chunk(parsed, 0, 16, tokens[:16]), parsed.geometry)
    b = decode_chunk(encode_chunk(parsed, 16, parsed.n_cells, tokens[16:]), parsed.geometry)
    short = parse_state(assemble_state(parsed.geometry, [(a, 16), (b, 5)]))
    assert short.n_cells == 21
    assert np.array_equal(short.k[3], parsed.k[3][:21])
    assert np.array_equal(short.v[7], parsed.v[7][:, :21])


@pytest.mark.parametrize("damage", ["truncate", "magic", "trailing", "positions"])
def test_damaged_states_are_rejected(real_state, damage):
    data = bytearray(real_state[0])
    if damage == "truncate":
        data = data[:-7]
    elif damage == "magic":
        data[0] ^= 0xFF
    elif damage == "trailing":
        data += b"\0\0\0\0"
    elif damage == "positions":
        struct.pack_into("<i", data, 16 + 12 * 3, 99)   # cell 3 claims position 99
    with pytest.raises(LayoutError):
        parse_state(bytes(data))


def test_chunk_from_another_geometry_is_rejected(real_state):
    data, tokens = real_state
    parsed = parse_state(data)
    payload = encode_chunk(parsed, 0, 16, tokens[:16])
    other = parsed.geometry.__class__(**{**parsed.geometry.__dict__, "n_layer": 29})
    with pytest.raises(LayoutError):
        decode_chunk(payload, other)
    with pytest.raises(LayoutError):
        decode_chunk(payload[:-1], parsed.geometry)
