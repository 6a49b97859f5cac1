"""llama-server slot files <-> the in-process sequence-state bytes KVBridge stores.

Place in the flow: llama-server `POST /slots/0?action=save` -> **read the slot file, convert** ->
kvbridge.formats.llama_state splits it into chunk objects; and back: llama_state assembles a state -> **write a
slot file** -> `action=restore`.

Both formats carry the same `llama_memory::state_write(seq_id)` bytes; only the wrapping differs
(llama.cpp as vendored in llama-cpp-python 0.3.36, src/llama-context.cpp):

    in-process (llama_state_seq_get_data): u32 io_magic 0xaf143cd8, i32 seq_id, <memory state>
    slot file  (llama_state_seq_save_file): u32 'ggsq' 0x67677371, u32 version 3, u32 n_words,
                                            i32 words[n_words], <memory state>

The words are llama-server's `server_tokens::serialize()` (tools/server/server-common.cpp): either a
plain token list (older servers) or `-1, u32 version 1, u32 n, tokens[n], u32 n_media, ...`. Media
chunks (multimodal prompts) are deliberately not supported: such a file raises SlotFileError.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

STATE_SEQ_MAGIC = 0x67677371       # LLAMA_STATE_SEQ_MAGIC ('ggsq')
STATE_SEQ_VERSION = 3              # LLAMA_STATE_SEQ_VERSION in llama.cpp of llama-cpp-python 0.3.36
STATE_IO_MAGIC = 0xAF143CD8        # llama_context's io_magic, first word of llama_state_seq_get_data
TOKENS_STATE_MARKER = -1           # LLAMA_TOKEN_NULL: the words are a server_tokens state, not a list
TOKENS_STATE_VERSION = 1           # SERVER_TOKENS_STATE_VERSION
_FILE_HEADER = struct.Struct("<III")
_IO_HEADER = struct.Struct("<Ii")


class SlotFileError(ValueError):
    """The bytes are not a slot file (or sequence state) this module understands."""


@dataclass(frozen=True)
class SlotFile:
    """A parsed slot file: the token ids it names and its sequence state in the in-process format."""

    tokens: list[int]
    state: bytes | bytearray  # llama_state_seq_get_data layout (io magic, seq_id, memory state)
    n_cells: int          # KV cells in the state (may be fewer than len(tokens), see parse_slot_file)
    version: int


def memory_cell_count(memory_state: bytes | memoryview) -> int:
    """Cells in a one-stream memory state (`u32 n_stream, u32 cell_count, ...`)."""
    if len(memory_state) < 8:
        raise SlotFileError("sequence state ends early")
    n_stream, n_cells = struct.unpack_from("<II", memory_state, 0)
    if n_stream != 1:
        raise SlotFileError(f"{n_stream} KV streams in the slot file; only one is supported")
    return n_cells


def parse_token_words(words: np.ndarray) -> list[int]:
    """llama-server's serialized slot tokens -> token ids."""
    if len(words) == 0 or int(words[0]) != TOKENS_STATE_MARKER:
        return [int(t) for t in words]  # plain token list
    if len(words) < 3 or int(words[1]) != TOKENS_STATE_VERSION:
        raise SlotFileError(f"unknown llama-server token-state version {int(words[1]) if len(words) > 1 else '?'}")
    n = int(np.uint32(words[2]))
    if 3 + n + 1 > len(words):
        raise SlotFileError("llama-server token state ends early")
    n_media = int(np.uint32(words[3 + n]))
    if n_media:
        raise SlotFileError("slot holds media (image/audio) chunks; KVBridge handles text prompts only")
    return [int(t) for t in words[3:3 + n]]


def token_words(tokens: Sequence[int]) -> np.ndarray:
    """Token ids -> llama-server's serialized form (version 1, no media), as this server writes it."""
    n = len(tokens)
    words = np.empty(n + 4, dtype="<i4")
    words[0] = TOKENS_STATE_MARKER
    words[1] = TOKENS_STATE_VERSION
    words[2] = n
    words[3:3 + n] = np.asarray(tokens, dtype="<i4")
    words[3 + n] = 0  # no media chunks
    return words


def _check_header(head: bytes) -> tuple[int, int]:
    """(version, n_words) of a slot-file header, or SlotFileError."""
    if len(head) < _FILE_HEADER.size:
        raise SlotFileError("slot file is shorter than its header")
    magic, version, n_words = _FILE_HEADER.unpack_from(head, 0)
    if magic != STATE_SEQ_MAGIC:
        raise SlotFileError(f"not a llama.cpp sequence-state file (magic {magic:#010x})")
    if version != STATE_SEQ_VERSION:
        raise SlotFileError(f"slot file version {version}; this KVBridge reads version {STATE_SEQ_VERSION}")
    return version, n_words


def parse_slot_file(data: bytes, seq_id: int = 0) -> SlotFile:
    """Slot-file bytes -> tokens and the in-process state for `seq_id`.

    llama-server lists the tokens of its slot, which can include the last generated token whose KV
    was never computed; callers use `n_cells` (what the state really holds) and tokens[:n_cells].
    """
    version, n_words = _check_header(data[: _FILE_HEADER.size])
    body = _FILE_HEADER.size + 4 * n_words
    if body > len(data):
        raise SlotFileError("slot file ends inside its token list")
    tokens = parse_token_words(np.frombuffer(data, dtype="<i4", count=n_words, offset=_FILE_HEADER.size))
    memory_state = memoryview(data)[body:]
    n_cells = memory_cell_count(memory_state)
    state = _IO_HEADER.pack(STATE_IO_MAGIC, seq_id) + memory_state
    return SlotFile(tokens=tokens, state=state, n_cells=n_cells, version=version)


def read_slot_file(path: Path, seq_id: int = 0) -> SlotFile:
    """parse_slot_file() straight from disk: the state is read once into its final buffer (no copy)."""
    with open(path, "rb") as f:
        version, n_words = _check_header(f.read(_FILE_HEADER.size))
        raw_words = f.read(4 * n_words)
        if len(raw_words) != 4 * n_words:
            raise SlotFileError("slot file ends inside its token list")
        tokens = parse_token_words(np.frombuffer(raw_words, dtype="<i4"))
        size = os.fstat(f.fileno()).st_size - f.tell()
        state = bytearray(_IO_HEADER.size + size)
        _IO_HEADER.pack_into(state, 0, STATE_IO_MAGIC, seq_id)
        view = memoryview(state)
        got = _IO_HEADER.size
        while got < len(state):
            n = f.readinto(view[got:])
            if not n:
                raise SlotFileError("slot file shrank while it was read")
            got += n
    n_cells = memory_cell_count(view[_IO_HEADER.size:])
    return SlotFile(tokens=tokens, state=state, n_cells=n_cells, version=version)


def build_slot_file(state: bytes | memoryview, tokens: Sequence[int]) -> list[bytes | memoryview]:
    """In-process state + its tokens -> the slot file's parts (written in order, no joined copy)."""
    view = memoryview(state).cast("B")
    if len(view) < _IO_HEADER.size + 8:
        raise SlotFileError("sequence state is too short")
    magic, _seq_id = _IO_HEADER.unpack_from(view, 0)
    if magic != STATE_IO_MAGIC:
        raise SlotFileError(f"not an in-process sequence state (magic {magic:#010x})")
    memory_state = view[_IO_HEADER.size:]
    n_cells = memory_cell_count(memory_state)
    if n_cells != len(tokens):
        raise SlotFileError(f"state holds {n_cells} cells but {len(tokens)} tokens were given")
    words = token_words(tokens)
    return [_FILE_HEADER.pack(STATE_SEQ_MAGIC, STATE_SEQ_VERSION, len(words)), words.tobytes(), memory_state]


def write_in_place(path: Path, parts: Sequence[bytes | memoryview]) -> int:
    """Overwrite `path` with parts, reusing its pages; returns the size.

    Rewriting one file in place is about twice as fast as a fresh file on tmpfs (no page
    allocation). No rename is needed: the file is private and only read after this returns.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(fd, "r+b") as f:
        for part in parts:
            f.write(part)
        size = f.tell()
        f.truncate()
    return size


_ZEROS = memoryview(bytes(4 << 20))   # what MappedSlotFile grows its file with


class MappedSlotFile:
    """One slot file kept mapped in memory, so the engine assembles each restore's KV state straight into it.

    That saves one 40 MB copy per restore. The mapping is kept across restores (a fresh mapping
    costs a page fault per 4 KiB, more than the copy it saves) and only grows; the file is cut to the
    exact size of each state. The assembled in-process state starts with an 8-byte io header the
    slot file does not have, so it is placed 8 bytes early, over the end of the token words;
    finish() then writes the file header and the token words over that spot. Only the owner writes
    the file, and only between restores, so no rename is needed.
    """

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._map = None
        self.tokens: list[int] = []
        self.words = np.empty(0, dtype="<i4")
        self.head = 0
        self.state: np.ndarray | None = None

    def buffer(self, tokens: Sequence[int], state_size: int) -> np.ndarray:
        """Size the file for this state and return the writable spot where the state goes."""
        import mmap

        self.tokens = [int(t) for t in tokens]
        self.words = token_words(self.tokens)
        self.head = _FILE_HEADER.size + self.words.nbytes
        if state_size <= _IO_HEADER.size:
            raise SlotFileError("state too small for a slot file")
        size = self.head - _IO_HEADER.size + state_size
        if self._map is None or len(self._map) < size:
            self._unmap()
            self._extend(size + size // 4)   # mmap wants the file that long; room to grow
            self._map = mmap.mmap(self._fd, size + size // 4)
        if os.fstat(self._fd).st_size < size:
            self._extend(size)
        else:
            os.ftruncate(self._fd, size)   # the exact size llama.cpp expects; pages past EOF are never touched
        self.state = np.frombuffer(self._map, dtype=np.uint8, count=state_size, offset=self.head - _IO_HEADER.size)
        return self.state

    def _extend(self, size: int) -> None:
        """Grow the file by writing zeros, not by ftruncate: pages made by write() sit in large folios
        of the page cache (ext4, xfs), pages made by faults in a mapping in 4 KiB ones, and the server
        maps the whole file at each restore: ~0.2 ms for 37 MB against ~2.5 ms (Docs/Research.md §15)."""
        end = os.fstat(self._fd).st_size
        while end < size:
            end += os.pwrite(self._fd, _ZEROS[: min(len(_ZEROS), size - end)], end)

    def holds(self, data: bytes | memoryview) -> bool:
        """True when `data` is the state buffer this file handed out last."""
        if self.state is None:
            return False
        view = np.frombuffer(data, dtype=np.uint8)
        return view.size == self.state.size and view.ctypes.data == self.state.ctypes.data

    def finish(self) -> None:
        """Check the assembled state, then write the file header and the token words before it."""
        magic, _seq_id = _IO_HEADER.unpack_from(self._map, self.head - _IO_HEADER.size)
        if magic != STATE_IO_MAGIC:
            raise SlotFileError(f"not an in-process sequence state (magic {magic:#010x})")
        n_cells = memory_cell_count(memoryview(self._map)[self.head: self.head - _IO_HEADER.size + self.state.size])
        if n_cells != len(self.tokens):
            raise SlotFileError(f"state holds {n_cells} cells but {len(self.tokens)} tokens were given")
        self._map[: _FILE_HEADER.size] = _FILE_HEADER.pack(STATE_SEQ_MAGIC, STATE_SEQ_VERSION, len(self.words))
        self._map[_FILE_HEADER.size: self.head] = self.words.tobytes()
        self.state = None

    def _unmap(self) -> None:
        self.state = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass   # a caller still holds a view: the mapping is released with the last of them
            self._map = None

    def close(self) -> None:
        self._unmap()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
