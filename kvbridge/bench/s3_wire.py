"""What the S3 tier does on the wire: the HTTP requests of a lookup, and a request's lookup while S3 is down.

Place in the flow: chunk hashes -> **TieredStore.lookup** (S3Tier.discover_many: one listing of new
markers) -> get_many -> ...; `bench-s3` parts (c) and (d), beside kvbridge.bench.s3_bench (as
kvbridge.bench.l3_wire is beside bench-l3).

- counting_requests / lookup_round_trips (c): boto3's before-send event, counted by operation;
- down_both_ways (d): a killed private weed (the port refuses) and a silent port (accepts TCP, never
  answers: a call waits KVB_S3_TIMEOUT), each against the same lookup on a store without S3.
"""
from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections import Counter
from typing import Callable, Iterator

from kvbridge.bench.common.report import stored_prefix
from kvbridge.errors import KVBridgeError
from kvbridge.settings import Settings
from kvbridge.store import TieredStore


def s3_tier(store: TieredStore):
    """The store's S3 tier (the bench always has one)."""
    return store.tiers[store.tier_names.index("S3")]


@contextlib.contextmanager
def counting_requests(client) -> Iterator[Counter]:
    """Every HTTP request `client` (boto3) sends while inside, by operation: boto3's before-send event."""
    sent: Counter = Counter()

    def count(event_name: str, **_) -> None:
        sent[event_name.rpartition(".")[2]] += 1

    client.meta.events.register("before-send.s3", count)
    try:
        yield sent
    finally:
        client.meta.events.unregister("before-send.s3", count)


# -- (c) a lookup's round trips --------------------------------------------------------------------
def lookup_round_trips(engine, settings: Settings, prompt_tokens: int = 2048) -> dict:
    """HTTP requests of a lookup of a 2k-token prompt by a process that starts with nothing in memory.

    A fresh S3 tier (its own client) on the bench's prefix makes its first listing; then the engine
    stores a 2k-token prefix (so the fresh tier does not know it) and the fresh tier looks up its chunk
    keys: another host's first lookup of a prompt, in a namespace it has never seen (one more GET: the
    namespace's text, once per process). Then the same again (now in its index), a lookup of keys nobody
    stored, and a second new prompt of the same length stored by the engine (the document's paragraphs
    in reverse order: no chunk in common), looked up now that the namespace is known: the steady state.
    Runs before the other parts, so the prefixes are new to the bucket.
    """
    import os

    from kvbridge.store.s3_tier import S3Tier

    # no upkeep thread (start=False): its listing every 15 s would race the lookups counted here
    reader = S3Tier(settings.s3_url, settings.s3_bucket, access_key=os.environ[settings.s3_access_key_env],
                    secret_key=os.environ[settings.s3_secret_key_env], prefix=settings.s3_prefix,
                    region=settings.s3_region, timeout=settings.s3_timeout, start=False)
    try:
        with counting_requests(reader._client) as sent:
            reader.refresh()                                         # what a fresh process lists at start
        start_requests = dict(sent)
        engine.store.drain()
        _, tokens, hashes = stored_prefix(engine, prompt_tokens)     # run first: nothing else stored yet
        if not engine.store.drain():
            raise KVBridgeError("the S3 writes of the lookup's prompt did not finish within 30 s")
        keys = list(hashes)
        rows = {}
        for what in ("unknown_held", "known", "not_held", "next_prompt"):
            asked = {"not_held": lambda: [bytes(reversed(key)) for key in keys],
                     "next_prompt": lambda: _other_prompt(engine, len(tokens))}.get(what, lambda: keys)()
            with counting_requests(reader._client) as sent:
                start = time.perf_counter()
                sizes = reader.discover_many(asked)
                ms = (time.perf_counter() - start) * 1e3
            rows[what] = {"round_trips": sum(sent.values()), "requests": dict(sent),
                          "n_hit": sum(size is not None for size in sizes), "ms": ms}
    finally:
        reader.close()
    return {"keys": len(keys), "prompt_tokens": len(tokens), "first_listing": start_requests, **rows}


def _other_prompt(engine, n_tokens: int) -> list[bytes]:
    """Store a prompt of `n_tokens` sharing no chunk with the document's own (its paragraphs reversed);
    its chunk keys, once the write behind it is done."""
    from kvbridge.bench.common.scenarios import builtin_document

    backend = engine.backend
    text = "\n\n".join(reversed(builtin_document().split("\n\n")))
    tokens = backend.tokenize(text)
    while len(tokens) < n_tokens:
        tokens = tokens + tokens
    engine.infer(backend.detokenize(tokens[:n_tokens]), mode="lmcache", n_predict=1)
    if not engine.store.drain():
        raise KVBridgeError("the S3 writes of the lookup's second prompt did not finish within 30 s")
    prompt = engine.prepare(backend.detokenize(tokens[:n_tokens]))
    return list(engine.hasher.chunk_hashes(list(prompt.tokens)))


# -- (d) the endpoint down ------------------------------------------------------------------------
def down_both_ways(engine, settings: Settings, server, later: int = 10) -> dict:
    """(d): the private weed killed (the port refuses) and a silent port (accepts TCP, never answers)."""
    from kvbridge.bench.l3_wire import SilentServer

    def as_s3(url: str, prefix: str) -> Settings:
        return settings.replace(s3_url=url, s3_prefix=prefix, l3_url="")

    out: dict = {}
    silent = SilentServer()
    try:
        port = silent.url.rsplit(":", 1)[1].split("/")[0]         # SilentServer speaks no protocol: any URL
        out["silent"] = _lookups_down(engine, as_s3(f"http://127.0.0.1:{port}", f"{settings.s3_prefix}-down"), later)
    finally:
        silent.close()
    if server is None:
        out["killed"] = {"skipped": "KVB_S3_URL is the user's endpoint: the bench kills only a private weed"}
    else:
        out["killed"] = _lookups_down(engine, as_s3(settings.s3_url, f"{settings.s3_prefix}-down"), later,
                                      before_first=server.kill)
    return out


def _lookups_down(engine, settings: Settings, later: int, before_first: Callable[[], None] | None = None) -> dict:
    """A request's store lookup (ChunkKV.find_prefix) with S3 down; later ones against a store without S3."""
    from kvbridge.bench.common.scenarios import build_requests
    from kvbridge.engine.chunks import ChunkKV

    messages = build_requests("doc-qa", 1)[0].messages
    tokens = list(engine.prepare(list(messages)).tokens)
    hashes = engine.hasher.chunk_hashes(tokens)
    seed = getattr(engine.hasher, "seed", b"")
    with tempfile.TemporaryDirectory(prefix="kvb-bench-s3-down-") as temp:
        store = TieredStore.from_settings(settings.replace(l2_dir=f"{temp}/a"), namespace=engine.namespace)
        base = TieredStore.from_settings(settings.replace(s3_url="", l2_dir=f"{temp}/b"), namespace=engine.namespace)
        kv = ChunkKV(store, engine.namespace, seed, settings.chunk_size, engine.geometry)
        base_kv = ChunkKV(base, engine.namespace, seed, settings.chunk_size, engine.geometry)
        tier = s3_tier(store)

        def lookup(which) -> float:
            start = time.perf_counter()
            which.find_prefix(tokens, hashes).release()
            return (time.perf_counter() - start) * 1e3

        try:
            result: dict = {"timeout_s": tier.timeout}
            if before_first is not None:
                tier.wait_ready()
                result["healthy_ms"] = lookup(kv)
                before_first()
            result["first_ms"] = lookup(kv)      # a fresh tier's first listing, or this lookup, meets the fault
            result["state_after_first"] = tier.health()["state"]
            pairs = [(lookup(kv), lookup(base_kv)) for _ in range(later)]
            result.update(later=later, later_ms=statistics.median(a for a, _ in pairs),
                          later_max_ms=max(a for a, _ in pairs), baseline_ms=statistics.median(b for _, b in pairs),
                          baseline_max_ms=max(b for _, b in pairs))
            health = tier.health()
            result.update(state_after_later=health["state"], skipped_down=health["skipped_down"],
                          reason=health["reason"],
                          counts={k: v for k, v in health.items() if isinstance(v, int) and not isinstance(v, bool)})
        finally:
            for each in (kv, base_kv, store, base):
                each.close()
    return result
