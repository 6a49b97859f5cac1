"""Stored passages: the KV of one segment as a prefill of instruction + segment left it, under keys of its own.

Place in the flow: after a blend answer -> **prefill instruction + passage, cut the passage's cells,
put under passage_key()** -> the store's tiers; a later prompt with the passage anywhere ->
**get -> check -> decode** -> placed at its new position (kvbridge.blend.runner).

A passage object is the chunk payload of kvbridge.formats.llama_state (header, token ids, K then V
of its cells, positions as they were computed: after the instruction) filed with kind "passage"
under the blend namespace: the exact namespace plus a `blend=` field, so no exact `lmcache` lookup
(chunk hashes under the exact namespace) can ever reach one. The key hashes the blend namespace
(which holds any tenant salt), the instruction's tokens and the passage's tokens: a passage is
reused only after the same instruction, whose KV it was computed against. The instruction itself
is stored the same way (its cells from position 0), under instruction_key(). Codecs: zstd stores a
passage like any payload; int8 stores it exactly (it only quantises "chunk" and "tail" objects),
so blended KV is never quantised on top of being approximate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from blake3 import blake3

from kvbridge.engine.hashing import pack_tokens, tokens_digest
from kvbridge.formats.llama_chunks import ChunkView, decode_chunk
from kvbridge.formats.llama_state import KVGeometry, LayoutError
from kvbridge.store.objects import ObjectMeta

BLEND_TAG = "blend=passage-v1"     # joins the exact namespace: the blend namespace
PASSAGE_KIND = "passage"
_PASSAGE_KEY = b"kvb-blend-passage-v1\0"
_INSTRUCTION_KEY = b"kvb-blend-instruction-v1\0"


def blend_namespace(namespace: str) -> str:
    """Where passages live: never the namespace of exact chunks."""
    return f"{namespace}|{BLEND_TAG}"


def instruction_key(namespace: str, instruction: Sequence[int]) -> bytes:
    return blake3(_INSTRUCTION_KEY + namespace.encode() + b"\0" + pack_tokens(instruction)).digest()


def passage_key(namespace: str, instruction: Sequence[int], passage: Sequence[int]) -> bytes:
    h = blake3(_PASSAGE_KEY + namespace.encode() + b"\0")
    h.update(tokens_digest(instruction))
    h.update(pack_tokens(passage))
    return h.digest()


def passage_meta(namespace: str, tokens: Sequence[int], note: str) -> ObjectMeta:
    return ObjectMeta(namespace=namespace, n_tokens=len(tokens), tokens_digest=tokens_digest(tokens),
                      kind=PASSAGE_KIND, note=note)


@dataclass
class FoundPassage:
    """A stored passage checked against the tokens it must hold: views into the fetched bytes."""

    view: ChunkView
    tier: str
    n_bytes: int


def check_passage(obj, namespace: str, tokens: Sequence[int], geometry: KVGeometry) -> FoundPassage | None:
    """The decoded object when it is this passage's KV in this namespace; None otherwise (a miss)."""
    meta = obj.meta
    if (meta.kind != PASSAGE_KIND or meta.namespace != namespace or meta.n_tokens != len(tokens)
            or meta.tokens_digest != tokens_digest(tokens)):
        return None
    try:
        view = decode_chunk(obj.blob if isinstance(obj.blob, bytes) else bytes(obj.blob), geometry)
    except LayoutError:
        return None
    if view.n_cells != len(tokens) or not np.array_equal(view.token_ids, np.asarray(tokens, dtype="<i4")):
        return None
    return FoundPassage(view=view, tier=obj.tier, n_bytes=len(obj.blob))
