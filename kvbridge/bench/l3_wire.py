"""What the L3 tier does on the wire: round trips of a lookup, and a request's lookup while L3 is down.

Place in the flow: chunk hashes -> **TieredStore.lookup** (discover_many: one pipelined probe per
tier) -> get_many -> ...; `bench-l3` parts (c) and (d), beside kvbridge.bench.l3_bench.

- counting_round_trips / lookup_round_trips (c): redis-py sends, counted client side;
- SilentServer / lookups_with_l3_down / l3_down_both_ways (d): a killed server (the port refuses)
  and a silent one (accepts TCP, never answers: every call waits KVB_L3_TIMEOUT).
"""
from __future__ import annotations

import contextlib
import os
import socket
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

from kvbridge.bench.common.scenarios import build_requests
from kvbridge.settings import Settings
from kvbridge.store import DiskTier, MemoryTier, ObjectMeta, TieredStore


def l3_tier(store: TieredStore):
    """The store's L3 tier (the bench always has one)."""
    return store.tiers[store.tier_names.index("L3")]


# -- (c) round trips of a 12-hash lookup -----------------------------------------------------------
@contextlib.contextmanager
def counting_round_trips() -> Iterator[Counter]:
    """Count this thread's redis-py writes ("sends") and replies read ("replies") while the block runs.

    A round trip is counted as one send: redis-py's Connection writes a whole request with one
    send_packed_command (a pipeline packs all its commands into it) and then blocks reading every
    reply before it sends again, so each send is one wait for the network. The server's INFO counters
    count commands, not waits, and would call a 24-command pipeline 24. Only this thread counts: the
    store's write-behind thread may use its own connection meanwhile.
    """
    from redis.connection import AbstractConnection

    counts: Counter = Counter()
    me = threading.get_ident()
    send, read = AbstractConnection.send_packed_command, AbstractConnection.read_response

    def counted_send(self, *args, **kwargs):
        if threading.get_ident() == me:
            counts["sends"] += 1
        return send(self, *args, **kwargs)

    def counted_read(self, *args, **kwargs):
        if threading.get_ident() == me:
            counts["replies"] += 1
        return read(self, *args, **kwargs)

    AbstractConnection.send_packed_command, AbstractConnection.read_response = counted_send, counted_read
    try:
        yield counts
    finally:
        AbstractConnection.send_packed_command, AbstractConnection.read_response = send, read


def lookup_round_trips(url: str, prefix: str, n_hashes: int = 12, timeout: float = 2.0,
                       object_bytes: int = 64 << 10) -> dict:
    """Round trips of TieredStore.lookup for `n_hashes` hashes held by L3 but unknown to the reader.

    A writer store puts the objects; a reader with its own L1, L2 and L3 tier (another host, or this
    one after a restart: an empty index) looks them up. Counted: the reader's first lookup, the same
    lookup again (now in its index), a lookup of hashes the server does not hold, then the reads a
    restore makes after its lookup (ChunkKV: one get_many of the hit chunks plus the tail key, which
    the lookup did not ask about), and, on a second fresh reader, a get_many with no lookup before it.
    Each reader's connection is opened by a PING first: its handshake is counted apart (paid once).
    """
    from kvbridge.store.redis_tier import RedisTier

    namespace = "bench-l3-lookup"
    meta = ObjectMeta(namespace=namespace, n_tokens=256, tokens_digest=bytes(16), note="bench")
    held = [os.urandom(32) for _ in range(n_hashes + 1)]     # the last one plays a restore's tail key
    absent = [os.urandom(32) for _ in range(n_hashes)]
    writer_l3 = RedisTier(url, prefix=prefix, timeout=timeout)
    writer = TieredStore([writer_l3], namespace=namespace)
    rows: dict = {}
    try:
        for key in held:
            writer.put(key, os.urandom(object_bytes), meta)
        writer.drain()
        with tempfile.TemporaryDirectory(prefix="kvb-bench-l3-lookup-") as temp:
            readers = []

            def fresh_reader() -> TieredStore:
                tier = RedisTier(url, prefix=prefix, timeout=timeout)
                with counting_round_trips() as handshake:
                    tier.ping()
                rows["connect_round_trips"] = handshake["sends"]
                readers.append(TieredStore([MemoryTier(64 << 20), DiskTier(Path(temp) / f"l2-{len(readers)}", 64 << 20),
                                            tier], namespace=namespace))
                return readers[-1]

            def count(what: str, call) -> None:
                with counting_round_trips() as counts:
                    start = time.perf_counter()
                    found = call()
                    elapsed = (time.perf_counter() - start) * 1e3
                if isinstance(found, list):
                    hits, tiers = sum(obj is not None for obj in found), {obj.tier for obj in found if obj is not None}
                else:
                    hits, tiers = found.n_hit, set(found.tiers)
                rows[what] = {"round_trips": counts["sends"], "replies": counts["replies"], "n_hit": hits,
                              "tiers": sorted(tiers), "ms": elapsed}

            try:
                reader = fresh_reader()
                count("unknown_held", lambda: reader.lookup(held[:n_hashes]))
                count("known", lambda: reader.lookup(held[:n_hashes]))
                count("not_held", lambda: reader.lookup(absent))
                count("restore_reads", lambda: reader.get_many(held))
                other = fresh_reader()
                count("get_many_unknown", lambda: other.get_many(held[:n_hashes]))
            finally:
                for each in readers:
                    each.drain()
                    each.close()
    finally:
        writer.close()
        writer_l3.clear()
    return {"hashes": n_hashes, **rows}


# -- (d) L3 stopped --------------------------------------------------------------------------------
class SilentServer:
    """A loopback TCP port that completes the handshake (the kernel's backlog) and never answers:
    a hung Redis. Every call to it waits the full KVB_L3_TIMEOUT."""

    def __init__(self) -> None:
        self._socket = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.url = f"redis://127.0.0.1:{self._socket.getsockname()[1]}/0"

    def close(self) -> None:
        self._socket.close()


def lookups_with_l3_down(engine, settings: Settings, url: str, later: int = 10,
                         before_first: Callable[[], None] | None = None, probe_again: bool = True) -> dict:
    """A request's store lookup (ChunkKV.find_prefix: lookup, then the tail's get) while L3 is down.

    The store is the one from_settings builds (L1, a fresh L2, L3 at `url`). before_first runs
    after one healthy lookup (it kills the server). Then: the first lookup (it finds L3 down and
    marks it so), `later` lookups alternated with the same lookup on a store without L3 (the
    baseline: what a request costs with L3 out of the picture), and, with probe_again, one lookup
    after the first back-off has passed (the tier's background prober pings then; the request skips L3).
    """
    from kvbridge.engine.chunks import ChunkKV

    messages = build_requests("doc-qa", 1)[0].messages
    tokens = list(engine.prepare(list(messages)).tokens)
    hashes = engine.hasher.chunk_hashes(tokens)
    seed = getattr(engine.hasher, "seed", b"")
    prefix = f"{settings.l3_prefix}-down"
    with tempfile.TemporaryDirectory(prefix="kvb-bench-l3-down-") as temp:
        store = TieredStore.from_settings(settings.replace(l3_url=url, l3_prefix=prefix, l2_dir=f"{temp}/a"),
                                          namespace=engine.namespace)
        base = TieredStore.from_settings(settings.replace(l3_url="", l2_dir=f"{temp}/b"), namespace=engine.namespace)
        kv = ChunkKV(store, engine.namespace, seed, settings.chunk_size, engine.geometry)
        base_kv = ChunkKV(base, engine.namespace, seed, settings.chunk_size, engine.geometry)
        tier = l3_tier(store)

        def lookup(which) -> float:
            start = time.perf_counter()
            which.find_prefix(tokens, hashes).release()
            return (time.perf_counter() - start) * 1e3

        try:
            result: dict = {"timeout_s": tier.timeout}
            if before_first is not None:
                result["healthy_ms"] = lookup(kv)
                before_first()
            result["first_ms"] = lookup(kv)
            result["state_after_first"] = tier.health()["state"]
            pairs = [(lookup(kv), lookup(base_kv)) for _ in range(later)]
            result["later_ms"] = statistics.median(a for a, _ in pairs)
            result["later_max_ms"] = max(a for a, _ in pairs)
            result["baseline_ms"] = statistics.median(b for _, b in pairs)
            result["baseline_max_ms"] = max(b for _, b in pairs)
            result["later"] = later
            health = tier.health()
            result["state_after_later"] = health["state"]
            result["skipped_down"] = health["skipped_down"]
            if probe_again:
                time.sleep(tier.health()["retry_in_s"] + 0.1)
                result["probe_ms"] = lookup(kv)
                result["next_retry_s"] = tier.health()["retry_in_s"]
            result["counts"] = {k: v for k, v in tier.health().items() if isinstance(v, int) and not isinstance(v, bool)}
            result["reason"] = tier.health()["reason"]
        finally:
            for each in (kv, base_kv):
                each.close()
            for each in (store, base):
                each.close()
    return result


def l3_down_both_ways(engine, settings: Settings, later: int = 10) -> dict:
    """(d): a killed private redis-server (the port refuses: fails fast) and a silent port (times out)."""
    from kvbridge.bench.common.private_redis import RedisServerMissing, private_redis

    out: dict = {}
    try:
        with private_redis() as doomed:
            out["killed"] = lookups_with_l3_down(engine, settings, doomed.url, later, before_first=doomed.kill)
    except RedisServerMissing as missing:
        out["killed"] = {"skipped": str(missing)}
    silent = SilentServer()
    try:
        out["silent"] = lookups_with_l3_down(engine, settings, silent.url, later)
    finally:
        silent.close()
    return out
