"""KVB_CACHE_SERVER_CHECKSUM: an object read out of shared memory is checked against its writer's digest.

The pages' generation shows a page that was freed or reused; it cannot show a page that a writer
which should have stopped (a paused writer whose pages were wrongly freed) overwrote in place. Real
server, real clients, the real /dev/shm segment: an object is stored, then bytes are written into
its pages behind the pool's back, as such a writer would, and read with checksums on and off.
"""
from __future__ import annotations

import pytest

from cache_server_helpers import running_server
from kvbridge.cache_server.client import CacheClient
from kvbridge.store.objects import ObjectMeta

PAGE = 64 << 10
META = ObjectMeta(namespace="ns", n_tokens=1, tokens_digest=b"", kind="chunk")
KEY = b"k" * 16
BLOB = bytes(range(256)) * (3 * PAGE // 256)


def overwrite_in_place(server, key: bytes) -> None:
    """What a writer past its lease does: bytes into the object's pages, its generation untouched."""
    lease = server.store.pool.acquire_read(key, "the-test")
    try:
        server.store.segment.write(list(lease.pages)[:1], b"\xee" * 100)
    finally:
        server.store.pool.release(lease.lease_id, "the-test")


@pytest.mark.parametrize("how", ["shared memory", "inline"])
def test_an_object_overwritten_in_place_is_a_counted_miss_with_checksums_on(make_settings, how):
    settings = make_settings(l1_bytes=32 * PAGE, cache_server_page_bytes=PAGE, l2_enabled=False,
                             cache_server_checksum=True)
    with running_server(settings) as server:
        # an inline store's bytes are written into the pages by the server, which adds their digest itself
        with CacheClient(server.url, timeout_s=5, checksum=True, use_shm=how == "shared memory") as writer:
            assert writer.store(KEY, BLOB, META)[0]
        with CacheClient(server.url, timeout_s=5, checksum=True) as reader:
            whole = reader.retrieve(KEY, "ns", zero_copy=False)
            assert whole is not None and bytes(whole.blob) == BLOB and reader.counters["checksum_mismatches"] == 0
            overwrite_in_place(server, KEY)
            assert reader.retrieve(KEY, "ns", zero_copy=False) is None       # copied out, checked, refused
            view = reader.retrieve(KEY, "ns")                                  # a zero-copy view, then intact()
            assert view is not None and bytes(view.blob) != BLOB
            assert not reader.intact(view)
            reader.release([view])
            assert reader.counters["checksum_mismatches"] == 2
        with CacheClient(server.url, timeout_s=5, checksum=False) as unchecked:   # the generation alone passes it
            found = unchecked.retrieve(KEY, "ns", zero_copy=False)
            assert found is not None and bytes(found.blob) != BLOB
        server.store.pool.check_invariants()


def test_a_digest_is_checked_only_when_its_writer_gave_one(make_settings):
    settings = make_settings(l1_bytes=32 * PAGE, cache_server_page_bytes=PAGE, l2_enabled=False)
    with running_server(settings) as server:
        with CacheClient(server.url, timeout_s=5, checksum=False) as writer:
            assert writer.store(KEY, BLOB, META)[0]
        with CacheClient(server.url, timeout_s=5, checksum=True) as reader:
            found = reader.retrieve(KEY, "ns", zero_copy=False)
            assert found is not None and bytes(found.blob) == BLOB
            assert reader.counters["unchecked_reads"] == 1 and reader.counters["checksum_mismatches"] == 0
