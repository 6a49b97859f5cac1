"""Which KV layouts are restored, and proof that a restore hands llama.cpp the bytes a cold prefill makes.

- kv_support decides from what llama.cpp says about the model: plain, the proven sliding-window and
  recurrent/hybrid architectures accepted, unproven ones refused (named in the reason).
- Crafted states: a layout the model does not announce never parses; a chunk missing window rows is
  never written; an engine whose model is refused stores and restores nothing, counted and noted.
- On Gemma 3 (real model, in-process): the state assembled from stored chunks for a prefix, given
  only the window's cells, equals byte for byte the state llama.cpp writes after a cold prefill of that
  prefix (global cache and sliding window); the restore itself carries every cell of both caches.
"""
from __future__ import annotations

import struct

import numpy as np
import pytest

from kvbridge.backends.base import EngineReport, Prompt
from kvbridge.backends.llamacpp import LlamaCppBackend
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.engine.chunks import ChunkKV
from kvbridge.engine.hashing import make_hasher
from kvbridge.formats.architectures import ModelTraits, kv_support
from kvbridge.formats.llama_chunks import assemble_state, assembled_size, encode_chunk
from kvbridge.formats.llama_state import LayoutError, parse_state
from kvbridge.settings.models import EMBEDDED_MODELS
from kvbridge.store import TieredStore

GEMMA = EMBEDDED_MODELS["gemma3-270m"]
SMOL = EMBEDDED_MODELS["smollm2-135m"]
needs_gemma = pytest.mark.skipif(not GEMMA.path.is_file(), reason=f"{GEMMA.path} missing: ./scripts/setup.sh --model gemma3-270m")
needs_smol = pytest.mark.skipif(not SMOL.path.is_file(), reason=f"{SMOL.path} missing: ./scripts/setup.sh")


@pytest.mark.parametrize("traits, layout, named", [
    (ModelTraits("llama", 30, 0, False, False), "plain", ""),
    (ModelTraits("qwen2", 24, 0, False, False), "plain", ""),
    (ModelTraits("gemma3", 18, 512, False, False), "sliding-window", ""),
    (ModelTraits("mamba", 24, 0, True, False), "refused", "mamba architecture is recurrent"),
    (ModelTraits("granitehybrid", 40, 0, False, True), "recurrent", ""),
    (ModelTraits("mamba2", 24, 0, True, False), "recurrent", ""),
    (ModelTraits("jamba", 32, 0, False, True), "refused", "jamba architecture is hybrid"),
    (ModelTraits("qwen3next", 48, 0, False, True), "recurrent", ""),
    (ModelTraits("nemotron_h", 52, 0, False, True), "refused", "nemotron_h"),
    (ModelTraits("gpt-oss", 24, 128, False, False), "sliding-window", ""),
    (ModelTraits("llama4", 48, 8192, False, False), "sliding-window", ""),
    (ModelTraits("phi3", 32, 2047, False, False), "refused", "phi3 architecture uses sliding-window"),
    (ModelTraits("falcon-h1", 4, 64, False, True), "refused", "with sliding-window attention"),
])
def test_kv_support_decides_from_the_model(traits, layout, named):
    support = kv_support(traits)
    assert support.layout == layout
    assert named in support.reason and (support.refused == bool(support.reason))
    if layout == "sliding-window":
        assert support.window == traits.n_swa


# real states -------------------------------------------------------------------------------------

def prefill(backend: LlamaCppBackend, tokens, n_predict: int = 1) -> None:
    report = EngineReport()
    for _ in backend.generate(Prompt(text="", tokens=tuple(tokens)), n_predict=n_predict, temperature=0.0,
                              use_native_cache=False, report=report):
        pass


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from kvbridge.settings import Settings

    if not GEMMA.path.is_file():
        pytest.skip(f"{GEMMA.path} missing: ./scripts/setup.sh --model gemma3-270m")
    backend = LlamaCppBackend(Settings(model="gemma3-270m", ctx_size=2048))
    backend.start()
    yield backend
    backend.stop()


def handbook_tokens(backend, n: int) -> list[int]:
    from kvbridge.bench.common.scenarios import builtin_document

    return backend.tokenize(builtin_document())[:n]


@needs_gemma
@pytest.mark.live
@pytest.mark.slow
def test_layouts_parse_only_as_the_model_announces(gemma):
    prefill(gemma, handbook_tokens(gemma, 40))
    data = bytes(gemma.save_state().data)
    with pytest.raises(LayoutError, match="trailing bytes"):
        parse_state(data)                         # a plain reading of a two-cache state
    parsed = parse_state(data, window=512)
    assert parsed.geometry.sections == (3, 15) and parsed.geometry.window == 512
    # crafted: cut the second cache off, as a model announced as sliding-window that wrote one cache
    base_end = len(data) - _second_cache_size(parsed)
    with pytest.raises(LayoutError, match="holds one cache"):
        parse_state(data[:base_end], window=512)
    # crafted: the sliding-window cache claims positions that do not end where the global cache does
    shifted = bytearray(data)
    meta = base_end + 4 + 4
    pos0 = struct.unpack_from("<i", shifted, meta)[0]
    for i in range(parsed.n_cells - parsed.window_start):
        struct.pack_into("<i", shifted, meta + 12 * i, pos0 + i + 7)
    with pytest.raises(LayoutError, match="not the last ones"):
        parse_state(bytes(shifted), window=512)


def _second_cache_size(parsed) -> int:
    g, cells = parsed.geometry, parsed.n_cells - parsed.window_start
    return 8 + 12 * cells + 8 + sum(24 + cells * (g.k_rows[i] + g.v_rows[i]) for i in g.windowed_layers)


@needs_smol
@pytest.mark.live
def test_a_plain_model_state_is_not_read_as_sliding_window(tmp_path):
    from kvbridge.settings import Settings

    backend = LlamaCppBackend(Settings(ctx_size=512))
    backend.start()
    try:
        prefill(backend, backend.tokenize("The quick brown fox jumps over the lazy dog."))
        data = bytes(backend.save_state().data)
    finally:
        backend.stop()
    assert parse_state(data).geometry.window == 0
    with pytest.raises(LayoutError, match="holds one cache"):
        parse_state(data, window=512)


@needs_gemma
@pytest.mark.live
@pytest.mark.slow
def test_restored_state_equals_a_cold_prefill_byte_for_byte(gemma, tmp_path):
    """Chunks stored from a 700-token prompt (window rows captured back to position 0), assembled for
    a 640-token prefix: exactly the bytes llama.cpp writes after a cold prefill of that prefix."""
    tokens = handbook_tokens(gemma, 700)
    store = TieredStore.from_settings(_settings(tmp_path))
    hasher = make_hasher(64, "ns-test", False)
    prefill(gemma, tokens, n_predict=3)
    geometry = parse_state(gemma.save_state().data, window=512).geometry
    kv = ChunkKV(store, "ns-test", hasher.seed, 64, geometry)
    stored = kv.store_prompt(gemma.save_state(), tokens, hasher.chunk_hashes(tokens), capture=gemma.capture_window)
    assert stored == 700 // 64 + 2 and kv.incomplete == 0
    prefix = tokens[:641]
    plan = kv.find_prefix(prefix + [1, 2, 3], hasher.chunk_hashes(prefix + [1, 2, 3]))
    assert plan.matched_tokens == 641 and plan.chunks_hit == 10
    restored = bytes(assemble_state(geometry, plan.pieces, window_only=True))
    whole = bytes(kv.assemble(plan).data)      # what a restore hands llama.cpp: every sliding-window cell too
    prefill(gemma, prefix, n_predict=1)           # cold: the context holds exactly the 641-token prefix
    cold = gemma.save_state()
    cold_parsed = parse_state(cold.data, window=512)
    assert cold_parsed.window_start == 641 - 512
    assert restored == bytes(cold.data)
    # the default restore carries the window's rows for all 641 positions, the ones before the window
    # being the rows the captures took: the global cache's bytes are the same as in the cold state
    assert len(whole) == assembled_size(geometry, 641) > len(restored)
    base = len(restored) - _second_cache_size(cold_parsed)
    assert whole[:base] == restored[:base]
    kv.close()
    store.close()


@needs_gemma
@pytest.mark.live
@pytest.mark.slow
def test_without_captured_window_rows_nothing_unprovable_is_stored(gemma, tmp_path):
    """No capture: only the objects inside the last window are stored; encode_chunk refuses the rest."""
    tokens = handbook_tokens(gemma, 700)
    prefill(gemma, tokens, n_predict=1)
    state = gemma.save_state()
    parsed = parse_state(state.data, window=512)
    with pytest.raises(LayoutError, match="were not captured"):
        encode_chunk(parsed, 0, 64, tokens[:64])
    store = TieredStore.from_settings(_settings(tmp_path))
    hasher = make_hasher(64, "ns-test", False)
    kv = ChunkKV(store, "ns-test", hasher.seed, 64, parsed.geometry)
    hashes = hasher.chunk_hashes(tokens)
    stored = kv.store_prompt(state, tokens, hashes)        # no capture
    assert kv.incomplete >= 1
    assert store.lookup(hashes, namespace="ns-test").n_hit == 0    # chunk 0 needs rows no state holds
    assert stored <= 2                                            # at most the tails inside the window
    plan = kv.plan_restore(tokens[:650] + [5], hasher.chunk_hashes(tokens[:650] + [5]))
    assert plan.matched_tokens == 0
    kv.close()
    store.close()


def test_assembly_writes_only_the_window_cells():
    """A hand-built two-cache geometry: the assembled sliding-window cache holds positions n-window..n-1."""
    from kvbridge.formats.llama_chunks import ChunkView
    from kvbridge.formats.llama_state import KVGeometry

    g = KVGeometry(0, 2, (1, 1), (4, 4), (1, 1), (4, 4), (0, 0), (0, 0), sections=(1, 1), window=3)
    views = []
    for start in (0, 4):
        ids = np.arange(start, start + 4, dtype="<i4")
        k = [np.full((4, 4), 10 * layer, np.uint8) + ids[:, None].astype(np.uint8) for layer in range(2)]
        views.append((ChunkView(4, ids, k, [arr + 100 for arr in k]), 4 if start == 0 else 2))
    data = bytes(assemble_state(g, views, window_only=True))
    assert len(data) == assembled_size(g, 6, window_only=True)
    parsed = parse_state(data, window=3)
    assert parsed.n_cells == 6 and parsed.window_start == 3
    assert parsed.k[0][:, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert parsed.k[1][:, 0].tolist() == [13, 14, 15]
    assert parsed.v[1][:, 0].tolist() == [113, 114, 115]
    # by default every cell of both caches: the layout a cold prefill leaves in a full-size SWA cache
    whole = parse_state(bytes(assemble_state(g, views)), window=6)
    assert whole.window_start == 0 and whole.k[1][:, 0].tolist() == [10, 11, 12, 13, 14, 15]


class _HybridBackend(LlamaCppBackend):
    """The real in-process engine on SmolLM2, told by its traits that the model is hybrid."""

    def model_traits(self):
        return ModelTraits("jamba", 30, 0, False, True)


@needs_smol
@pytest.mark.live
def test_a_refused_model_runs_uncached_counted_and_noted(make_settings, short_doc):
    settings = make_settings()
    with CachedEngine(settings, _HybridBackend(settings)) as engine:
        assert "jamba" in engine.kv_refusal and engine.status()["kv_layout"] == "refused: uncached"
        prompt = [{"role": "user", "content": short_doc[:400] + "\n\nWho leads the team?"}]
        first = engine.infer(prompt, mode="lmcache", n_predict=6)
        again = engine.infer(prompt, mode="lmcache", n_predict=6)
        cold = engine.infer(prompt, mode="cold", n_predict=6)
        assert first.stored_objects == 0 and again.matched_tokens == 0 and again.text == cold.text
        assert "KV caching refused" in again.notes and "jamba" in again.notes
        assert engine.metrics.snapshot()["counters"]["kv_refused"] == 2
        assert engine.store.stats()["tiers"]["L1"]["objects"] == 0
        assert "refused" in engine.namespace


def _settings(tmp_path):
    from kvbridge.settings import Settings

    return Settings().replace(l2_dir=str(tmp_path / "l2"), l1_bytes=1 << 30)
