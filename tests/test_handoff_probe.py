"""The handoff probe (issue 47, deliverable 3): its synthetic state is a valid layout, its "layout" column writes
the bytes where llama.cpp's set_data puts them, and on the real engine set_data takes the whole state."""
from __future__ import annotations

import numpy as np
import pytest

from kvbridge.bench.probes.handoff_probe import (COLUMNS, SERVER_COLUMNS, EngineLayout, main, probe_model,
                                                 probe_server, synthetic_state)
from kvbridge.formats.llama_state import KVGeometry, parse_state
from conftest import needs_llama_server_and_model

TRANSPOSED = KVGeometry(1, 2, (1, 1), (8, 12), (1, 1), (8, 12), (2, 2), (4, 6))
PLAIN = KVGeometry(0, 2, (1, 1), (8, 12), (1, 1), (6, 10), (0, 0), (0, 0))


@pytest.mark.parametrize("geometry", [TRANSPOSED, PLAIN], ids=["v-transposed", "v-rows"])
def test_the_synthetic_state_parses_as_the_layout_set_data_reads(geometry):
    state = synthetic_state(geometry, 37, seed=3)
    parsed = parse_state(bytes(state), geometry.n_layer)
    assert parsed.n_cells == 37 and parsed.geometry == geometry
    assert any(layer.any() for layer in parsed.k)   # random bytes, not a zeroed buffer


@pytest.mark.parametrize("geometry", [TRANSPOSED, PLAIN], ids=["v-transposed", "v-rows"])
def test_the_layout_column_writes_each_byte_where_set_data_puts_it(geometry):
    n, kv_size = 37, 64
    parsed = parse_state(bytes(synthetic_state(geometry, n, seed=5)), geometry.n_layer)
    flat = np.concatenate([layer.reshape(-1) for layer in parsed.k] + [layer.reshape(-1) for layer in parsed.v])
    layout = EngineLayout(geometry, kv_size, n)
    layout.write(flat)
    for il in range(geometry.n_layer):
        assert np.array_equal(layout.k[il][:n], parsed.k[il])
        if geometry.v_trans:   # llama.cpp: dimension j of cell i at (j * kv_size + i) * el
            embd, el = geometry.v_embds[il], geometry.v_els[il]
            assert np.array_equal(layout.v[il][:, :n * el].reshape(embd, n, el), parsed.v[il])
            assert (layout.v[il][:, n * el:] == 1).all()   # the rest of each row untouched
        else:
            assert np.array_equal(layout.v[il][:n], parsed.v[il])
        assert (layout.k[il][n:] == 1).all()


def test_on_the_real_engine_set_data_takes_the_whole_state(make_settings):
    result = probe_model(make_settings(), "smollm2-135m", 300, reps=2, loop_s=0.2, say=lambda line: None)
    assert set(result.times) == set(COLUMNS) and all(len(v) == 2 for v in result.times.values())
    assert result.state_bytes > 300 * 1000 and all(t > 0 for v in result.times.values() for t in v)
    assert "set_data beyond the bytes" in result.line()


@pytest.mark.parametrize("marks", [pytest.param(0, marks=needs_llama_server_and_model())], ids=["live"])
def test_through_llama_server_the_restore_file_is_restored_again(make_settings, marks):
    result = probe_server(make_settings(), "smollm2-135m", 300, reps=2)
    assert set(result.times) == set(SERVER_COLUMNS)
    # the server's own restore time came back with every restore, and the client waited at least that long
    assert all(0 < ms <= wall for ms, wall in zip(result.times["server_ms"], result.times["server_restore"]))


def test_bad_arguments_are_named(capsys):
    with pytest.raises(SystemExit):
        main(["--models", "no-such-model"])
    assert "--models" in capsys.readouterr().err
