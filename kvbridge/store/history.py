"""The history of a key: a bounded ring of recent evictions, and what a store says about keys a lookup missed.

Place in the flow: ... lookup finds fewer chunks than the prompt has -> **the store is asked about the first
missing keys** (MissProbe, one call, one round trip to a cache server) -> kvbridge.engine.misses names the cause.

Every store that evicts (the embedded TieredStore, the cache server's pool and the stores below it) records each
object it drops from a tier in an EvictionRing: which key, from which tier, when, by which policy, to make room
for what, and whether any tier still holds it afterwards (an L1 eviction that demotes to L2 is not a loss). The
ring keeps the last `capacity` entries (KVB_EVICTION_HISTORY, at least 4096) and the latest entry per key, so a
miss names its eviction in O(1). Deliberately left out: persistence (a restarted process starts with an empty
ring; what it then cannot name is `none_stored`, never a guess).
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

MIN_HISTORY = 4096
EVICTION_REASONS = ("lru", "pressure", "clear", "corrupt", "removed")
# lru: the tier was full and this was its least recently used object; pressure: the cache server's memory
# pressure shed it; clear: a user or test cleared the tier; corrupt: a check failed and it was dropped;
# removed: deleted by key (a write replaced it, a tier went away)


@dataclass(frozen=True)
class Eviction:
    """One object leaving one tier."""

    key: bytes
    namespace: str
    tier: str                 # the tier it left ("L1", "L2", "L3")
    reason: str               # one of EVICTION_REASONS
    at: float                 # time.time() when it left
    policy: str = "LRU"       # the policy that chose it (the store's policy class), "" for clear/corrupt
    for_key: bytes = b""      # the object whose write made room for this eviction (b"" when not a write)
    for_kind: str = ""        # that object's kind (chunk, tail, ...) and size, for the detail text
    for_size: int = 0
    size: int = 0             # this object's payload bytes
    gone: bool = True         # True: no tier of this store holds it after this eviction (False: demoted below)

    def describe(self, now: float | None = None) -> str:
        """For a person: 'evicted from L1 by LRU 3.2 s ago to make room for a 1.2 MB chunk (9f3a1c…)'."""
        now = time.time() if now is None else now
        ago = max(0.0, now - self.at)
        when = f"{ago:.1f} s ago" if ago < 120 else f"{ago / 60:.0f} min ago"
        how = {"lru": f"by {self.policy or 'LRU'}", "pressure": "under memory pressure",
               "clear": "when the tier was cleared", "corrupt": "because it failed a check",
               "removed": "by a delete"}.get(self.reason, self.reason)
        text = f"evicted from {self.tier} {how} {when}"
        if self.for_key:
            text += f" to make room for a {_size(self.for_size)} {self.for_kind or 'object'} ({self.for_key.hex()[:12]})"
        if not self.gone:
            text += " (a lower tier still held it then)"
        return text


def _size(n: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


class EvictionRing:
    """The last `capacity` evictions, newest last, and the newest one per key; thread-safe."""

    def __init__(self, capacity: int = MIN_HISTORY) -> None:
        self.capacity = max(MIN_HISTORY, int(capacity))
        self._entries: OrderedDict[int, Eviction] = OrderedDict()   # sequence number -> entry
        self._latest: dict[bytes, int] = {}                          # key -> sequence number of its newest entry
        self._seq = 0
        self._lock = threading.Lock()
        self.recorded = 0   # every eviction ever recorded (the ring holds the last `capacity`)

    def record(self, entry: Eviction) -> None:
        with self._lock:
            self._seq += 1
            self.recorded += 1
            self._entries[self._seq] = entry
            self._latest[entry.key] = self._seq
            while len(self._entries) > self.capacity:
                seq, old = self._entries.popitem(last=False)
                if self._latest.get(old.key) == seq:
                    del self._latest[old.key]

    def forget(self, key: bytes) -> None:
        """The key was stored again: its old eviction no longer explains a miss."""
        with self._lock:
            self._latest.pop(key, None)

    def latest(self, key: bytes) -> Eviction | None:
        with self._lock:
            seq = self._latest.get(key)
            return self._entries.get(seq) if seq is not None else None

    def recent(self, limit: int = 100) -> list[Eviction]:
        """The newest `limit` entries, newest first (the GUI's and `kvbridge explain --evictions`' list)."""
        with self._lock:   # newest first without copying the whole ring (it may hold millions)
            return list(itertools.islice(reversed(self._entries.values()), max(0, limit)))

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


@dataclass(frozen=True)
class MissProbe:
    """What a store says, in one call, about the keys a restore wanted and did not get.

    `history[i]`, `pending[i]` answer `keys[i]`; `found[j]` answers `probes[j]` (the same prompt's keys under other
    namespaces: the tier that holds it, "" when none); `namespaces` are the namespaces the store's tiers hold
    (bytes each), so the next miss knows which to probe; `down` names the tiers unreachable now, each with why.
    """

    history: list[Eviction | None] = field(default_factory=list)
    pending: list[bool] = field(default_factory=list)     # being written now (a write lease or the write-behind queue)
    found: list[str] = field(default_factory=list)
    namespaces: dict[str, int] = field(default_factory=dict)
    down: dict[str, str] = field(default_factory=dict)    # tier name -> why ("connection refused", "timed out")
    round_trips: int = 0                                  # calls this probe sent over the network (L3's, a cache server's)
