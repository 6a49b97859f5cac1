"""The protocol fuzzer (kvbridge.bench.probes.protocol_fuzz) against a real cache server process, bounded for
CI: a few thousand seeded malformed and adversarial messages, hostile frame sizes and unfinished
multipart messages, then what a user would check. The server is alive, every parsable message of the
member got an answer and the stranger (no token) none, a real client reads back intact what it stored
before, nothing of the fuzzer's session is left (no lease, no pending or quarantined page once it
said goodbye), and the server's memory stayed bounded. Then the server stops and a squatter takes its
port: the owner's client refuses it and it receives nothing. `python -m kvbridge.bench.probes.protocol_fuzz`
runs a longer round (Docs/Research.md).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from cache_server_helpers import ServerProcess, local_url, server_env
from kvbridge.bench.probes.protocol_fuzz import fuzz, squat_round, unfinished_multipart
from kvbridge.cache_server.curve import key_file
from kvbridge.cache_server.client import CacheClient
from kvbridge.store.objects import ObjectMeta

META = ObjectMeta(namespace="ns", n_tokens=1, tokens_digest=b"", kind="chunk")


def peak_rss_mb(pid: int, field: str = "VmHWM") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")


@pytest.mark.parametrize("seed", [1, 2])
def test_thousands_of_hostile_messages_leave_the_server_serving_and_clean(make_settings, tmp_path, seed):
    settings = make_settings(l1_bytes=32 << 20, cache_server_max_message_bytes=16 << 20)
    url = local_url()
    server = ServerProcess(server_env(settings), url, log_path=tmp_path / "server.log")
    try:
        with CacheClient(url, timeout_s=10) as client:
            assert client.store(b"k" * 16, b"kept" * 1000, META)[0]
            client.flush()
        report = fuzz(url, count=2500, seed=seed, deadline_s=120, max_message_bytes=16 << 20)
        assert server.proc.poll() is None, f"the server died: {server.tail()}"
        assert report.sent == 2500 and report.replies >= 0.6 * report.sent, report.summary()
        assert "internal_error" not in report.codes, report.summary()   # every refusal names its reason
        assert report.unauthenticated > 300 and report.stranger_replies == 0, report.summary()
        assert report.hostile_sizes > 5 and report.codes["too_large"] >= report.hostile_sizes, report.summary()
        before = peak_rss_mb(server.proc.pid, "VmRSS")
        taken = unfinished_multipart(url, frames=64)   # 64 MiB flagged "more", never finished
        assert taken < 16 << 20, f"the server took {taken >> 20} MiB of an unauthenticated peer's frames"
        assert peak_rss_mb(server.proc.pid, "VmRSS") - before < 24
        with CacheClient(url, timeout_s=10) as client:
            kept = client.retrieve(b"k" * 16, "ns")
            assert kept is not None and bytes(kept.blob) == b"kept" * 1000 and client.intact(kept)
            client.release([kept])
            client.lookup([b"z" * 16])                                   # after the release landed
            pool = client.status()["storage"]["pool"]
        assert pool["write_leases"] == 0 and pool["pending_pages"] == 0 and pool["quarantined_pages"] == 0
        assert pool["read_leases"] == 0 and pool["zombie_leases"] == 0
        assert peak_rss_mb(server.proc.pid) < 1024, "a hostile message made the server grow past 1 GiB"
        assert server.terminate() == 0 and not key_file(url).exists()
        for curve in (False, True):   # the port taken while the owner's server is down
            squat = squat_round(url, curve=curve)
            assert str(key_file(url)) in squat["refused"] and squat["messages"] == 0 and not squat["saw_object"]
    finally:
        server.close()
