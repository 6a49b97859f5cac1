"""An attached llama-server (KVB_LLAMA_SERVER_URL) that runs a sliding-window model without --swa-full
is found out at start, with a message that says what to change; one with --swa-full starts as before.

Real llama-server processes on loopback (the one scripts/build_llama_server.sh builds), started the
way a user would start their own, with Gemma 3 270M (a sliding-window model), attached with their
slot directory so KV travels through slot files.
"""
from __future__ import annotations

import contextlib
import dataclasses

import pytest

from conftest import needs_llama_server_and_model
from kvbridge.backends.llama_server.backend import LlamaServerBackend
from kvbridge.backends.llama_server.process import ServerProcess, built_binary, free_port, pinned_llama_cpp_version
from kvbridge.errors import EngineUnavailable
from kvbridge.settings.models import EMBEDDED_MODELS

GEMMA = EMBEDDED_MODELS["gemma3-270m"].path
pytestmark = [*needs_llama_server_and_model(),
              pytest.mark.skipif(not GEMMA.is_file(), reason=f"{GEMMA} missing: ./scripts/setup.sh --model gemma3-270m")]


@contextlib.contextmanager
def users_own_server(*extra: str):
    """llama-server as a user starts it, with Gemma 3 and a 2048-token context."""
    args = ["--model", str(GEMMA), "--ctx-size", "2048", "--parallel", "1", "--threads", "2",
            "--no-webui", "--no-warmup", *extra]
    server = ServerProcess(built_binary(pinned_llama_cpp_version()), args, "127.0.0.1", free_port())
    server.start()
    try:
        server.wait_healthy(120)
        yield server
    finally:
        server.stop()


def attached(settings, server) -> LlamaServerBackend:
    return LlamaServerBackend(dataclasses.replace(settings, engine="llama-server", llama_server_url=server.url,
                                                  llama_server_slot_dir=str(server.slot_dir), ctx_size=2048))


def test_a_window_model_without_swa_full_is_refused_at_start(make_settings):
    with users_own_server() as server:
        backend = attached(make_settings(), server)
        with pytest.raises(EngineUnavailable, match="without a full-size sliding-window cache.*--swa-full"):
            backend.start()
        assert not backend.base_url                              # nothing half-started is left
        assert server.alive() and not list(server.slot_dir.glob("kvb-swa-probe-*"))


def test_a_window_model_with_swa_full_starts(make_settings):
    with users_own_server("--swa-full") as server:
        backend = attached(make_settings(), server)
        backend.start()
        try:
            assert backend.base_url == server.url
        finally:
            backend.stop()
