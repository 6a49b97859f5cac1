"""RemoteStore: the TieredStore interface, served by a cache server (KVB_STORE_URL set).

Place in the flow: CachedEngine -> ChunkKV / ShadowIndex -> **RemoteStore** -> CacheClient -> the
cache server's L1 (shared memory) and L2. The engine keeps no tiers of its own; the tiers, their
names and order are the server's.

Same degrade rule as the embedded store: a fault is a counted miss or a skipped write, never an
exception from lookup/get/put/contains/flush. A server that does not answer within
KVB_CACHE_SERVER_TIMEOUT counts as `unavailable`, and the engine recomputes; the client says hello
again by itself once the server is back. A server the client cannot authenticate (no key file, a
squatter on the port that fails the CURVE handshake) or that refuses it counts as `refused`: a miss
as well, within the same bound (the handshake fails at once; the client then refuses at once for its
back-off), and nothing was sent to it. clear() raises StoreFault when the server cannot be used.

A shared-memory get() lends the server's pages: the StoredObject's blob is a view of them, its
intact() says whether they were still the object's after the caller copied out, and release()
returns the lease (ChunkKV does both around assembling a restore).
"""
from __future__ import annotations

import logging
import os
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from typing import Iterable, Iterator

from kvbridge.cache_server.client import CacheClient, CacheServerError, CacheServerRefused, CacheServerUnavailable
from kvbridge.cache_server.auth import read_token
from kvbridge.settings import Settings
from kvbridge.store.history import Eviction, MissProbe
from kvbridge.store.objects import LookupResult, ObjectMeta, StoredObject, StoreFault, check_key
from kvbridge.store.opening import STORE_URL_KIND, RemoteStoreKind, register_remote_store

log = logging.getLogger("kvbridge.cache_server.client")


class RemoteStore:
    shared = True   # other processes use the same tiers: an engine restart does not empty L1

    def __init__(self, client: CacheClient, namespace: str | None = None, chunk_tokens: int = 0) -> None:
        self.client = client
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self._counts: Counter[str] = Counter()

    @classmethod
    def from_settings(cls, settings: Settings, namespace: str | None = None, environ=None) -> "RemoteStore":
        """A client of the server at KVB_STORE_URL; CacheServerRefused when it turns us away (token, version) or
        cannot be authenticated at start. A key file that does not exist yet (the server not started yet) is
        a warning: calls are counted misses until it appears."""
        client = CacheClient(settings.store_url, priority=settings.client_priority, token=read_token(settings, environ),
                             server_key=settings.cache_server_public_key, timeout_s=settings.cache_server_timeout,
                             use_shm=settings.cache_server_shm, label=f"{settings.engine} engine, pid {os.getpid()}",
                             wait_for_key=True, checksum=settings.cache_server_checksum)
        return cls(client, namespace, chunk_tokens=settings.chunk_size)

    @property
    def tier_names(self) -> list[str]:
        return self.client.tier_names

    @property
    def lossy_codecs(self) -> list[str]:
        """The lossy codecs the server's tiers write with (the engine puts them into its namespace)."""
        tiers = ((self.server_status() or {}).get("storage") or {}).get("tiers") or {}
        return sorted({str(tier["codec"]).split()[0] for tier in tiers.values()
                       if "lossy" in str(tier.get("codec", ""))})

    def slower(self, tier_a: str, tier_b: str) -> str:
        order = {name: i for i, name in enumerate(self.tier_names, start=1)}
        return tier_a if order.get(tier_a, 0) >= order.get(tier_b, 0) else tier_b

    # -- reading ---------------------------------------------------------------------------------
    def lookup(self, hashes: Iterable[bytes], namespace: str | None = None, purpose: str = "prompt") -> LookupResult:
        """`purpose` (protocol.LOOKUP_PURPOSES) keeps a writer's or a KV-event recheck's lookups out of the
        server's hit-rate series."""
        keys = [check_key(key) for key in hashes]
        expected = self.namespace if namespace is None else namespace
        try:
            return self.client.lookup(keys, expected, self.chunk_tokens, purpose)
        except (CacheServerUnavailable, CacheServerError, CacheServerRefused) as exc:
            self._fault("lookup", exc)
            return LookupResult(0, [])

    def contains(self, key: bytes, namespace: str | None = None) -> bool:
        """Whether one object is held (writers ask before storing): a "store" lookup, out of the hit rate."""
        return self.lookup([key], namespace, purpose="store").n_hit == 1

    def get(self, key: bytes, namespace: str | None = None) -> StoredObject | None:
        key = check_key(key)
        expected = self.namespace if namespace is None else namespace
        try:
            found = self.client.retrieve(key, expected)
        except (CacheServerUnavailable, CacheServerError, CacheServerRefused) as exc:
            self._fault("retrieve", exc)
            return None
        return self._stored(found)

    def get_many(self, keys: list[bytes], namespace: str | None = None) -> list[StoredObject | None]:
        """get() for several keys in one round trip to the server."""
        keys = [check_key(key) for key in keys]
        expected = self.namespace if namespace is None else namespace
        try:
            found = self.client.retrieve_many(keys, expected)
        except (CacheServerUnavailable, CacheServerError, CacheServerRefused) as exc:
            self._fault("retrieve", exc)
            return [None] * len(keys)
        return [self._stored(item) for item in found]

    def _stored(self, found) -> StoredObject | None:
        if found is None:
            self._counts["misses"] += 1
            return None
        self._counts[f"hits_{found.tier}"] += 1
        if not found.lease_id:
            return StoredObject(found.blob, found.meta, found.tier)
        return StoredObject(found.blob, found.meta, found.tier,
                            intact=lambda: self.client.intact(found), release=lambda: self.client.release([found]))

    # -- why a restore missed --------------------------------------------------------------------
    def probe_miss(self, keys: list[bytes], probes: list[bytes] = ()) -> MissProbe:
        """The server's answer about missed keys (kvbridge.store.history.MissProbe) in ONE round trip; never
        raises: a server that does not answer within the client's timeout (or refuses) is `down`."""
        keys = [check_key(key) for key in keys]
        probes = [check_key(key) for key in probes]
        started = time.monotonic()
        try:
            reply = self.client.probe_miss(keys, probes)
        except (CacheServerUnavailable, CacheServerError, CacheServerRefused) as exc:
            self._fault("probe_miss", exc)
            text = str(exc).removeprefix(f"cache server {self.client.url}: ").removeprefix(
                f"cache server {self.client.url} ")
            if isinstance(exc, CacheServerUnavailable):
                waited = time.monotonic() - started
                down = (f"timed out after {self.client.timeout_s:g} s (KVB_CACHE_SERVER_TIMEOUT)"
                        if waited >= 0.9 * self.client.timeout_s else f"not answering ({text})")
            elif isinstance(exc, CacheServerRefused):
                down = f"refused ({text})"
            else:
                down = ""   # it answered with an error (a server from before probe_miss): it cannot say
            return MissProbe(history=[None] * len(keys), pending=[False] * len(keys), found=[""] * len(probes),
                             down={"cache server": f"{self.client.url}: {down}"} if down else {}, round_trips=1)
        return MissProbe(history=[entry.to_eviction() if entry is not None else None for entry in reply.history],
                         pending=list(reply.pending), found=list(reply.found), namespaces=dict(reply.namespaces),
                         down=dict(reply.down), round_trips=1)

    def recent_evictions(self, limit: int = 100) -> list[Eviction]:
        """The server's newest `limit` evictions, newest first; [] when it cannot be reached."""
        try:
            return self.client.recent_evictions(limit)
        except (CacheServerUnavailable, CacheServerError, CacheServerRefused) as exc:
            self._fault("recent_evictions", exc)
            return []

    # -- writing ---------------------------------------------------------------------------------
    def put(self, key: bytes, blob, meta: ObjectMeta) -> bool:
        key = check_key(key)
        if not isinstance(meta, ObjectMeta):
            raise TypeError(f"meta must be an ObjectMeta, got {type(meta).__name__}")
        self._counts["puts"] += 1
        try:
            stored, reason = self.client.store(key, blob, meta)
        except (CacheServerUnavailable, CacheServerError, CacheServerRefused) as exc:
            self._fault("store", exc)
            return False
        if not stored:
            self._counts["put_failures"] += 1
            self._counts[f"refused_{reason or 'unknown'}"] += 1
        return stored

    def put_many(self, items: list[tuple[bytes, object, ObjectMeta]]) -> list[bool]:
        """put() for a prompt's objects: one prepare and one commit for all of them."""
        items = [(check_key(key), blob, meta) for key, blob, meta in items]
        self._counts["puts"] += len(items)
        try:
            results = self.client.store_many(items)
        except (CacheServerUnavailable, CacheServerError, CacheServerRefused) as exc:
            self._fault("store", exc)
            return [False] * len(items)
        for stored, reason in results:
            if not stored:
                self._counts["put_failures"] += 1
                self._counts[f"refused_{reason or 'unknown'}"] += 1
        return [stored for stored, _ in results]

    def quiet(self):
        """TieredStore.quiet()'s place: nothing here writes behind a request (the server's own threads do)."""
        return nullcontext()

    @contextmanager
    def pinned(self, keys: Iterable[bytes]) -> Iterator[None]:
        """Nothing to pin here: the server keeps a leased object from eviction while it is read."""
        yield

    # -- housekeeping ----------------------------------------------------------------------------
    def clear(self, tier_name: str) -> None:
        """Empty one of the server's tiers (every client's objects); StoreFault when it cannot be reached."""
        if tier_name not in self.tier_names:
            raise ValueError(f"unknown tier {tier_name!r}; this store has: {', '.join(self.tier_names)}")
        try:
            self.client.clear(tier_name)
        except (CacheServerUnavailable, CacheServerError, CacheServerRefused) as exc:
            raise StoreFault(f"cannot clear {tier_name} on the cache server: {exc}") from exc

    def flush(self) -> int:
        try:
            return self.client.flush()
        except (CacheServerUnavailable, CacheServerError, CacheServerRefused) as exc:
            self._fault("flush", exc)
            return 0

    def close(self) -> None:
        self.client.close()

    def server_status(self) -> dict | None:
        """The server's status (each module's report under its name), or None when it cannot be reached."""
        try:
            return self.client.status()
        except (CacheServerUnavailable, CacheServerError, CacheServerRefused) as exc:
            self._fault("status", exc)
            return None

    def stats(self) -> dict:
        """TieredStore.stats()'s shape, with the server's tiers, plus what this client saw."""
        status = self.server_status() or {}
        storage = status.get("storage", {})
        tiers = storage.get("tiers") or {name: {"objects": 0, "bytes": 0, "capacity": 0, "hits": 0, "evictions": 0,
                                                "location": "cache server unreachable"} for name in self.tier_names}
        counts = self._counts
        return {
            "namespace": self.namespace,
            "tiers": tiers,
            "hits": {name: counts[f"hits_{name}"] for name in tiers},
            "misses": counts["misses"],
            "evictions": sum(t.get("evictions", 0) for t in tiers.values()),
            "puts": counts["puts"],
            "put_failures": counts["put_failures"],
            "unavailable": counts["unavailable"],
            "refused": counts["refused"],
            "server_errors": counts["server_errors"],
            "torn_copies": self.client.counters["torn_copies"],
            "server": {"url": self.client.url, "connected": self.client.connected, "server_id": self.client.server_id,
                       "shared_memory": self.client.shared_memory, "instance_id": self.client.instance_id,
                       "priority": self.client.priority, "client": dict(self.client.counters),
                       "status": status},
        }

    def fault_counts(self) -> dict:
        """This store's calls that failed, by cause (no server round trip, unlike stats())."""
        return {name: self._counts[name] for name in ("unavailable", "refused", "server_errors")}

    def _fault(self, what: str, exc: Exception) -> None:
        name = ("unavailable" if isinstance(exc, CacheServerUnavailable)
                else "refused" if isinstance(exc, CacheServerRefused) else "server_errors")
        self._counts[name] += 1
        log.warning("cache server %s: %s counted as a miss (%s)", self.client.url, what, exc)


register_remote_store(RemoteStoreKind(STORE_URL_KIND, RemoteStore.from_settings,
                                      "a KVBridge cache server at KVB_STORE_URL: its tiers, shared by every engine"))
