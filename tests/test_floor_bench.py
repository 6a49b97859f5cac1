"""bench-floor runs every path it is given on the real model and reports, per path, the warm ratio
against native, the floor (native + one copy), the restore against that copy and the stages; the
lmcache answers equal the cold ones. A small document (~290 tokens) and two questions keep it short here; the
benchmark itself (Docs/Research.md) runs the 1.9k-token document, both models and three runs.
"""
from __future__ import annotations

import pytest

from conftest import needs_model
from kvbridge.bench.floor_bench import format_floor, run_floor_bench
from kvbridge.errors import BadSettings
from tests.redis_helpers import needs_redis

pytestmark = [needs_model, pytest.mark.timeout(600)]

DOCUMENT = "\n\n".join(f"## Section {i}\nThe pump in room {i} runs {i + 2} hours a day and holds {i * 40} litres."
                       for i in range(1, 13))   # ~290 tokens: four 64-token chunks to restore on every path


@needs_redis
def test_the_floor_bench_reports_every_path_it_runs(make_settings):
    # one llama.cpp thread: on a shared 2-core machine two spinning threads slow llama.cpp down tenfold (this
    # test ran past its 600 s timeout in llama_decode with the default threads under a load of 15)
    settings = make_settings(chunk_size=64, n_predict=8, l1_bytes=256 << 20, threads=1)
    result = run_floor_bench(settings, paths=["in-process", "cache-server", "l3"], models=["smollm2-135m"], runs=1,
                             n_requests=2, document=DOCUMENT, say=lambda line: None)
    rows = {row["path"]: row for row in result["table"]}
    assert set(rows) == {"in-process", "cache-server", "l3"}
    for path, row in rows.items():
        assert not row["errors"], (path, row["errors"])
        assert row["native_ms"] > 0 and row["lmcache_ms"] > 0 and row["ratio"] > 0, path
        assert row["restored_bytes"] > 1 << 20 and row["copy_ms"] > 0 and row["restore_ms"] > 0, path
        assert row["floor_ms"] == pytest.approx(row["native_ms"] + row["copy_ms"]), path
        assert row["answers_compared"] == 2 and row["answers_equal"] == 2, path
        assert row["stages"]["lmcache"]["assemble"] > 0 and row["stages"]["native"]["assemble"] == 0, path
    assert rows["l3"]["stages"]["lmcache"]["fetch"] > 0
    text = format_floor(result)
    assert "cache-server" in text and "÷floor" in text


def test_unknown_paths_and_models_are_named(make_settings):
    with pytest.raises(BadSettings, match="--paths"):
        run_floor_bench(make_settings(), paths=["gpu"], say=lambda line: None)
    with pytest.raises(BadSettings, match="--models"):
        run_floor_bench(make_settings(), paths=["in-process"], models=["llama-70b"], say=lambda line: None)


def test_modes_take_turns_question_by_question_each_on_its_own_engine(make_settings):
    # the default of bench-floor: a change in the machine's speed during the run falls on both modes alike
    from kvbridge.backends import make_backend
    from kvbridge.bench.common.runner import run_interleaved
    from kvbridge.engine.cached_engine import CachedEngine

    settings = make_settings(chunk_size=64, n_predict=4, threads=1)
    with CachedEngine(settings, make_backend("llama.cpp", settings)) as native, \
            CachedEngine(settings.replace(l2_enabled=False), make_backend("llama.cpp", settings)) as lmcache:
        records = list(run_interleaved({"native": native, "lmcache": lmcache}, "doc-qa", n_requests=3,
                                       document=DOCUMENT))
    assert [(r.mode, r.request_index) for r in records] == [
        ("native", 1), ("lmcache", 1), ("native", 2), ("lmcache", 2), ("native", 3), ("lmcache", 3)]
    assert not any(r.error for r in records)
    native_warm = [r for r in records if r.mode == "native"][1:]
    lmcache_warm = [r for r in records if r.mode == "lmcache"][1:]
    assert all(r.engine_cached_tokens > 200 for r in native_warm)   # its own context kept the document
    assert all(r.matched_tokens > 200 and r.tier == "L1" for r in lmcache_warm)   # restored from its store
    assert [r.text for r in native_warm] == [r.text for r in lmcache_warm]
