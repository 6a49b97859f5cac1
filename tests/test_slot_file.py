"""llama-server slot files <-> in-process sequence state: hand-built golden bytes and round trips."""
import struct

import numpy as np
import pytest

from kvbridge.backends import resolve_engine
from kvbridge.backends.llama_server.backend import LlamaServerBackend
from kvbridge.formats.slot_file import (
    STATE_IO_MAGIC, STATE_SEQ_MAGIC, MappedSlotFile, SlotFileError, build_slot_file, parse_slot_file, parse_token_words,
    token_words, write_in_place)


def memory_state(n_cells: int, payload: bytes = b"\x01\x02\x03\x04") -> bytes:
    """A minimal one-stream memory state: header, cells at positions 0..n-1 in sequence 0, some KV bytes."""
    cells = b"".join(struct.pack("<iIi", pos, 1, 0) for pos in range(n_cells))
    return struct.pack("<II", 1, n_cells) + cells + payload


def test_golden_slot_file_bytes():
    state = struct.pack("<Ii", STATE_IO_MAGIC, 0) + memory_state(2)
    data = b"".join(bytes(p) for p in build_slot_file(state, [7, 9]))
    expected = (struct.pack("<III", 0x67677371, 3, 6)            # 'ggsq', version 3, 6 words
                + struct.pack("<iIIiiI", -1, 1, 2, 7, 9, 0)       # server_tokens v1: n=2, ids, no media
                + memory_state(2))
    assert data == expected


def test_round_trip_keeps_state_and_tokens():
    state = struct.pack("<Ii", STATE_IO_MAGIC, 0) + memory_state(3, payload=bytes(range(200)))
    tokens = [1, 2, 3]
    parsed = parse_slot_file(b"".join(bytes(p) for p in build_slot_file(state, tokens)))
    assert parsed.tokens == tokens
    assert parsed.n_cells == 3
    assert bytes(parsed.state) == state


def test_plain_token_list_from_older_servers_is_read():
    data = struct.pack("<III", STATE_SEQ_MAGIC, 3, 2) + struct.pack("<ii", 5, 6) + memory_state(2)
    parsed = parse_slot_file(data)
    assert parsed.tokens == [5, 6]
    assert bytes(parsed.state[:8]) == struct.pack("<Ii", STATE_IO_MAGIC, 0)


def test_more_tokens_than_cells_is_reported_not_hidden():
    # llama-server lists the last generated token although its KV was never computed
    data = struct.pack("<III", STATE_SEQ_MAGIC, 3, 7) + token_words([1, 2, 3]).tobytes() + memory_state(2)
    parsed = parse_slot_file(data)
    assert parsed.tokens == [1, 2, 3] and parsed.n_cells == 2


@pytest.mark.parametrize("data, message", [
    (b"ggs", "shorter than its header"),
    (struct.pack("<III", 0x12345678, 3, 0), "not a llama.cpp sequence-state file"),
    (struct.pack("<III", STATE_SEQ_MAGIC, 2, 0), "version 2"),
    (struct.pack("<III", STATE_SEQ_MAGIC, 3, 50) + b"\0" * 8, "ends inside its token list"),
    (struct.pack("<III", STATE_SEQ_MAGIC, 3, 0) + struct.pack("<II", 2, 1), "2 KV streams"),
])
def test_bad_slot_files_raise(data, message):
    with pytest.raises(SlotFileError, match=message):
        parse_slot_file(data)


def test_media_chunks_are_refused():
    words = np.array([-1, 1, 1, 42, 1, 0], dtype="<i4")  # one token, one media key
    with pytest.raises(SlotFileError, match="media"):
        parse_token_words(words)


def test_build_refuses_a_foreign_state_or_wrong_token_count():
    with pytest.raises(SlotFileError, match="not an in-process sequence state"):
        build_slot_file(struct.pack("<Ii", 0xDEADBEEF, 0) + memory_state(1), [1])
    with pytest.raises(SlotFileError, match="2 cells but 3 tokens"):
        build_slot_file(struct.pack("<Ii", STATE_IO_MAGIC, 0) + memory_state(2), [1, 2, 3])


def test_write_in_place_overwrites_and_truncates(tmp_path):
    target = tmp_path / "slot.bin"
    assert write_in_place(target, [b"abcdef", memoryview(b"ghij")]) == 10
    assert write_in_place(target, [b"xyz"]) == 3
    assert target.read_bytes() == b"xyz"


def test_registered_under_its_key_and_aliases():
    for name in ("llama-server", "llamaserver", "server"):
        spec = resolve_engine(name)
        assert spec.key == "llama-server" and spec.cls is LlamaServerBackend
    assert LlamaServerBackend.kv_mode == "full"


def test_reading_from_disk_equals_parsing_bytes(tmp_path):
    from kvbridge.formats.slot_file import read_slot_file

    state = struct.pack("<Ii", STATE_IO_MAGIC, 0) + memory_state(4, payload=bytes(range(256)) * 3)
    path = tmp_path / "slot.bin"
    write_in_place(path, build_slot_file(state, [10, 11, 12, 13]))
    from_disk = read_slot_file(path)
    from_bytes = parse_slot_file(path.read_bytes())
    assert bytes(from_disk.state) == bytes(from_bytes.state) == state
    assert from_disk.tokens == from_bytes.tokens == [10, 11, 12, 13] and from_disk.n_cells == 4


def test_mapped_slot_file_equals_a_built_one_across_growing_and_shrinking_states(tmp_path):
    """The engine assembles straight into the mapped file; the result must be the same bytes as build_slot_file."""
    path = tmp_path / "restore.bin"
    mapped = MappedSlotFile(path)
    for n_cells, tokens in [(3, [5, 6, 7]), (5, [1, 2, 3, 4, 5]), (2, [9, 8])]:
        state = struct.pack("<Ii", STATE_IO_MAGIC, 0) + memory_state(n_cells, payload=bytes(range(50 + n_cells)))
        buffer = mapped.buffer(tokens, len(state))
        buffer[:] = np.frombuffer(state, dtype=np.uint8)      # what assemble_state does
        assert mapped.holds(memoryview(buffer))
        mapped.finish()
        assert path.read_bytes() == b"".join(bytes(p) for p in build_slot_file(state, tokens))
    mapped.close()


def test_mapped_slot_file_refuses_a_state_that_does_not_match_its_tokens(tmp_path):
    mapped = MappedSlotFile(tmp_path / "restore.bin")
    state = struct.pack("<Ii", STATE_IO_MAGIC, 0) + memory_state(3)
    buffer = mapped.buffer([1, 2], len(state))
    buffer[:] = np.frombuffer(state, dtype=np.uint8)
    with pytest.raises(SlotFileError, match="3 cells but 2 tokens"):
        mapped.finish()
    mapped.close()
