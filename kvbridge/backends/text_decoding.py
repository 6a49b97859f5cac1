"""Token bytes to text: shared by every door to llama.cpp that streams pieces (the in-process engine,
the scheduler, blend mode), so a character split across tokens is joined the same way everywhere."""
from __future__ import annotations


class Utf8Decoder:
    """Joins token bytes so multi-byte characters split across tokens come out whole."""

    def __init__(self):
        self.pending = b""

    def feed(self, piece: bytes) -> str:
        data = self.pending + piece
        for cut in range(len(data), max(len(data) - 4, -1), -1):
            try:
                text = data[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self.pending = data[cut:]
            return text
        self.pending = data
        return ""

    def flush(self) -> str:
        text, self.pending = self.pending.decode("utf-8", errors="replace"), b""
        return text
