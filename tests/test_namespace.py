"""The namespace: the model-hash cache notices a replaced file, and different models never share one."""
from __future__ import annotations

import json
import os

from kvbridge.engine.namespace import build_namespace, file_sha256


def test_a_file_replaced_with_the_same_size_and_mtime_is_hashed_again(tmp_path):
    model, cache = tmp_path / "model.gguf", tmp_path / "model-sha256.json"
    model.write_bytes(b"GGUF" + b"a" * 4096)
    first = file_sha256(model, cache)
    stat = model.stat()
    # another file of the same size moved over the path, its mtime set back to the old one's
    replacement = tmp_path / "download.part"
    replacement.write_bytes(b"GGUF" + b"b" * 4096)
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(replacement, model)
    after = model.stat()
    assert (after.st_size, after.st_mtime_ns) == (stat.st_size, stat.st_mtime_ns) and after.st_ino != stat.st_ino
    second = file_sha256(model, cache)
    assert second != first
    assert len(json.loads(cache.read_text())) == 1   # the stale entry for this path is gone


def test_the_cache_answers_for_an_unchanged_file(tmp_path):
    model, cache = tmp_path / "model.gguf", tmp_path / "model-sha256.json"
    model.write_bytes(b"GGUF" + b"a" * 4096)
    first = file_sha256(model, cache)
    key = next(iter(json.loads(cache.read_text())))
    cache.write_text(json.dumps({key: "from-the-cache"}))
    assert file_sha256(model, cache) == "from-the-cache" != first


def test_two_model_identities_give_two_namespaces():
    """Chunk and whole-snapshot objects are all keyed under this one namespace string."""
    base = {"engine_family": "llama.cpp", "cache_type_k": "f16", "cache_type_v": "f16", "kv_layout": "snapshot"}
    a = build_namespace({**base, "model_sha256": "a" * 64}, 256)
    b = build_namespace({**base, "model_sha256": "b" * 64}, 256)
    served = build_namespace({**base, "server_model": "n_params=134515008 n_vocab=49152"}, 256)
    assert len({a, b, served}) == 3


# --- an attached llama-server whose model file is elsewhere ---------------------------------------

PROPS = {"model_path": "/srv/models/smollm2-135m-q4_1.gguf", "model_ftype": "Q4_1", "build_info": "b7000-abc1234",
         "total_slots": 1, "default_generation_settings": {"n_ctx": 2048}}
MODELS = {"data": [{"id": "smollm2", "meta": {"vocab_type": 2, "n_vocab": 49152, "n_ctx_train": 8192, "n_embd": 576,
                                              "n_params": 134515008, "size": 85929216, "ftype": "Q4_1"}}]}


def test_what_the_server_reports_identifies_its_model():
    from kvbridge.backends.llama_server.identity import server_identity

    identity = server_identity("http://10.0.0.5:8080", PROPS, MODELS)
    assert identity.identified
    keys = identity.fingerprint()
    assert keys["server_model_n_params"] == "134515008" and keys["server_model_size"] == "85929216"
    assert keys["server_model_path"] == PROPS["model_path"] and keys["server_n_ctx"] == "2048"
    assert "server_run" not in keys   # an identified model keeps its namespace across restarts
    assert server_identity("http://10.0.0.5:8080", PROPS, MODELS).fingerprint() == keys
    requantised = {"data": [{"meta": {**MODELS["data"][0]["meta"], "size": 101000000, "ftype": "Q5_K_M"}}]}
    assert server_identity("http://10.0.0.5:8080", PROPS, requantised).fingerprint() != keys


def test_a_server_that_does_not_identify_its_model_gets_a_namespace_of_its_own():
    from kvbridge.backends.llama_server.identity import server_identity

    bare = {"build_info": "b7000-abc1234", "default_generation_settings": {"n_ctx": 2048}}
    first = server_identity("http://10.0.0.5:8080", bare, None)
    again = server_identity("http://10.0.0.5:8080", bare, None)   # a reconnect (after a restart)
    assert not first.identified
    assert first.fingerprint()["server_address"] == "http://10.0.0.5:8080"
    assert first.fingerprint() != again.fingerprint()


def test_whole_snapshots_are_not_found_under_another_models_namespace(make_settings):
    """Snapshot fallback objects (KV layout not understood) are filed under the namespace like chunks."""
    from kvbridge.backends.base import SeqState
    from kvbridge.engine.chunks import ChunkKV
    from kvbridge.store import TieredStore

    tokens = list(range(100, 180))
    seed, hashes = b"s" * 32, [bytes([i]) * 32 for i in range(5)]   # equal keys on purpose
    state = SeqState(data=b"opaque engine bytes", n_tokens=len(tokens), token_ids=tuple(tokens))
    store = TieredStore.from_settings(make_settings())
    base = {"engine_family": "llama.cpp", "kv_layout": "snapshot"}
    model_a = ChunkKV(store, build_namespace({**base, "model_sha256": "a" * 64}, 16), seed, 16, None)
    model_b = ChunkKV(store, build_namespace({**base, "model_sha256": "b" * 64}, 16), seed, 16, None)
    try:
        assert model_a.store_prompt(state, tokens, hashes) > 0
        assert model_a.find_prefix(tokens, hashes).matched_tokens == len(tokens) - 1
        assert model_b.find_prefix(tokens, hashes).matched_tokens == 0
    finally:
        model_a.close()
        model_b.close()
        store.close()
