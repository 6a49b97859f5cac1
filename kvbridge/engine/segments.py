"""A prompt's segments: the shared instruction, the retrieved passages, the question.

Place in the flow: render (chat template) -> **split at the separator, tokenize each segment alone,
concatenate** -> the Prompt every mode runs (cold, native, lmcache and blend see the same token ids).

The separator (`Settings.blend_separator`, KVB_BLEND_SEPARATOR) is cut out of the rendered text of a
prompt that is cut, so it never reaches the model. Who cuts: the scheduler (and so `serve`) only a
blend request's prompt, so anyone else's message that holds the separator reaches the model as sent;
CachedEngine every prompt, so the benches' cold, lmcache and blend modes run the same token ids.
The first segment is the instruction (it keeps the chat template's opening and the tokenizer's
BOS), the last the question (it keeps the template's closing), the ones between are passages. Each segment is tokenized on its own, so a passage has the same token
ids wherever it appears: that is what lets its KV be found again under another neighbour.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

DEFAULT_SEPARATOR = "[KVB_SEP]"   # rare in ordinary text, no whitespace at its ends (settings are stripped)


@dataclass(frozen=True)
class Segmented:
    """Token ids of the whole prompt and where each segment starts in them."""

    tokens: tuple[int, ...]
    starts: tuple[int, ...]     # one per segment; segment i is tokens[starts[i]:starts[i+1]] (the last runs to the end)
    text: str                   # the rendered text without the separators

    @property
    def n_passages(self) -> int:
        return max(0, len(self.starts) - 2)

    def spans(self) -> list[tuple[int, int]]:
        return segment_spans(self.starts, len(self.tokens))


def segment_spans(starts: Sequence[int], n_tokens: int) -> list[tuple[int, int]]:
    """(start, end) of each segment of a prompt of n_tokens tokens whose segments begin at `starts`."""
    return list(zip(starts, list(starts[1:]) + [n_tokens]))


def split_text(text: str, separator: str) -> list[str] | None:
    """The segments of `text`, or None when it holds no separator (one segment: nothing to blend)."""
    if not separator or separator not in text:
        return None
    return text.split(separator)


def tokenize_segments(text: str, separator: str, tokenize: Callable[[str], Sequence[int]]) -> Segmented | None:
    """Tokenize each segment alone and concatenate; None when `text` holds no separator.

    `tokenize` adds the tokenizer's own special tokens (BOS) as for a whole prompt; they are kept for
    the first segment only (tokenizing nothing yields exactly those tokens). Empty segments (two
    separators in a row) are dropped.
    """
    parts = split_text(text, separator)
    if parts is None:
        return None
    added = len(tokenize(""))
    tokens: list[int] = []
    starts: list[int] = []
    for index, part in enumerate(parts):
        ids = list(tokenize(part))
        ids = ids if index == 0 else ids[added:]
        if not ids:
            continue
        starts.append(len(tokens))
        tokens.extend(int(t) for t in ids)
    return Segmented(tokens=tuple(tokens), starts=tuple(starts), text="".join(parts))


def no_passages_note(separator: str) -> str:
    """The record's note when blend was asked for a prompt with no passage to reuse (it runs as lmcache)."""
    return (f"blend: no passages between the instruction and the question (cut the prompt with "
            f"KVB_BLEND_SEPARATOR {separator!r}); ran as lmcache")
