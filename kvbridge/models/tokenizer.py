"""The embedded SmolLM2's tokenizer keys, read straight from its GGUF header for every zoo model.

Place in the flow: ZooWriter -> **tokenizer_fields()** -> every `tokenizer.*` key (tokens, merges,
token types, special ids, the chat template) copied into the new file, so prompts tokenize and chat
messages render exactly as on SmolLM2.

gguf's GGUFReader would do, but it maps every field of the file as numpy views and takes ~5 s on
SmolLM2's 49k tokens and 48k merges; this reads only the key-value section (~0.2 s), once per process.
"""
from __future__ import annotations

import functools
import struct
from pathlib import Path

import gguf

T = gguf.GGUFValueType
_SCALARS = {T.UINT8: "<B", T.INT8: "<b", T.UINT16: "<H", T.INT16: "<h", T.UINT32: "<I", T.INT32: "<i",
            T.FLOAT32: "<f", T.BOOL: "<?", T.UINT64: "<Q", T.INT64: "<q", T.FLOAT64: "<d"}


class _Cursor:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self.at += n
        return self.data[self.at - n:self.at].decode("utf-8")

    def value(self, kind: T):
        return self.string() if kind == T.STRING else self.scalar(_SCALARS[kind])


@functools.lru_cache(maxsize=4)
def tokenizer_fields(path: Path) -> tuple[tuple[str, T, T | None, object], ...]:
    """(key, type, array item type or None, value) of every `tokenizer.*` key in the GGUF at `path`."""
    with open(path, "rb") as f:
        head = f.read(24)
        if head[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (the tokenizer source of the model zoo)")
        (n_kv,) = struct.unpack_from("<Q", head, 16)
        cursor = _Cursor(head + f.read(64 << 20))   # the key-value section of a tokenizer fits easily
    cursor.at = 24
    found = []
    for _ in range(n_kv):
        key, kind = cursor.string(), T(cursor.scalar("<I"))
        if kind == T.ARRAY:
            sub, n = T(cursor.scalar("<I")), cursor.scalar("<Q")
            value = [cursor.value(sub) for _ in range(n)]
        else:
            sub, value = None, cursor.value(kind)
        if key.startswith("tokenizer."):
            found.append((key, kind, sub, value))
    return tuple(found)


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> int:
    """Copy every `tokenizer.*` key of `source` into `writer`; the vocabulary's size."""
    n_vocab = 0
    for key, kind, sub, value in tokenizer_fields(Path(source)):
        writer.add_key_value(key, value, kind, sub_type=sub)
        if key == "tokenizer.ggml.tokens":
            n_vocab = len(value)
    return n_vocab
