"""The cache server over real ZMQ sockets and real shared memory: who may connect, the data path,
the plugin contract with modules that live in tests/cs_live_plugins, bad input, liveness with a
SIGKILLed client, Prometheus metrics, and a clean stop of the real command.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import Future

import pytest
import zmq

from kvbridge.cache_server import protocol
from kvbridge.cache_server.client import CacheClient, CacheServerError, CacheServerRefused
from kvbridge.cache_server.protocol import Code, Kind, ServerModuleCallRequest
from kvbridge.cache_server.server import CacheServer
from kvbridge.errors import BadSettings
from kvbridge.store import ObjectMeta, TieredStore
from kvbridge.store.disk import DirectoryOwned
from tests.cache_server_helpers import (PROJECT, SMALL_POOL, ServerProcess, free_port, local_url, running_server,
                                        server_env)

pytestmark = [pytest.mark.live, pytest.mark.timeout(120)]
META = ObjectMeta("ns", 4, bytes(16))


def blob_of(n: int, seed: int = 1) -> bytes:
    pattern = bytes((i * seed + seed) % 251 for i in range(251))
    return (pattern * (n // 251 + 1))[:n]


@pytest.fixture
def settings(make_settings):
    return make_settings(**SMALL_POOL)


@pytest.fixture
def server(settings):
    with running_server(settings) as srv:
        yield srv


def raw_request(url: str, frames: list[bytes], timeout_ms: int = 3000) -> protocol.Reply:
    """Send frames as they are from a bare DEALER (with this user's CURVE keys) and decode the one reply."""
    from kvbridge.cache_server.auth import client_token
    from kvbridge.cache_server.curve import apply_client, client_keys

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    apply_client(sock, client_keys(url, client_token(url)))
    sock.connect(url)
    try:
        sock.send_multipart(frames)
        assert sock.poll(timeout_ms), "the server did not answer"
        return protocol.decode_reply(sock.recv_multipart()[0])
    finally:
        sock.close()


def hello_frames(instance: str, version: int = protocol.PROTOCOL_VERSION) -> list[bytes]:
    return [protocol.encode_request(1, instance, Kind.HELLO, protocol.Hello(version, "", 5))]


# -- connecting -------------------------------------------------------------------------------------


def test_status_has_each_module_under_its_name_and_the_module_graph(server):
    with CacheClient(server.url, timeout_s=5) as client:
        assert client.ping().server_id == server.server_id
        status = client.status()
    for name in ("lookup", "storage", "management", "metrics"):
        assert name in status, f"{name} missing from status"
    assert status["storage"]["pool"]["level"] == "OK"
    rows = {row["name"]: row for row in status["server"]["modules"]}
    assert set(rows) >= {"lookup", "storage", "management", "metrics"}
    assert rows["lookup"]["class"].endswith("LookupModule")
    assert [c["instance_id"] for c in status["management"]["clients"]] == [client.instance_id]


def test_status_shows_another_clients_id_only_cut_short(server):
    """An id is what a lease is released by: a client sees its own in full, another's as 8 characters."""
    with CacheClient(server.url, timeout_s=5, label="first") as first, \
            CacheClient(server.url, timeout_s=5, label="second") as second:
        first.ping()
        rows = {row["label"]: row["instance_id"] for row in second.status()["management"]["clients"]}
    assert rows["second"] == second.instance_id
    assert rows["first"] == first.instance_id[:8] + "…" and first.instance_id not in str(rows)


def test_a_token_is_required_when_configured_and_never_echoed(settings):
    with running_server(settings, token="s3cret-value") as srv:
        with pytest.raises(CacheServerRefused) as refused:
            CacheClient(srv.url, timeout_s=5)
        assert "token" in str(refused.value) and "KVB_CACHE_SERVER_TOKEN_ENV" in str(refused.value)
        assert "s3cret-value" not in str(refused.value)
        with pytest.raises(CacheServerRefused):
            CacheClient(srv.url, timeout_s=5, token="wrong")
        with CacheClient(srv.url, timeout_s=5, token="s3cret-value") as client:
            assert client.ping().server_id == srv.server_id


def test_by_default_only_this_user_holds_the_token_and_it_is_gone_at_close(settings):
    from kvbridge.cache_server.auth import token_file

    with running_server(settings) as srv:
        path = token_file(srv.url)
        assert srv.token and path.read_text() == srv.token
        assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(path.parent.stat().st_mode & 0o777) == "0o700"
        with CacheClient(srv.url, timeout_s=5) as client:      # found without configuration
            assert client.ping().server_id == srv.server_id
        with pytest.raises(CacheServerRefused, match="only the OS user who started the server"):
            CacheClient(srv.url, timeout_s=5, token="guessed")
    assert not path.exists()


def test_a_request_from_another_connection_naming_a_client_is_refused(server):
    """Identity is the connection that said hello, not the instance id a request carries."""
    with CacheClient(server.url, timeout_s=5) as owner:
        owner.store(b"q" * 16, blob_of(10_000), META)
        owner.flush()
        found = owner.retrieve(b"q" * 16, "ns")
        from kvbridge.cache_server.auth import client_token
        from kvbridge.cache_server.connection import Connection
        from kvbridge.cache_server.curve import client_keys

        # another connection (this user's keys, so past the handshake), the owner's id, no hello
        impostor = Connection(server.url, owner.instance_id, client_keys(server.url, client_token(server.url)))
        try:
            reply, _ = impostor.send(Kind.RELEASE, protocol.Release([found.lease_id])).result(5)
        finally:
            impostor.close()
        assert not reply.success and reply.code == Code.HELLO_REQUIRED
        assert server.store.pool.stats()["read_leases"] == 1     # the owner's lease is still held
        assert owner.intact(found)
        owner.release([found])


def test_the_token_comes_from_the_variable_the_setting_names(settings):
    from kvbridge.cache_server.auth import read_token

    named = settings.replace(cache_server_token_env="KVB_TEST_SECRET_HOLDER")
    assert read_token(named, {"KVB_TEST_SECRET_HOLDER": "abc"}) == "abc"
    with pytest.raises(BadSettings, match="KVB_CACHE_SERVER_TOKEN_ENV names KVB_TEST_SECRET_HOLDER"):
        read_token(named, {})


def test_a_protocol_version_mismatch_names_both_versions(server):
    reply = raw_request(server.url, hello_frames("old-client", version=protocol.PROTOCOL_VERSION + 41))
    assert not reply.success and reply.code == Code.VERSION
    assert f"version {protocol.PROTOCOL_VERSION + 41}" in reply.error
    assert f"version {protocol.PROTOCOL_VERSION}" in reply.error


def test_a_request_before_hello_is_answered_hello_required(server):
    frame = protocol.encode_request(7, "stranger", Kind.PING)
    reply = raw_request(server.url, [frame])
    assert reply.request_id == 7 and reply.code == Code.HELLO_REQUIRED


# -- the data path ----------------------------------------------------------------------------------


# The data path's ways: shared memory; inline bytes each object in one frame (the format before issue 47,
# what an older peer sends and asks for); inline bytes cut into frames (small frames here, so that a test
# object spans several and its last frame is a short one).
DATA_PATHS = [dict(use_shm=True), dict(use_shm=False, frame_bytes=0),
              dict(use_shm=False, frame_bytes=protocol.MIN_INLINE_FRAME_BYTES)]
DATA_PATH_IDS = ["shared-memory", "inline-whole", "inline-frames"]


@pytest.mark.parametrize("path", DATA_PATHS, ids=DATA_PATH_IDS)
def test_store_and_retrieve_return_the_same_bytes(server, path):
    use_shm = path["use_shm"]
    blob = blob_of(200_000, 3)
    with CacheClient(server.url, timeout_s=5, **path) as client:
        assert client.shared_memory is use_shm
        assert client.store(b"k" * 16, blob, META) == (True, "")
        assert client.lookup([b"k" * 16, b"x" * 16], "ns").tiers == ["L1"]
        found = client.retrieve(b"k" * 16, "ns")
        assert found.tier == "L1" and bytes(found.blob) == blob
        assert client.intact(found)
        client.release([found])
        assert client.retrieve(b"k" * 16, "other-namespace") is None
        client.flush()   # after the release (same client); the disk writer's own lease is done too
    stats = server.store.pool.stats()
    assert stats["read_leases"] == 0 and stats["write_leases"] == 0


@pytest.mark.parametrize("path", DATA_PATHS, ids=DATA_PATH_IDS)
def test_a_prompts_objects_go_and_come_back_in_one_call_each(server, path):
    # sizes around the frame size: one short of a frame, a frame and a byte, three frames and a bit
    sizes = [protocol.MIN_INLINE_FRAME_BYTES - 1, protocol.MIN_INLINE_FRAME_BYTES + 1,
             3 * protocol.MIN_INLINE_FRAME_BYTES + 7]
    blobs = {bytes([i]) * 16: blob_of(size, i + 2) for i, size in enumerate(sizes, 1)}
    with CacheClient(server.url, timeout_s=5, **path) as client:
        first = next(iter(blobs))
        client.store(first, blobs[first], META)
        results = client.store_many([(key, blob, META) for key, blob in blobs.items()])
        assert results[0][0] is True and results[1:] == [(True, ""), (True, "")]   # the first one existed
        keys = list(blobs) + [b"missing" * 2]
        found = client.retrieve_many(keys, "ns")
        assert found[-1] is None
        for key, item in zip(keys, found[:-1]):
            assert bytes(item.blob) == blobs[key] and item.tier == "L1"
            assert client.intact(item)
        client.release([item for item in found if item is not None])
        client.flush()
    assert server.store.pool.stats()["read_leases"] == 0 and server.store.pool.stats()["objects"] == 3


def test_a_lone_store_after_the_first_goes_into_pages_lent_ahead(server):
    """A commit brings a grant; the next lone store copies into it and is named in one round trip. The bytes
    come back, an existing chunk leaves the grant with the client, and goodbye gives it back."""
    blobs = {bytes([i]) * 16: blob_of(150_000 + 1000 * i, i + 4) for i in range(1, 5)}
    with CacheClient(server.url, timeout_s=5) as client:
        for key, blob in blobs.items():
            assert client.store(key, blob, META) == (True, "")
        assert client.counters["granted_stores"] == 3       # all but the first
        assert server.store.pool.stats()["write_leases"] == 1   # the grant for the next store
        first = next(iter(blobs))
        assert client.store(first, blobs[first], META) == (True, "exists")
        assert client.counters["granted_stores"] == 4 and client._grant is not None
        big = blob_of(400_000, 9)                                # larger than the grant: given back, stored as usual
        assert client.store(b"b" * 16, big, META) == (True, "")
        for key, blob in {**blobs, b"b" * 16: big}.items():
            found = client.retrieve(key, "ns", zero_copy=False)
            assert bytes(found.blob) == blob
        client.flush()
    assert server.store.pool.stats()["write_leases"] == 0 and server.store.pool.stats()["read_leases"] == 0
    server.store.pool.check_invariants()
    with CacheClient(server.url, timeout_s=5, grants=False) as client:   # as before issue 47: prepare and commit
        for i in range(3):
            assert client.store(bytes([i + 10]) * 16, blob_of(150_000, i + 10), META) == (True, "")
        assert client.counters["granted_stores"] == 0 and server.store.pool.stats()["write_leases"] == 0


def test_inline_frames_are_cut_as_asked_and_an_old_peers_whole_frame_still_works(server):
    """The wire, read raw: a retrieve asking for frames gets ceil(size / frame) of them; one that does not
    ask (a client from before issue 47) gets the object whole; an inline store in one frame (an older
    client) or in several is stored alike; a frame size under the minimum is a bad request naming it."""
    blob = blob_of(5 * protocol.MIN_INLINE_FRAME_BYTES + 3, 7)
    with CacheClient(server.url, timeout_s=5, use_shm=False, frame_bytes=0) as old, \
            CacheClient(server.url, timeout_s=5, use_shm=False) as new:
        assert old.store(b"o" * 16, blob, META) == (True, "")        # one data frame
        assert new._session.hello.frame_bytes == protocol.INLINE_FRAME_BYTES
        new.frame_bytes = protocol.MIN_INLINE_FRAME_BYTES
        assert len(new._store_frames(blob)) == 6
        assert new.store(b"n" * 16, blob, META) == (True, "")        # six data frames
        for key in (b"o" * 16, b"n" * 16):
            reply, frames = new._call(Kind.RETRIEVE, protocol.Retrieve(key, "ns", False, protocol.MIN_INLINE_FRAME_BYTES),
                                      protocol.RetrieveReply, with_data=True)
            assert reply.frames == len(frames) == 6 and [len(f) for f in frames[:-1]] == [protocol.MIN_INLINE_FRAME_BYTES] * 5
            assert b"".join(frames) == blob
            reply, frames = new._call(Kind.RETRIEVE, protocol.Retrieve(key, "ns", False), protocol.RetrieveReply,
                                      with_data=True)
            assert reply.frames == len(frames) == 1 and bytes(frames[0]) == blob
            assert bytes(old.retrieve(key, "ns").blob) == blob
        with pytest.raises(CacheServerError) as bad:
            new._call(Kind.RETRIEVE_MANY, protocol.RetrieveMany([b"o" * 16], "ns", False, 1000), protocol.RetrieveManyReply)
        assert bad.value.code == Code.BAD_REQUEST and "frame_bytes" in str(bad.value)
    with pytest.raises(ValueError, match="frame_bytes"):
        CacheClient(server.url, timeout_s=5, frame_bytes=100)


def test_l1_is_written_through_to_l2_and_an_l2_hit_is_promoted(server):
    blob = blob_of(100_000, 5)
    with CacheClient(server.url, timeout_s=5) as client:
        client.store(b"w" * 16, blob, META)
        client.flush()   # after the store's commit (same client), and waits for the L2 writer
        client.clear("L1")
        assert client.lookup([b"w" * 16], "ns").tiers == ["L2"]
        found = client.retrieve(b"w" * 16, "ns")
        assert found.tier == "L2" and bytes(found.blob) == blob
        client.release([found])
        assert client.lookup([b"w" * 16], "ns").tiers == ["L1"]


def test_a_torn_copy_is_detected_by_the_generation_check(server):
    """The pages of a leased view are reused after its lease was revoked: intact() says so."""
    with CacheClient(server.url, timeout_s=5) as client:
        client.store(b"t" * 16, blob_of(70_000), META)
        found = client.retrieve(b"t" * 16, "ns")
        assert client.intact(found)
        client.flush()   # the disk writer's lease on the object is over
        server.store.pool.drop_client(client.instance_id)        # as the reaper would
        server.store.clear("L1")
        client.store(b"u" * 16, blob_of((4 << 20) - 200_000, 7), META)   # refills the freed pages
        assert not client.intact(found)
        assert client.counters["torn_copies"] == 1


# -- bad input ---------------------------------------------------------------------------------------


def test_bad_input_is_a_counted_error_reply_and_the_server_keeps_serving(server, settings):
    with CacheClient(server.url, timeout_s=5) as client:
        garbage = raw_request(server.url, [b"\x93not msgpack at all"])
        assert not garbage.success and garbage.code == Code.BAD_REQUEST
        unknown = raw_request(server.url, [protocol.encode_request(3, client.instance_id, "teleport")])
        assert unknown.request_id == 3 and unknown.code == Code.UNKNOWN_KIND and "teleport" in unknown.error
        wrong_body = raw_request(server.url, [protocol.encode_request(4, client.instance_id, Kind.LOOKUP, {"x": 1})])
        assert wrong_body.code == Code.BAD_REQUEST and "lookup" in wrong_body.error
        big = b"\0" * (settings.cache_server_max_message_bytes + 1)
        oversized = raw_request(server.url, [protocol.encode_request(5, client.instance_id, Kind.STORE_INLINE,
                                                                     protocol.StoreInline(b"o" * 16, protocol.WireMeta.of(META))), big],
                                timeout_ms=60_000)   # 256 MiB through CURVE, on a busy machine
        assert oversized.code == Code.TOO_LARGE and "KVB_CACHE_SERVER_MAX_MESSAGE_BYTES" in oversized.error
        assert client.ping().server_id == server.server_id
    errors = server.metrics.value
    assert errors("kvbridge_request_errors_total", {"code": Code.BAD_REQUEST}) >= 2
    assert errors("kvbridge_request_errors_total", {"code": Code.UNKNOWN_KIND}) == 1
    assert errors("kvbridge_request_errors_total", {"code": Code.TOO_LARGE}) == 1


def test_a_lease_another_client_owns_is_refused_and_left_alone(server):
    with CacheClient(server.url, timeout_s=5) as owner, CacheClient(server.url, timeout_s=5) as thief:
        owner.store(b"l" * 16, blob_of(10_000), META)
        owner.flush()   # the disk writer's own lease on it is over
        found = owner.retrieve(b"l" * 16, "ns")
        with pytest.raises(CacheServerError) as refused:
            thief._call(Kind.RELEASE, protocol.Release([found.lease_id]), None)
        assert refused.value.code == Code.NOT_OWNER
        assert server.store.pool.stats()["read_leases"] == 1
        assert owner.intact(found) and bytes(found.blob) == blob_of(10_000)
        owner.release([found])
        deadline = time.monotonic() + 5
        while server.store.pool.stats()["read_leases"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.store.pool.stats()["read_leases"] == 0
        assert server.metrics.value("kvbridge_request_errors_total", {"code": Code.NOT_OWNER}) == 1


# -- the plugin contract on a real server -------------------------------------------------------------

ECHO = {"module_path": "tests.cs_live_plugins.echo", "config": {"prefix": ">> "}}


def test_envelope_calls_reach_a_plugin_and_failures_are_answers(settings):
    with running_server(settings, [ECHO]) as srv, CacheClient(srv.url, timeout_s=5) as client:
        said = client.server_module_call(ServerModuleCallRequest("live_echo.say", b"hi")).result(timeout=5)
        assert (said.success, said.payload) == (True, b">> hi")
        failed = client.server_module_call(ServerModuleCallRequest("live_echo.fail")).result(timeout=5)
        assert not failed.success and "the plugin could not do it" in failed.error
        unknown = client.server_module_call(ServerModuleCallRequest("nobody.home")).result(timeout=5)
        assert not unknown.success and "unknown server module method: nobody.home" in unknown.error
        wrong = client.server_module_call(ServerModuleCallRequest("live_echo.slow", b"0")).result(timeout=5)
        assert not wrong.success and "server_module_affinity_call" in wrong.error
        wrong = client.server_module_affinity_call(ServerModuleCallRequest("live_echo.say")).result(timeout=5)
        assert not wrong.success and "server_module_call" in wrong.error
        assert client.status()["live_echo"] == {"prefix": ">> "}
        assert client.ping().server_id == srv.server_id


def test_affinity_calls_run_in_order_with_the_clients_stores(settings):
    with running_server(settings, [ECHO]) as srv, CacheClient(srv.url, timeout_s=10) as client:
        slow: Future = client.server_module_affinity_call(ServerModuleCallRequest("live_echo.slow", b"0.4"))
        stored_at: list[float] = []
        storing = threading.Thread(target=lambda: (client.store(b"a" * 16, blob_of(5000), META),
                                                   stored_at.append(time.monotonic())))
        time.sleep(0.05)
        storing.start()
        plain = client.server_module_call(ServerModuleCallRequest("live_echo.say", b"quick")).result(timeout=5)
        plain_done = time.monotonic()
        started, ended = json.loads(slow.result(timeout=5).payload)
        storing.join(timeout=5)
        assert plain.success and plain_done < ended, "a plain call waited for the affinity thread"
        assert stored_at and stored_at[0] >= ended, "the client's store overtook its earlier affinity call"
        holds = client.server_module_affinity_call(ServerModuleCallRequest("live_echo.holds", (b"a" * 16).hex().encode()))
        assert holds.result(timeout=5).payload == b"yes"


def test_a_plugin_replaces_the_builtin_lookup_module(settings):
    replacement = {"module_path": "tests.cs_live_plugins.replace_lookup"}
    with running_server(settings, [replacement]) as srv, CacheClient(srv.url, timeout_s=5) as client:
        client.store(b"r" * 16, blob_of(1000), META)
        assert client.lookup([b"r" * 16], "ns").n_hit == 1
        status = client.status()
    assert status["lookup"]["replacement"] is True and status["lookup"]["answered"] == 1
    row = next(r for r in status["server"]["modules"] if r["name"] == "lookup")
    assert row["class"].endswith("CountingLookupModule") and row["external"]


def test_a_dependent_module_overrides_its_dependencys_core_handler(settings):
    with running_server(settings, [{"module_path": "tests.cs_live_plugins.ping_override"}]) as srv:
        with CacheClient(srv.url, timeout_s=5) as client:
            assert client.ping().server_id == "overridden:" + srv.server_id
            assert client.status()["ping_override"]["pings"] >= 1


def test_a_sigkilled_client_is_reaped_and_its_leases_released(settings):
    quick = settings.replace(cache_server_reap_timeout=1.0, cache_server_registration_grace=1.0)
    probe = {"module_path": "tests.cs_live_plugins.liveness"}
    with running_server(quick, [probe]) as srv, CacheClient(srv.url, timeout_s=5) as watcher:
        watcher.store(b"h" * 16, blob_of(50_000), META)
        holder = subprocess.Popen([sys.executable, "-c", HOLD_A_LEASE, srv.url], cwd=PROJECT, stdout=subprocess.PIPE,
                                  env={**os.environ, "PYTHONPATH": str(PROJECT)})
        try:
            instance = holder.stdout.readline().decode().strip()
            assert instance, "the holder process did not get its lease"
            assert srv.store.pool.stats()["read_leases"] == 1
            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=10)
        finally:
            holder.kill()
            holder.stdout.close()
        deadline = time.monotonic() + 10
        while srv.store.pool.stats()["read_leases"] and time.monotonic() < deadline:
            time.sleep(0.1)
            watcher.ping()   # the watcher stays alive
        assert srv.store.pool.stats()["read_leases"] == 0, "the killed client's lease was never released"
        clients = [c["instance_id"] for c in watcher.status()["management"]["clients"]]
        assert instance not in clients and watcher.instance_id in clients
        dropped = watcher.server_module_call(ServerModuleCallRequest("liveness_probe.dropped")).result(timeout=5)
        assert instance in json.loads(dropped.payload)


HOLD_A_LEASE = """
import sys, time
from kvbridge.cache_server.client import CacheClient
client = CacheClient(sys.argv[1], timeout_s=5)
found = client.retrieve(b"h" * 16, "ns")
assert found is not None and found.lease_id
print(client.instance_id, flush=True)
time.sleep(600)
"""


# -- metrics -----------------------------------------------------------------------------------------


def test_prometheus_metrics_are_served_on_the_metrics_port(settings):
    port = free_port()
    with running_server(settings.replace(cache_server_metrics_port=port)) as srv, \
            CacheClient(srv.url, timeout_s=5) as client:
        client.store(b"m" * 16, blob_of(1000), META)
        client.lookup([b"m" * 16, b"n" * 16], "ns", chunk_tokens=32)
        client.release([client.retrieve(b"m" * 16, "ns")])
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in ('kvbridge_lookup_requested_tokens_total 64.0', 'kvbridge_lookup_hit_tokens_total 32.0',
                 'kvbridge_hits_total{tier="L1"} 1.0', 'kvbridge_stores_total 1.0', 'kvbridge_connected_clients 1.0',
                 'kvbridge_l1_pressure_level 0.0', 'kvbridge_lookup_seconds_count 1.0'):
        assert line in text, f"{line!r} not in the metrics"
    for name in ("kvbridge_l1_usage_ratio", "kvbridge_evictions_total", "kvbridge_refused_stores",
                 "kvbridge_revoked_leases_total", "kvbridge_leases", "kvbridge_pinned_objects",
                 "kvbridge_retrieve_seconds_bucket", "kvbridge_store_seconds_bucket"):
        assert name in text


def test_no_metrics_endpoint_without_a_port(server):
    with CacheClient(server.url, timeout_s=5) as client:
        assert client.status()["metrics"]["endpoint"] == ""


# -- the command, and the L2 directory's owner ---------------------------------------------------------


def test_the_command_stops_cleanly_on_sigterm_and_l1_survives_on_disk(settings, tmp_path):
    env = server_env(settings)
    url = local_url()
    first = ServerProcess(env, url, log_path=tmp_path / "server.log")
    try:
        with CacheClient(url, timeout_s=5) as client:
            segment = client._segment.path
            client.store(b"s" * 16, blob_of(30_000), META)
        assert first.terminate() == 0
        assert not segment.exists(), "the shared-memory segment was left behind"
    finally:
        first.close()
    log = (tmp_path / "server.log").read_text()
    assert "storage(dependencies=[])" in log and "stopped cleanly" in log
    second = ServerProcess(env, url)
    try:
        with CacheClient(url, timeout_s=5) as client:
            assert client.lookup([b"s" * 16], "ns").tiers == ["L2"]
        assert second.terminate() == 0
    finally:
        second.close()


def test_a_malformed_server_module_flag_is_a_startup_error_naming_it(settings):
    done = subprocess.run([sys.executable, "-m", "kvbridge", "cache-server", "--url", local_url(),
                           "--server-module", "{not json"], env=server_env(settings), cwd=PROJECT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--server-module" in done.stderr


def test_a_cache_server_and_an_embedded_store_never_share_an_l2_directory(settings, server):
    with pytest.raises(DirectoryOwned, match="KVB_STORE_URL"):
        TieredStore.from_settings(settings)
    other = settings.replace(l2_dir=str(settings.l2_dir) + "-embedded")
    embedded = TieredStore.from_settings(other)
    try:
        with pytest.raises(DirectoryOwned, match="embedded store"):
            CacheServer(other, url=local_url())
    finally:
        embedded.close()


def test_the_plugin_example_in_the_docs_runs(settings, tmp_path, monkeypatch):
    """Docs/CacheServer.md's module example, loaded by module_path into a real server and called as shown."""
    doc = (PROJECT / "Docs" / "CacheServer.md").read_text()
    module_code, call_code = [block.split("```")[0] for block in doc.split("```python\n")[1:3]]
    (tmp_path / "doc_example_plugin.py").write_text(module_code)
    monkeypatch.syspath_prepend(str(tmp_path))
    with running_server(settings, [{"module_path": "doc_example_plugin", "config": {"prefix": "> "}}]) as srv:
        scope: dict = {}
        exec(call_code.replace("tcp://127.0.0.1:5555", srv.url), scope)
        assert scope["response"].payload == b"> hi"
        assert scope["client"].status()["my_package"] == {"prefix": "> "}
        scope["client"].close()


def test_modules_from_the_setting_come_first_then_the_flags(settings):
    from kvbridge.cache_server.cli import module_specs
    from kvbridge.cache_server.module import ModuleStartupError

    configured = settings.replace(cache_server_modules='[{"module_path": "a.first", "config": {"n": 1}}]')
    specs = module_specs(configured, ['{"module_path": "b.second"}', '[{"module_path": "c.third"}]'])
    assert [(s.module_path, s.config) for s in specs] == [("a.first", {"n": 1}), ("b.second", {}), ("c.third", {})]
    with pytest.raises(ModuleStartupError, match="KVB_CACHE_SERVER_MODULES"):
        module_specs(settings.replace(cache_server_modules='{"module_path": "x.y", "config": [1]}'), [])


def test_an_address_in_use_is_a_clear_startup_error(settings, server):
    second = CacheServer(settings.replace(l2_dir=str(settings.l2_dir) + "-second"), url=server.url)
    try:
        with pytest.raises(BadSettings, match="cannot listen on .*--url"):
            second.bind()
    finally:
        second.close()


def test_a_client_that_closes_says_goodbye_and_its_leases_go(server):
    with CacheClient(server.url, timeout_s=5) as watcher:
        leaving = CacheClient(server.url, timeout_s=5)
        leaving.store(b"g" * 16, blob_of(10_000), META)
        held = leaving.retrieve(b"g" * 16, "ns")
        assert held.lease_id
        leaving.close()   # without releasing: the goodbye does
        clients = [c["instance_id"] for c in watcher.status()["management"]["clients"]]
        assert clients == [watcher.instance_id]
        server.store.drain()   # the disk writer's own short lease on the new object (it runs at nice 19) ends too
        assert server.store.pool.stats()["read_leases"] == 0


def test_one_small_request_cannot_make_the_server_build_a_huge_reply(make_settings):
    """The amplification from the issue: the same multi-MB key thousands of times, from a client without
    shared memory. Repeated keys are refused, and a reply's bytes are capped by
    KVB_CACHE_SERVER_MAX_MESSAGE_BYTES before anything is read: the server's memory stays put."""
    import resource

    settings = make_settings(cache_server_max_message_bytes=16 << 20, l1_bytes=64 << 20)
    big = blob_of(4 << 20)
    with running_server(settings) as srv, CacheClient(srv.url, timeout_s=10, use_shm=False) as client:
        keys = [bytes([i]) * 16 for i in range(8)]
        for key in keys:
            assert client.store(key, big, META)[0]
        client.flush()   # the disk writer's own leases are over
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        reply, _ = client._session._wait(client._send(Kind.RETRIEVE_MANY, protocol.RetrieveMany([keys[0]] * 4096, "ns", False)),
                                Kind.RETRIEVE_MANY)
        assert not reply.success and reply.code == Code.BAD_REQUEST and "more than once" in reply.error
        with pytest.raises(CacheServerError) as too_big:      # 8 x 4 MiB = 32 MiB > 16 MiB
            client._call(Kind.RETRIEVE_MANY, protocol.RetrieveMany(keys, "ns", False), protocol.RetrieveManyReply)
        assert too_big.value.code == Code.TOO_LARGE and "KVB_CACHE_SERVER_MAX_MESSAGE_BYTES" in str(too_big.value)
        assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 < 64 << 20
        assert srv.store.pool.stats()["read_leases"] == 0
        # the client API still takes repeats (asks once) and a request under the cap is answered
        first, again = client.retrieve_many([keys[1], keys[1]], "ns")
        assert bytes(first.blob) == big and again is None
        assert [bytes(r.blob) == big for r in client.retrieve_many(keys[:3], "ns")] == [True] * 3


def test_a_starting_server_removes_segments_dead_servers_left(make_settings, tmp_path):
    from kvbridge.cache_server.shm import Segment

    left = Segment.create(4, 4096, directory=tmp_path)
    path = left.path
    left.close()                                    # the file stays, as after a SIGKILL
    os.rename(path, path.with_name(path.name.replace(f"-{os.getpid()}-", "-999999999-")))
    stale = path.with_name(path.name.replace(f"-{os.getpid()}-", "-999999999-"))
    assert stale.exists()
    server = CacheServer(make_settings(l1_bytes=1 << 20), url=local_url(), segment_dir=str(tmp_path), token="t")
    try:
        assert not stale.exists() and server.store.segment.path.exists()
    finally:
        server.close()
    assert not server.store.segment.path.exists()
