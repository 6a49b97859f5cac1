"""A test per miss cause (issue 35): each cause built on purpose, through CachedEngine on a real model, and the
record checked for the code (RequestRecord.miss_reason) AND the text a person reads (miss_detail).

Real parts only: the embedded SmolLM2 (and zoo models for the sliding-window and recurrent causes), real files
for L2, a real redis-server for L3, a real ZMQ cache server. The cost is checked too: a hit makes no extra store
call (explain_ms 0, the same store calls as with KVB_EXPLAIN_MISSES off), an in-process miss no round trip, a miss
with L3 the calls it sends to Redis (counted as they leave), a miss through a cache server at most one.

The causes that need the store's `probe_miss` (evicted, other_namespace, tier_down, lease_busy) skip, naming the
condition, while the store in use has none: without it they are `none_stored` by design (engine/misses.py).
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import time

import pytest

from conftest import needs_model
from kvbridge.backends.llamacpp import LlamaCppBackend
from kvbridge.bench.common.scenarios import builtin_document
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.engine.misses import MISS_REASONS, parse_hit_tiers
from kvbridge.errors import StateTransferError
from kvbridge.models import zoo_model
from kvbridge.settings import Settings
from kvbridge.store import TieredStore

pytestmark = [needs_model, pytest.mark.live, pytest.mark.timeout(300)]

DOC = builtin_document()
# each test its own stretch of the handbook, so the tests sharing one engine never share a stored prefix
PIECES = [DOC[i:i + 600] for i in range(0, 6000, 600)]
# questions that diverge well before a restore's end (the last 8 to 15 tokens are always computed: cold_cut)
Q1, Q2 = ("\nQuestion: where is Well One, and who inspects it each spring?",
          "\nQuestion: who runs the pump house, and when does it close for the winter?")
needs_probe = pytest.mark.skipif(not hasattr(TieredStore, "probe_miss"),
                                 reason="TieredStore.probe_miss is not there yet (issue 35, the store side): "
                                        "without it this cause reads none_stored by design")


def base_settings(tmp, **changes) -> Settings:
    """The zoo's llama (a real GGUF: llama.cpp's plain attention, random weights, SmolLM2's tokenizer) unless
    `model_path` says otherwise: a tenth of SmolLM2's prefill, the same cache mechanics."""
    fields = dict(model_path=str(zoo_model("llama")), chunk_size=32, ctx_size=1024, n_predict=2,
                  l2_dir=str(tmp / "l2"), output_dir=str(tmp / "out"), input_dir=str(tmp / "in"))
    fields.update(changes)
    return dataclasses.replace(Settings(), **fields)


def assert_cause(record, reason: str, *words: str) -> None:
    """The record names `reason` and its detail says each of `words`; the answer itself was not harmed."""
    assert not record.error, record.error
    assert record.miss_reason == reason, (record.miss_reason, record.miss_detail, record.notes)
    assert reason in MISS_REASONS
    for word in words:
        assert word in record.miss_detail, f"{word!r} not in the detail: {record.miss_detail!r}"


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    return base_settings(tmp_path_factory.mktemp("misses"))


@pytest.fixture(scope="module")
def engine(settings):
    with CachedEngine(settings, LlamaCppBackend(settings)) as e:
        yield e


# -- causes found from the plan alone (no store call) -----------------------------------------------------
def test_cold_mode_is_cold(engine):
    record = engine.infer(PIECES[0] + Q1, mode="cold")
    assert_cause(record, "cold", "cold mode")
    assert record.hit_tiers == "" and record.explain_ms == 0


def test_a_prompt_never_stored_is_none_stored_from_token_0(engine):
    record = engine.infer(PIECES[1] + Q1, mode="lmcache")
    assert_cause(record, "none_stored", f"from token 0 of {record.prompt_tokens}", "nothing is stored")
    assert record.matched_tokens == 0 and record.hit_tiers == ""


def test_a_prompt_that_extends_a_stored_one_is_none_stored_not_diverged(engine):
    stored = engine.infer(PIECES[2] + Q1, mode="lmcache")
    longer = engine.infer(PIECES[2] + Q1 + " Answer in one word, then say why.", mode="lmcache")
    assert stored.stored_objects > 0
    rule = engine.cut_rule   # the stored prompt, cut back to where the engine's restores may end
    assert longer.matched_tokens == rule.cut(stored.prompt_tokens, longer.prompt_tokens)
    assert_cause(longer, "none_stored", f"the store holds the first {stored.prompt_tokens} tokens",
                 "nothing stored continues it")
    if longer.matched_tokens < stored.prompt_tokens:   # the detail says why the restore stops short of them
        assert f"restored to token {longer.matched_tokens}: restores end on a grid of {rule.grid} tokens" in longer.miss_detail
    assert parse_hit_tiers(longer.hit_tiers) == {"L1": longer.matched_tokens}


def test_the_same_document_with_another_question_is_diverged_at_the_question(engine):
    engine.infer(PIECES[3] + Q1, mode="lmcache")
    record = engine.infer(PIECES[3] + Q2, mode="lmcache")
    assert 0 < record.matched_tokens < engine.cut_rule.restorable(record.prompt_tokens)
    assert_cause(record, "diverged", "diverges from a stored prompt at token ")
    at = int(re.search(r"at token (\d+)", record.miss_detail).group(1))   # restored to there, cut back to the grid
    assert engine.cut_rule.cut(at, record.prompt_tokens) == record.matched_tokens
    here, _, stored = record.miss_detail.partition("stored …")
    assert "who runs" in here and "where is" in stored      # the text either side, ours and the stored one
    assert parse_hit_tiers(record.hit_tiers) == {"L1": record.matched_tokens}


def test_a_prompt_sharing_no_token_with_the_stored_one_is_none_stored_not_diverged_at_0(engine):
    # under two chunks, so the stored prompt's tail at the seed (its whole text) is what the lookup reads
    engine.infer("Ledger of the eastern pumps, kept weekly by the night shift. " * 2, mode="lmcache")
    record = engine.infer("Rainfall at the reservoir was recorded each morning in millimetres. " * 2, mode="lmcache")
    assert_cause(record, "none_stored", "from token 0", "nothing is stored under this prompt's first chunk")


def test_a_hit_costs_no_store_call_and_no_explain_time(engine, settings):
    prompt = PIECES[4] + Q1
    engine.infer(prompt, mode="lmcache")
    on = engine.infer(prompt, mode="lmcache")
    try:
        engine.settings = settings.replace(explain_misses=False)
        off = engine.infer(prompt, mode="lmcache")
    finally:
        engine.settings = settings
    again = engine.infer(prompt, mode="lmcache")
    for record in (on, off, again):
        assert record.matched_tokens == engine.cut_rule.restorable(record.prompt_tokens) and record.miss_reason == "", record.miss_detail
        assert record.explain_ms == 0
    assert again.store_calls == off.store_calls     # the same restore, explained or not
    assert on.hit_tiers == f"L1={on.matched_tokens}"


def test_a_miss_in_process_costs_no_extra_store_call(engine, settings):
    try:
        engine.settings = settings.replace(explain_misses=False)
        off = engine.infer(PIECES[5] + Q1, mode="lmcache")
    finally:
        engine.settings = settings
    on = engine.infer(PIECES[6] + Q1, mode="lmcache")
    assert off.miss_reason == on.miss_reason == "none_stored"   # without a probe the plan alone still names it
    assert on.store_calls == off.store_calls


def test_a_miss_with_l3_costs_the_round_trips_it_sends(tmp_path):
    """With a remote tier the probe's calls are counted as they leave (issue 46: they read 0 whatever was sent):
    a miss with no other namespace stored sends one, the read of L3's namespace registry once its listing has
    aged past its reuse time; an extra call on the way shows in store_calls."""
    from kvbridge.store.redis_tier import REGISTRY_TTL_S
    from kvbridge.store.tiered_history import NAMESPACES_TTL_S
    from tests.redis_helpers import RedisServer, needs_redis

    if needs_redis.args[0]:
        pytest.skip(needs_redis.kwargs["reason"])
    with RedisServer() as server:
        settings = base_settings(tmp_path, l2_enabled=False, l3_url=server.url)
        with CachedEngine(settings, LlamaCppBackend(settings)) as engine:
            engine.settings = settings.replace(explain_misses=False)
            off = engine.infer(PIECES[7] + Q1, mode="lmcache")
            engine.settings = settings
            time.sleep(max(REGISTRY_TTL_S, NAMESPACES_TTL_S) + 0.1)   # the listing must be read again: one trip
            on = engine.infer(PIECES[8] + Q1, mode="lmcache")
    assert off.miss_reason == on.miss_reason == "none_stored", on.miss_detail
    assert on.store_calls - off.store_calls == 1


def test_a_one_token_prompt_is_below_chunk(engine):
    tokens = engine.backend.tokenize("Hi")
    assert len(tokens) == 1
    record = engine.infer("Hi", mode="lmcache")
    assert_cause(record, "below_chunk", "one token")


# -- refused --------------------------------------------------------------------------------------------
class HeldWrongBackend(LlamaCppBackend):
    """The real engine, which after a restore claims to hold one position more than was restored."""

    def held_tokens(self):
        held = super().held_tokens()
        return None if held is None else held + 1


class FailingRestoreBackend(LlamaCppBackend):
    def restore_state(self, state, tokens):
        raise StateTransferError("simulated: the engine rejected the state")


@pytest.mark.parametrize("backend, words", [
    (HeldWrongBackend, ("the engine refused the restored state", "positions after restoring")),
    (FailingRestoreBackend, ("refused the restored state", "simulated: the engine rejected the state")),
])
def test_a_restored_state_the_engine_refuses_is_refused(tmp_path, backend, words):
    settings = base_settings(tmp_path)
    with CachedEngine(settings, backend(settings)) as engine:
        prompt = PIECES[7] + Q1
        engine.infer(prompt, mode="lmcache")
        cold = engine.infer(prompt, mode="cold")
        record = engine.infer(prompt, mode="lmcache")
    assert_cause(record, "refused", *words)
    assert record.restore_ok is False and record.text == cold.text


# -- zoo models: sliding window, recurrent ----------------------------------------------------------------
ZOO_DOC = ("The harbour office keeps three ledgers: arrivals, departures and repairs. Each ship that docks "
           "is written into the first, with its tonnage, its captain and the berth it was given. ") * 4


def zoo_settings(tmp, arch: str, seed: int = 0, path=None):
    return base_settings(tmp, model_path=str(path or zoo_model(arch, seed=seed)), ctx_size=1024)


class NoWindowCapture(LlamaCppBackend):
    """The real engine whose capture of earlier sliding-window rows comes back empty (as an engine that cannot)."""

    def capture_window(self, n_tokens):
        return None


def test_a_prompt_whose_window_rows_were_not_captured_is_window_incomplete(tmp_path):
    settings = zoo_settings(tmp_path, "gemma2")
    with CachedEngine(settings, NoWindowCapture(settings)) as engine:
        first = engine.infer(ZOO_DOC + Q1, mode="lmcache")
        again = engine.infer(ZOO_DOC + Q1, mode="lmcache")
    assert "not stored" in first.notes
    assert_cause(again, "window_incomplete", "not stored by this process", "sliding-window rows of positions 0..")


def test_a_recurrent_restore_to_the_last_chunk_end_is_no_miss(tmp_path):
    settings = zoo_settings(tmp_path, "mamba2")
    with CachedEngine(settings, LlamaCppBackend(settings)) as engine:
        assert engine.geometry is not None and engine.geometry.recurrent
        stored = engine.infer(ZOO_DOC + Q1, mode="lmcache")
        # the same prompt but its last words: restored to the last chunk's end before the prompt's end, the most a
        # restore may give (the engine prefills these models chunk by chunk, and a cold run's step ends there)
        record = engine.infer(ZOO_DOC + "\nQuestion: where is the harbour?", mode="lmcache")
    assert stored.stored_objects > 0
    assert record.matched_tokens == (record.prompt_tokens - 1) // 32 * 32 > 0
    assert not record.error and record.miss_reason == "", (record.miss_reason, record.miss_detail)


class NoRecurrentCapture(LlamaCppBackend):
    """A path that cannot keep the recurrent state at chunk boundaries (as llama-server's cannot)."""

    captures_recurrent = False


def test_an_architecture_refused_on_a_path_is_refused(tmp_path):
    settings = zoo_settings(tmp_path, "mamba2")
    with CachedEngine(settings, NoRecurrentCapture(settings)) as engine:
        assert engine.kv_refusal
        record = engine.infer(ZOO_DOC + Q1, mode="lmcache")
    assert_cause(record, "refused", "the architecture is refused", engine.kv_refusal[:40])


# -- causes the store's probe names -----------------------------------------------------------------------
@needs_probe
def test_a_prompt_evicted_from_a_small_l1_is_evicted_with_tier_policy_and_what_it_made_room_for(tmp_path):
    # the zoo llama's KV is ~1.3 kB a token: one ~170-token prompt is ~220 kB, so 300 kB hold one prompt, not two
    settings = base_settings(tmp_path, l1_bytes=300 << 10, l2_enabled=False)
    with CachedEngine(settings, LlamaCppBackend(settings)) as engine:
        first = engine.infer(PIECES[8] + Q1, mode="lmcache")
        engine.infer(PIECES[9] + Q1, mode="lmcache")
        record = engine.infer(PIECES[8] + Q1, mode="lmcache")
    assert first.stored_objects > 0
    assert_cause(record, "evicted", "from token 0", "evicted from L1", "by LRU", "to make room for a", "chunk")


@needs_probe
def test_a_prompt_stored_with_another_k_type_is_other_namespace_naming_the_field(tmp_path):
    settings = base_settings(tmp_path)
    prompt = PIECES[0] + Q2
    with CachedEngine(settings, LlamaCppBackend(settings)) as engine:
        assert engine.infer(prompt, mode="lmcache").stored_objects > 0
    f32 = settings.replace(cache_type_k="f32")
    with CachedEngine(f32, LlamaCppBackend(f32)) as engine:     # a fresh engine, a fresh L1, the same L2
        record = engine.infer(prompt, mode="lmcache")
    assert_cause(record, "other_namespace", "stored in L2 under another namespace", "cache_type_k f16→f32")


@needs_probe
def test_a_changed_model_file_is_other_namespace_naming_model_sha256(tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copyfile(zoo_model("llama", seed=0), path)
    settings = zoo_settings(tmp_path, "llama", path=path)
    with CachedEngine(settings, LlamaCppBackend(settings)) as engine:
        assert engine.infer(ZOO_DOC + Q1, mode="lmcache").stored_objects > 0
    shutil.copyfile(zoo_model("llama", seed=1), path)           # the same file name, other weights
    with CachedEngine(settings, LlamaCppBackend(settings)) as engine:
        record = engine.infer(ZOO_DOC + Q1, mode="lmcache")
    assert_cause(record, "other_namespace", "model_sha256 ")
    assert "cache_type" not in record.miss_detail                # only the file changed


@needs_probe
@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_redis_l3_that_is_down_is_tier_down_naming_l3(tmp_path, how):
    from tests.redis_helpers import RedisServer, needs_redis

    if needs_redis.args[0]:
        pytest.skip(needs_redis.kwargs["reason"])
    with RedisServer() as server:
        settings = base_settings(tmp_path, l2_enabled=False, l3_url=server.url, l3_timeout=0.5)
        with CachedEngine(settings, LlamaCppBackend(settings)) as engine:
            # under two chunks each: both write the tail at the seed, so the first one asked again re-stores that
            # tail and its L3 write waits in the queue while the second is asked (stuck behind the down tier)
            prompts = [PIECES[1][:150], PIECES[2][:150]]
            for prompt in prompts:
                assert engine.infer(prompt, mode="lmcache").stored_objects > 0
            engine.store.drain()                 # the write-behind has reached L3
            engine.store.clear("L1")             # only L3 holds the prompts now
            if how == "killed":
                server.kill()
            else:
                os.kill(server.pid, signal.SIGSTOP)
            try:
                records = [engine.infer(prompt, mode="lmcache") for prompt in prompts]
            finally:
                if how == "stopped":
                    os.kill(server.pid, signal.SIGCONT)
    for record in records:
        assert_cause(record, "tier_down", "L3")


@needs_probe
def test_a_write_still_leased_on_the_cache_server_is_lease_busy_and_a_miss_costs_one_round_trip(make_settings):
    from kvbridge.cache_server import protocol
    from kvbridge.cache_server.client import CacheClient
    from kvbridge.cache_server.protocol import Kind
    from kvbridge.engine.hashing import tail_key, tokens_digest
    from kvbridge.store import ObjectMeta
    from tests.cache_server_helpers import SMALL_POOL, running_server

    settings = make_settings(n_predict=2, model_path=str(zoo_model("llama")), ctx_size=1024,
                             **dict(SMALL_POOL, l1_bytes=16 << 20))
    with running_server(settings) as server:
        on = settings.replace(store_url=server.url)
        with CachedEngine(on, LlamaCppBackend(on)) as engine:
            if not hasattr(engine.store, "probe_miss"):
                pytest.skip("RemoteStore.probe_miss is not there yet (issue 35, the store side)")
            prompt = PIECES[2] + Q2
            tokens = list(engine.prepare(prompt).tokens)
            hashes = engine.hasher.chunk_hashes(tokens)
            # another writer has prepared the prompt's first chunk and its tail and not committed them yet
            writer = CacheClient(server.url, timeout_s=5.0)
            try:
                for key, n in ((hashes[0], 32), (tail_key(engine.hasher.seed), len(tokens) - 1)):
                    meta = ObjectMeta(namespace=engine.namespace, n_tokens=n, tokens_digest=tokens_digest(tokens[:n]),
                                      kind="chunk" if n == 32 else "tail")
                    reply = writer._call(Kind.STORE_PREPARE, protocol.StorePrepare(key, 4096, protocol.WireMeta.of(meta)),
                                         protocol.PrepareReply)
                    assert reply.accepted, reply
                record = engine.infer(prompt, mode="lmcache")
            finally:
                writer.close()
            assert_cause(record, "lease_busy", "being written")
            # the cost of a miss through the server: at most one round trip more than with explaining off
            fresh = PIECES[3] + Q2
            engine.settings = on.replace(explain_misses=False)
            off = engine.infer(fresh, mode="lmcache")
            engine.settings = on
            explained = engine.infer(PIECES[4] + Q2, mode="lmcache")
            assert off.miss_reason == explained.miss_reason == "none_stored"
            assert explained.store_calls - off.store_calls <= 1
            hit = engine.infer(PIECES[4] + Q2, mode="lmcache")
            assert hit.miss_reason == "" and hit.explain_ms == 0
