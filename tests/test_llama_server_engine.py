"""CachedEngine on llama-server: the three modes, restores from L1 and L2, and chunks shared with llama.cpp in-process.

The oracle: greedy output after a restore equals the cold output, and llama-server's own
`timings.cache_n` shows the restored tokens were really reused.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvbridge.backends import make_backend
from kvbridge.settings import Settings
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.formats.llama_state import parse_state
from kvbridge.store import TieredStore

from test_llama_server import process_gone
from test_llama_server import pytestmark  # noqa: F401  (the same live marker and skip conditions)
from test_llama_server import server_binary_and_no_orphans  # noqa: F401  (autouse: build if needed, no orphans)

DOCUMENT = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(20))
QUESTION = [{"role": "user", "content": DOCUMENT + "\nWhat is 7 squared?"}]


@pytest.fixture
def settings(tmp_path) -> Settings:
    return dataclasses.replace(Settings(), ctx_size=2048, threads=1, chunk_size=16, n_predict=10,
                               l2_dir=str(tmp_path / "l2"), llama_start_timeout=60.0)


def engine_on(kind: str, settings: Settings) -> CachedEngine:
    return CachedEngine(settings, make_backend(kind, settings), TieredStore.from_settings(settings))


def test_three_modes_and_a_restore_equal_to_cold(settings):
    """Cold, native and lmcache (a miss, then an L1 hit) on one engine; the same engine then answers
    another question on the document (the restore file reused) and its stages add up to the TTFT."""
    with engine_on("llama-server", settings) as engine:
        cold = engine.infer(QUESTION, mode="cold")
        assert not cold.error and cold.text and cold.engine_cached_tokens == 0
        n = cold.prompt_tokens

        native = engine.infer(QUESTION, mode="native")
        assert native.engine_cached_tokens == n - 1 and native.text == cold.text

        first = engine.infer(QUESTION, mode="lmcache")       # a miss: computes, then stores
        assert first.matched_tokens == 0 and first.stored_objects > 0 and first.engine_cached_tokens == 0

        hit = engine.infer(QUESTION, mode="lmcache")
        assert hit.restore_ok is True and hit.tier == "L1"
        cut = engine.cut_rule.restorable(n)   # the engine prefills the rest as its cold run did (kvbridge.engine.cold_cut)
        assert hit.matched_tokens == cut and hit.chunks_hit == cut // settings.chunk_size
        assert hit.engine_cached_tokens == cut               # llama-server really reused the restore
        assert hit.prefill_tokens == n - cut and "ineffective" not in hit.notes
        assert hit.text == cold.text
        assert hit.ttft_ms < cold.ttft_ms
        assert "restore file reused" not in hit.notes                # the first hit builds the restore file

        reused_restore_file_gives_the_cold_answer_for_another_question(engine)
    stages_add_up_to_ttft_through_llama_server(cold, hit)


def test_restart_drops_the_server_and_l1_then_hits_l2(settings):
    with engine_on("llama-server", settings) as engine:
        cold = engine.infer(QUESTION, mode="cold")
        engine.infer(QUESTION, mode="lmcache")
        old_pid = engine.backend.server.pid
        engine.restart_backend(drop_l1=True)
        assert process_gone(old_pid) and engine.backend.server.pid != old_pid
        hit = engine.infer(QUESTION, mode="lmcache")
        assert hit.tier == "L2" and hit.restore_ok is True
        assert hit.engine_cached_tokens == hit.matched_tokens == engine.cut_rule.restorable(cold.prompt_tokens)
        assert hit.text == cold.text


def test_chunks_stored_in_process_restore_into_llama_server(settings):
    pytest.importorskip("llama_cpp")
    with engine_on("llamacpp", settings) as in_process:
        stored = in_process.infer(QUESTION, mode="lmcache")
        in_process_cold = in_process.infer(QUESTION, mode="cold")
        namespace = in_process.namespace
    assert stored.stored_objects > 0

    with engine_on("llama-server", settings) as server:     # a new store over the same L2 directory
        assert server.namespace == namespace, "equal model, cache types and V layout must share a namespace"
        hit = server.infer(QUESTION, mode="lmcache")
        assert hit.tier == "L2" and hit.restore_ok is True
        assert hit.engine_cached_tokens == hit.matched_tokens == server.cut_rule.restorable(hit.prompt_tokens)
        assert hit.text == in_process_cold.text
        cold = server.infer(QUESTION, mode="cold")
        assert cold.text == hit.text


def test_flash_attention_changes_the_namespace(settings):
    """V is not transposed with flash attention: such KV must never be restored into the other layout.

    With flash attention llama.cpp's CPU kernels give the last prompt token different logits when it
    is computed inside the prompt's batch (cold) and when it is computed alone after kept cells: on an
    AMD EPYC without AVX-512 llama-server's own prompt cache (`native`, all but the last token kept)
    answered "The answer is 7. 7 is the" where cold answered "7 squared is 289.". A restore ends on the
    cold cut (kvbridge.engine.cold_cut), so the engine computes the rest with the kernels of its cold
    run: the restored K and V rows equal the cold prefill's byte for byte, and the answer equals cold's
    token for token (the oracle), whatever llama-server's own reuse answers."""
    with engine_on("llama-server", settings) as plain:
        plain_ns = plain.namespace
    with engine_on("llama-server", dataclasses.replace(settings, flash_attn=True)) as flash:
        assert flash.namespace != plain_ns
        assert "v_trans=0" in flash.namespace
        cold = flash.infer(QUESTION, mode="cold")
        cold_kv = parse_state(flash.backend.save_state().data)
        native = flash.infer(QUESTION, mode="native")
        flash.infer(QUESTION, mode="lmcache")
        hit = flash.infer(QUESTION, mode="lmcache")
        hit_kv = parse_state(flash.backend.save_state().data)
        restored = flash.cut_rule.restorable(cold.prompt_tokens)
    assert hit.restore_ok is True and hit.engine_cached_tokens == hit.matched_tokens == restored
    assert native.engine_cached_tokens == cold.prompt_tokens - 1   # llama-server's own cache: all but the last
    assert cold_kv.geometry.v_trans == hit_kv.geometry.v_trans == 0
    for k_cold, k_hit, v_cold, v_hit in zip(cold_kv.k, hit_kv.k, cold_kv.v, hit_kv.v, strict=True):
        assert np.array_equal(k_cold[:restored], k_hit[:restored])
        assert np.array_equal(v_cold[:restored], v_hit[:restored])
    assert hit.text == cold.text


def test_attached_without_local_slot_files_restores_whole_snapshots(settings):
    """KVB_LLAMA_SERVER_URL and no slot directory here: the KV stays on the server, the store keeps references."""
    from kvbridge.backends.llama_server.backend import LlamaServerBackend

    own = LlamaServerBackend(settings)
    own.start()
    try:
        attached = dataclasses.replace(settings, llama_server_url=own.base_url)
        with engine_on("llama-server", attached) as engine:
            assert "whole snapshots" in engine.status()["kv_layout"]
            assert "not on this machine" in engine.status()["location"]
            cold = engine.infer(QUESTION, mode="cold")
            engine.infer(QUESTION, mode="lmcache")
            hit = engine.infer(QUESTION, mode="lmcache")
            assert hit.restore_ok is True and hit.matched_tokens == cold.prompt_tokens - 1
            assert hit.engine_cached_tokens == cold.prompt_tokens - 1 and hit.text == cold.text
    finally:
        own.stop()


def test_a_restore_the_server_does_not_use_is_marked_ineffective(settings):
    """Upstream bug class: the restore reports success, the next request reuses nothing (cache_n = 0)."""
    from kvbridge.backends.llama_server.backend import LlamaServerBackend

    class SilentlyFailingRestore(LlamaServerBackend):
        def restore_state(self, state, tokens):
            super().restore_state(state, tokens)
            self.reset_native_cache()   # what the bug amounts to: the slot is empty afterwards

    with CachedEngine(settings, SilentlyFailingRestore(settings), TieredStore.from_settings(settings)) as engine:
        cold = engine.infer(QUESTION, mode="cold")
        engine.infer(QUESTION, mode="lmcache")
        record = engine.infer(QUESTION, mode="lmcache")
        assert record.matched_tokens > 0 and record.engine_cached_tokens == 0
        assert record.restore_ok is False and "restore ineffective" in record.notes
        assert engine.metrics.count("restore_ineffective") == 1
        assert record.text == cold.text   # recomputed, still correct


def reused_restore_file_gives_the_cold_answer_for_another_question(engine: CachedEngine) -> None:
    """Questions on one document restore the same prefix: after QUESTION's hit, the second restore reloads
    the restore file (no rebuild), and the server trims what the new question does not share; output equals cold."""
    other = [{"role": "user", "content": DOCUMENT + "\nWhat is 12 squared?"}]
    cold = engine.infer(other, mode="cold")
    second_hit = engine.infer(other, mode="lmcache")       # same document prefix: the file is reused
    assert "restore file reused" in second_hit.notes and second_hit.restore_ok
    assert 0 < second_hit.matched_tokens < second_hit.prompt_tokens
    assert second_hit.engine_cached_tokens >= second_hit.matched_tokens
    assert second_hit.text == cold.text


def stages_add_up_to_ttft_through_llama_server(cold, hit) -> None:
    """Through llama-server the prefill is the server's own `timings.prompt_ms`; the slot file written
    and restored is the handoff; the stages add up to the TTFT within max(5 ms, 5 %)."""
    from kvbridge.engine.stages import stages_gap_ms

    assert hit.restore_ok and hit.text == cold.text
    for record in (cold, hit):
        assert abs(stages_gap_ms(record)) <= max(5.0, 0.05 * record.ttft_ms), record
    assert hit.prefill_ms > 0 and hit.handoff_ms > 0 and hit.assemble_ms > 0 and hit.prefill_tokens < cold.prefill_tokens
    assert hit.fetch_bytes > 0 and hit.fetch_tiers.startswith("L1=")
