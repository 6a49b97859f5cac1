"""An approximate tokenizer for shadow engines whose real vocabulary is out of reach.

Place in the flow: prompt -> **tokens** -> chunk hashes -> lookup. A hosted API without /tokenize
(or an Ollama model whose GGUF is not on this machine) still needs token ids to chunk-hash, so this
splits text into word-like pieces of at most 4 characters (about the size of a BPE token in English)
and names each piece by a stable digest. What it keeps: the same text always gives the same ids in
every process, and a shared text prefix gives a shared id prefix. What it leaves out: the ids and
counts are not the engine's; every figure derived from them is labelled "approx".
"""
from __future__ import annotations

import hashlib
import re
from typing import Sequence

# Words with their leading space, numbers, runs of punctuation, runs of whitespace: the GPT-2
# pre-tokenizer's shape, simplified.
_PIECE_RE = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?(?:[^\s\w]|_)+|\s+", re.UNICODE)
MAX_PIECE_CHARS = 4


def _piece_id(piece: str) -> int:
    # blake2b, not hash(): Python salts str hashes per process, and chunk keys must survive restarts.
    return int.from_bytes(hashlib.blake2b(piece.encode("utf-8"), digest_size=4).digest(), "big")


class ApproxTokenizer:
    """Deterministic text -> ids in [0, 2^32); detokenize works for ids this instance produced."""

    def __init__(self) -> None:
        self._pieces: dict[int, str] = {}

    @staticmethod
    def pieces(text: str) -> list[str]:
        out: list[str] = []
        for match in _PIECE_RE.finditer(text):
            word = match.group(0)
            out.extend(word[i:i + MAX_PIECE_CHARS] for i in range(0, len(word), MAX_PIECE_CHARS))
        return out

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for piece in self.pieces(text):
            token = _piece_id(piece)
            self._pieces.setdefault(token, piece)
            ids.append(token)
        return ids

    def detokenize(self, tokens: Sequence[int]) -> str:
        return "".join(self._pieces.get(t, "\ufffd") for t in tokens)


def approx_token_count(text: str) -> int:
    """How many tokens the approximate tokenizer gives `text` (for budgets and estimates)."""
    return len(ApproxTokenizer.pieces(text))
