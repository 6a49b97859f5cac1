"""Whole-sequence snapshots: the KV of an engine whose state layout is not understood, kept whole.

Place in the flow: store_prompt -> **snapshot object** (kind "snapshot", under the tail keys of the prompt's
last chunk and of the seed) ... find_prefix -> **the snapshot whose token ids begin the prompt** -> the engine,
whose own prefix matching trims it after the restore (kvbridge.engine.chunks).

An object is the magic, the count of token ids, the ids (i32) and the engine's raw state.
"""
from __future__ import annotations

import struct
from typing import Sequence

import numpy as np

from kvbridge.backends.base import SeqState
from kvbridge.engine.restore_plan import RestorePlan, common_prefix_length, owned

SNAPSHOT_HEADER = struct.Struct("<8sI")  # magic, n_token_ids; then i32 ids, then the raw engine state
SNAPSHOT_MAGIC = b"KVBSNAP1"


def snapshot_blob(ids: np.ndarray, state_data) -> bytes:
    """One snapshot object: the engine's own ids for every cell (prompt and generated tokens) and its state."""
    ids = np.asarray(ids, dtype="<i4")
    return SNAPSHOT_HEADER.pack(SNAPSHOT_MAGIC, len(ids)) + ids.tobytes() + bytes(state_data)


def plan_snapshot(store, namespace: str, keys: Sequence[bytes], tokens: Sequence[int], limit: int,
                  chunk_size: int) -> RestorePlan:
    """The first snapshot under `keys` that shares a prefix with `tokens` (at most `limit` of them), as a plan."""
    plan = RestorePlan(notes=["whole-sequence snapshot mode (KV layout not understood)"])
    for key in keys:
        obj = owned(store.get(key, namespace=namespace))
        if obj is None or obj.meta.kind != "snapshot":
            continue
        magic, n_ids = SNAPSHOT_HEADER.unpack_from(obj.blob, 0)
        if magic != SNAPSHOT_MAGIC:
            continue
        ids = np.frombuffer(obj.blob, dtype="<i4", count=n_ids, offset=SNAPSHOT_HEADER.size)
        match = min(common_prefix_length(ids, tokens), limit)
        if match < 1:
            continue
        plan.state = SeqState(data=memoryview(obj.blob)[SNAPSHOT_HEADER.size + 4 * n_ids:], n_tokens=n_ids)
        plan.tokens = [int(t) for t in ids]   # the whole snapshot; the engine's prefix matching trims it
        plan.matched_tokens = match
        plan.chunks_hit = match // chunk_size
        plan.tier = obj.tier
        return plan
    return plan
