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
