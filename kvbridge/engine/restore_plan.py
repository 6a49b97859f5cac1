"""RestorePlan: what a lookup found and the store's loans it holds until the restore is done.

Place in the flow: chunk hashes -> ChunkKV.find_prefix (lookup, fetch, confirm) -> **RestorePlan**
(the confirmed pieces or a snapshot state, the tokens they cover, the tier, the bytes read per tier)
-> ChunkKV.assemble -> the engine -> release(). A cache server's get() lends shared-memory pages:
a plan notes each loaned object (borrow) and returns them all however the restore ends; an object
read to be kept is copied out at once (owned).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvbridge.backends.base import SeqState
from kvbridge.store import StoredObject


@dataclass
class RestorePlan:
    """What a lookup found: the confirmed pieces (or a snapshot state) and how many prompt tokens they cover."""

    state: SeqState | None = None      # set by assemble() (or directly, for a whole snapshot)
    pieces: list = field(default_factory=list)   # (ChunkView, keep) in order; views point into `blobs`
    blobs: list = field(default_factory=list)    # the fetched bytes, kept alive while views use them
    tokens: list[int] = field(default_factory=list)
    chunks_hit: int = 0
    matched_tokens: int = 0
    limit: int = -1                    # the most of the prompt a restore may give (all but the last token, or the
                                       # cold cut: kvbridge.engine.cold_cut); -1: not said (all but the last token)
    tier: str = "none"
    notes: list[str] = field(default_factory=list)
    borrowed: list = field(default_factory=list)  # objects whose blob views memory on loan (release them)
    lossy: set[str] = field(default_factory=set)   # lossy codecs the restored KV passed through (ObjectMeta.lossy)
    fetched: dict[str, int] = field(default_factory=dict)   # bytes read per tier (objects used or not)
    hot: bool = False   # the state is the one already assembled in the scratch buffer (ChunkKV._hot_plan)
    store_calls: int = 0                                      # lookup and fetch calls on the store
    # what kvbridge.engine.misses reads to explain the tokens the plan does not cover (no extra store call):
    tier_tokens: dict[str, int] = field(default_factory=dict)   # restored tokens by the tier they came from
    continuation: tuple | None = None   # (start, token ids) of a stored object read after the matched run
    uncut: str = ""                     # why a stored piece that continues the prompt could not be cut to it
    reach: int = 0   # how far the stored KV continued the prompt where a restore was cut back to the cold-cut grid

    def add_tokens(self, tier: str, n: int) -> None:
        if n > 0:
            self.tier_tokens[tier] = self.tier_tokens.get(tier, 0) + n

    def release(self) -> None:
        """Return every loaned blob (a cache server's shared-memory lease); idempotent."""
        borrowed, self.borrowed = self.borrowed, []
        for obj in borrowed:
            obj.release()

    def borrow(self, obj):
        """Note an object whose blob is on loan, so the plan returns it however it ends."""
        if obj is not None and obj.release is not None:
            self.borrowed.append(obj)
        return obj

    def count_fetched(self, obj) -> None:
        if obj is not None:
            self.fetched[obj.tier] = self.fetched.get(obj.tier, 0) + len(obj.blob)


def owned(obj):
    """A loaned object copied into bytes of our own at once (snapshots go to the engine as they are)."""
    if obj is None or obj.release is None:
        return obj
    try:
        blob = bytes(obj.blob)
        intact = obj.intact is None or obj.intact()
    finally:
        obj.release()
    return StoredObject(blob, obj.meta, obj.tier) if intact else None


def common_prefix_length(a: np.ndarray | Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n], dtype=np.int64))[0]
    return int(diff[0]) if diff.size else n
