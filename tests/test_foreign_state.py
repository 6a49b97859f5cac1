"""Stored token ids are the engine's own: another client using llama-server's slot before our save stores nothing.

A real llama-server on loopback and a real second HTTP client. Only the timing is arranged: the
backend's save step is wrapped so the other client's /completion (same slot) runs between our
generation and our `action=save`, which is the race a shared server allows.
"""
from __future__ import annotations

import dataclasses

import pytest
import requests

from kvbridge.backends import make_backend
from kvbridge.backends.llama_server.backend import LlamaServerBackend
from kvbridge.backends.llama_server.slots import SLOT_ID
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.settings import Settings
from kvbridge.store import TieredStore

from test_llama_server import pytestmark  # noqa: F401  (the same live marker and skip conditions)
from test_llama_server import server_binary_and_no_orphans  # noqa: F401  (autouse: build if needed, no orphans)

DOCUMENT = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(12))
QUESTION = [{"role": "user", "content": DOCUMENT + "\nWhat is 7 squared?"}]
OTHER_CLIENT_PROMPT = ("A different conversation entirely, about rivers and mountains and the sea, "
                       "which must never be restored under our prompt's hashes. ") * 3


@pytest.fixture
def settings(tmp_path) -> Settings:
    return dataclasses.replace(Settings(), ctx_size=2048, threads=1, chunk_size=16, n_predict=6,
                               l2_dir=str(tmp_path / "l2"), llama_start_timeout=60.0)


def other_client_uses_the_slot(base_url: str) -> None:
    """A plain HTTP client, not KVBridge: a completion of its own on the slot KVBridge uses."""
    body = {"prompt": OTHER_CLIENT_PROMPT, "n_predict": 4, "id_slot": SLOT_ID, "cache_prompt": True,
            "temperature": 0.0}
    resp = requests.post(f"{base_url}/completion", json=body, timeout=120)
    resp.raise_for_status()
    assert resp.json()["id_slot"] == SLOT_ID


def stored_objects(engine: CachedEngine) -> int:
    return sum(tier["objects"] for tier in engine.store.stats()["tiers"].values())


def race_before_save(engine: CachedEngine) -> None:
    """Let the other client run after our generation, right before our `action=save`."""
    backend = engine.backend
    real_save = backend.save_state

    def save_after_the_other_client():
        backend.save_state = real_save   # once
        other_client_uses_the_slot(backend.base_url)
        return real_save()

    backend.save_state = save_after_the_other_client


def assert_nothing_stored_then_no_foreign_restore(engine: CachedEngine) -> None:
    race_before_save(engine)
    raced = engine.infer(QUESTION, mode="lmcache")
    assert not raced.error and raced.text
    assert raced.stored_objects == 0 and stored_objects(engine) == 0
    assert engine.metrics.count("store_skipped_foreign_state") == 1
    assert "nothing stored" in raced.notes and "another client" in raced.notes

    following = engine.infer(QUESTION, mode="lmcache")    # nothing to restore: computed, then stored
    assert following.matched_tokens == 0 and following.restore_ok is not True
    assert following.stored_objects > 0
    cold = engine.infer(QUESTION, mode="cold")
    hit = engine.infer(QUESTION, mode="lmcache")          # what is stored now is really ours
    assert hit.restore_ok is True and hit.matched_tokens > 0 and hit.text == cold.text == following.text


def test_another_client_between_generation_and_save_stores_nothing(settings):
    """Slot files readable here: the slot file's own token ids are the other client's."""
    with CachedEngine(settings, make_backend("llama-server", settings), TieredStore.from_settings(settings)) as engine:
        assert_nothing_stored_then_no_foreign_restore(engine)


def test_attached_without_slot_files_another_client_stores_nothing(settings):
    """KV kept on the server by name: the slot's latest task is not our /completion any more."""
    own = LlamaServerBackend(settings)
    own.start()
    try:
        attached = dataclasses.replace(settings, llama_server_url=own.base_url)
        with CachedEngine(attached, make_backend("llama-server", attached), TieredStore.from_settings(attached)) as engine:
            assert engine.backend.kv_by_reference
            assert_nothing_stored_then_no_foreign_restore(engine)
    finally:
        own.stop()


def test_held_tokens_is_the_servers_own_count_after_a_restore(settings):
    backend = LlamaServerBackend(settings)
    backend.start()
    try:
        assert backend.held_tokens() is None      # nothing restored yet
        from test_llama_server import prompt_for, run

        prompt = prompt_for(backend, QUESTION)
        run(backend, prompt, native=False, n_predict=2)
        state = backend.save_state()
        assert state.token_ids[: len(prompt.tokens)] == prompt.tokens   # the slot file's own ids
        tokens = list(state.token_ids)
        backend.reset_native_cache()
        backend.restore_state(state, tokens)
        assert backend.held_tokens() == len(tokens)
    finally:
        backend.stop()


def test_a_restore_the_server_counts_differently_is_ineffective_and_recomputed(settings):
    """The server restores another slot file than the one assembled (as if it were replaced meanwhile):
    its own n_restored disagrees with what CachedEngine restored, so nothing is generated on it."""

    class RestoresAnotherFile(LlamaServerBackend):
        other_file = ""

        def _restore_file(self, name, wanted):
            super()._restore_file(self.other_file or name, wanted)

    with CachedEngine(settings, RestoresAnotherFile(settings), TieredStore.from_settings(settings)) as engine:
        cold = engine.infer(QUESTION, mode="cold")
        engine.infer(QUESTION, mode="lmcache")
        backend = engine.backend
        other = engine.infer([{"role": "user", "content": "Name a colour."}], mode="cold")
        saved = requests.post(f"{backend.base_url}/slots/{SLOT_ID}?action=save", json={"filename": "kvb-other.bin"},
                              timeout=60).json()
        assert 0 < saved["n_saved"] < cold.prompt_tokens and other.text
        backend.other_file = "kvb-other.bin"
        record = engine.infer(QUESTION, mode="lmcache")
        assert backend.held_tokens() == saved["n_saved"]
        assert record.restore_ok is False and "restore ineffective" in record.notes
        assert engine.metrics.count("restore_ineffective") == 1
        assert record.text == cold.text
