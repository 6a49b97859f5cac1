"""CURVE between the cache server and its clients, over real sockets: the client authenticates the
server before any KV moves, the server admits only clients holding its token, nothing of an
unauthenticated peer is held, and with keys on both sides the server may listen beyond loopback.

The squatter here runs as this user, in this process (its own ZMQ context); the same squatter as a
second OS account is tests/test_cache_server_owner.py.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from cache_server_helpers import (SMALL_POOL, ServerProcess, local_url, owner_store_after_its_server, running_server,
                                  server_env)
from kvbridge.bench.probes.protocol_fuzz import unfinished_multipart
from kvbridge.bench.probes.squatter import Squatter
from kvbridge.cache_server.auth import client_token, token_file
from kvbridge.cache_server.client import CacheClient, CacheServerRefused, CacheServerUnavailable
from kvbridge.cache_server.curve import ServerNotAuthenticated, apply_client, client_keys, key_file, server_keys
from kvbridge.cache_server.protocol import Code, Kind
from kvbridge.cache_server import protocol
from kvbridge.cache_server.remote_store import RemoteStore
from kvbridge.errors import BadSettings
from kvbridge.store.objects import ObjectMeta

pytestmark = [pytest.mark.live, pytest.mark.timeout(120)]
META = ObjectMeta("ns", 4, bytes(16))
OBJECT = bytes(range(256)) * 4096   # 1 MiB the owner stores


@pytest.fixture
def settings(make_settings):
    return make_settings(**SMALL_POOL, cache_server_max_message_bytes=8 << 20)


def vm_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# -- the client authenticates the server ------------------------------------------------------------


def test_a_client_configured_with_the_wrong_public_key_refuses_at_once(settings):
    wrong = zmq.curve_keypair()[0].decode()
    with running_server(settings) as srv:
        started = time.monotonic()
        with pytest.raises(ServerNotAuthenticated) as refused:
            CacheClient(srv.url, timeout_s=5, server_key=wrong)
        assert time.monotonic() - started < 2.0
        assert "KVB_CACHE_SERVER_PUBLIC_KEY" in str(refused.value) and "nothing sent" in str(refused.value)
        assert isinstance(refused.value, CacheServerRefused)
        with pytest.raises(ServerNotAuthenticated, match="40"):
            CacheClient(srv.url, timeout_s=5, server_key="not-a-key")
        with CacheClient(srv.url, timeout_s=5, server_key=srv.keys.public) as client:   # the right one
            assert client.ping().server_id == srv.server_id


def test_with_no_key_file_and_no_key_configured_the_client_refuses_naming_both(settings, tmp_path):
    url = local_url()
    with pytest.raises(ServerNotAuthenticated) as refused:
        CacheClient(url, timeout_s=5)
    assert str(key_file(url)) in str(refused.value) and "KVB_CACHE_SERVER_PUBLIC_KEY" in str(refused.value)
    # an engine's store waits for the key instead (the server may start later): a counted miss, at once
    store = RemoteStore.from_settings(settings.replace(store_url=url), namespace="ns")
    try:
        started = time.monotonic()
        assert store.get(b"k" * 16) is None and store.lookup([b"k" * 16]).n_hit == 0
        assert not store.put(b"k" * 16, b"x", META)
        assert time.monotonic() - started < 1.0 and store.stats()["refused"] >= 3
    finally:
        store.close()


@pytest.mark.parametrize("curve", [False, True], ids=["null-squatter", "curve-squatter"])
@pytest.mark.parametrize("owner_server", ["stopped", "crashed"])
def test_a_squatter_on_the_owners_port_gets_no_byte_and_plants_nothing(settings, curve, owner_server):
    """The owner's server goes away (its key file removed by a clean stop, or left behind by a crash);
    a server that says yes to any hello takes the port. Neither an old client nor a new one sends it anything."""
    url, old = owner_store_after_its_server(settings, owner_server, OBJECT, META)
    squatter = Squatter(url, curve=curve)
    try:
        deadline = time.monotonic() + 10
        while not old.stats()["refused"]:
            assert old.get(b"o" * 16) is None and not old.put(b"p" * 16, OBJECT, META)   # misses, never a hang
            assert time.monotonic() < deadline, "the old client never refused the squatter"
        with pytest.raises(CacheServerRefused) as refused:
            CacheClient(url, timeout_s=2)
        assert str(key_file(url)) in str(refused.value)
        # nothing reached it, and nothing of its came back: every get above was a miss, never PLANTED
        assert squatter.messages == 0 and not squatter.saw(OBJECT)
    finally:
        old.close()
        squatter.close()


def test_a_restarted_server_is_followed_to_its_new_key_and_the_old_key_is_refused(settings, tmp_path):
    url = local_url()
    first = ServerProcess(server_env(settings), url, log_path=tmp_path / "first.log")
    try:
        client = CacheClient(url, timeout_s=2)
        old_key = client_keys(url, client_token(url)).server_public
        assert client.store(b"k" * 16, b"kept", META)[0]
    finally:
        first.kill()   # SIGKILL: its key file stays behind until the next server replaces it
    second = ServerProcess(server_env(settings), url, log_path=tmp_path / "second.log")
    try:
        new_key = client_keys(url, client_token(url)).server_public
        assert new_key != old_key
        deadline = time.monotonic() + 10
        while True:   # a miss or two while it reconnects, then the same client on the new key
            try:
                server_id = client.ping().server_id
                break
            except (CacheServerRefused, CacheServerUnavailable) as exc:   # a miss
                assert time.monotonic() < deadline, f"the client never followed the new key: {exc}"
                time.sleep(0.2)
        assert server_id == client.server_id and client._session.conn.keys.server_public == new_key
        assert client.store(b"n" * 16, b"new", META)[0]
        assert bytes(client.retrieve(b"n" * 16, "ns", zero_copy=False).blob) == b"new"
        assert client.counters["reconnects"] >= 1
        with pytest.raises(ServerNotAuthenticated):
            CacheClient(url, timeout_s=2, server_key=old_key)
        client.close()
    finally:
        second.close()


# -- the server admits only its clients, and holds nothing of anyone else ---------------------------------


def _hostile_peer(ctx: zmq.Context, url: str, curve: bool) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER of an account without the token: plain, or CURVE with the server's public key (not a secret)
    and a key pair of its own."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    if curve:
        server_public = client_keys(url, "").server_public
        public, secret = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_public.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    monitor = sock.get_monitor_socket()
    sock.connect(url)
    return sock, monitor


def test_an_unauthenticated_peers_unfinished_multipart_message_is_never_held(settings, tmp_path):
    """Raw ZMTP frames flagged "more" without end, never the last one (libzmq would hold them all until the
    last frame; a peer that does not use libzmq can send them): the server hangs up at the greeting."""
    url = local_url()
    server = ServerProcess(server_env(settings), url, log_path=tmp_path / "server.log")
    try:
        before = vm_rss_mb(server.proc.pid)
        taken = unfinished_multipart(url, frames=96)   # 96 MiB, each frame under the per-frame limit
        grown = vm_rss_mb(server.proc.pid) - before
        assert taken < 16 << 20 and grown < 24, f"the server took {taken >> 20} MiB and grew {grown:.0f} MiB"
        with CacheClient(url, timeout_s=5) as client:   # and it serves its own clients all along
            assert client.store(b"k" * 16, b"v", META)[0]
    finally:
        server.close()


def test_a_peer_with_the_public_key_but_not_the_token_fails_the_handshake(settings):
    """The public key is not a secret: a CURVE peer holding it, with a key pair of its own, is turned away by
    the ZAP handler before any message; its frames never reach the server."""
    with running_server(settings) as srv:
        ctx = zmq.Context()
        try:
            sock, monitor = _hostile_peer(ctx, srv.url, curve=True)
            for _ in range(8):
                try:
                    sock.send(b"\0" * (1 << 20), zmq.SNDMORE | zmq.NOBLOCK)
                except zmq.Again:   # turned away: no pipe left to queue in
                    break
            events = [recv_monitor_message(monitor)["event"] for _ in range(6) if monitor.poll(1000)]
            assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in events and zmq.EVENT_HANDSHAKE_SUCCEEDED not in events, events
            assert srv._zap.denied >= 1 and len(srv.clients) == 0
            sock.close(0)
            monitor.close(0)
        finally:
            ctx.destroy(linger=0)


def test_a_message_past_the_frame_or_byte_bound_is_dropped_as_it_is_read(settings):
    """The owner's own connection (past the handshake): ZMQ_MAXMSGSIZE bounds each frame only, so the server
    bounds the whole message itself as it reads it."""
    with running_server(settings) as srv, CacheClient(srv.url, timeout_s=5) as client:
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            apply_client(sock, client_keys(srv.url, client_token(srv.url)))
            sock.connect(srv.url)
            envelope = protocol.encode_request(9, client.instance_id, Kind.PING)
            sock.send_multipart([envelope, *[b""] * 5000])              # many frames, few bytes
            sock.send_multipart([protocol.encode_request(10, client.instance_id, Kind.PING),
                                 *[b"\0" * (3 << 20)] * 3])               # each frame under the limit, not the sum
            replies = {}
            for _ in range(2):
                assert sock.poll(5000), "no answer"
                reply = protocol.decode_reply(sock.recv_multipart()[0])
                replies[reply.request_id] = reply
            assert replies[9].code == Code.TOO_LARGE and "frames" in replies[9].error
            assert replies[10].code == Code.TOO_LARGE and "KVB_CACHE_SERVER_MAX_MESSAGE_BYTES" in replies[10].error
            sock.close(0)
        finally:
            ctx.destroy(linger=0)
        assert client.ping().server_id == srv.server_id


# -- beyond loopback, ipc, configured keys ----------------------------------------------------------------


def test_beyond_loopback_the_server_listens_encrypted_and_clients_reach_it_by_another_address(settings, monkeypatch,
                                                                                               tmp_path):
    """Bound on every interface (refused before CURVE), reached at 127.0.0.2: once as the owner (key file
    found by port) and once as a client on 'another host' that has no files, only the public key and the
    shared secret. A plain socket there never completes a handshake."""
    port = int(local_url().rpartition(":")[2])
    with running_server(settings, token="shared-secret", url=f"tcp://0.0.0.0:{port}") as srv:
        assert srv._router.getsockopt(zmq.MECHANISM) == zmq.CURVE
        remote_url = f"tcp://127.0.0.2:{port}"
        with CacheClient(remote_url, timeout_s=5, token="shared-secret") as owner:
            assert owner.store(b"x" * 16, OBJECT, META)[0]
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "another-host"))   # no key file, no token file there
        with pytest.raises(ServerNotAuthenticated):
            CacheClient(remote_url, timeout_s=5, token="shared-secret")
        with CacheClient(remote_url, timeout_s=5, token="shared-secret", server_key=srv.keys.public,
                         use_shm=False) as remote:
            found = remote.retrieve(b"x" * 16, "ns")
            assert found is not None and bytes(found.blob) == OBJECT
        with pytest.raises(CacheServerRefused, match="wrong or missing token"):
            CacheClient(remote_url, timeout_s=5, token="guessed", server_key=srv.keys.public)
        ctx = zmq.Context()
        try:
            plain, monitor = _hostile_peer(ctx, f"tcp://127.0.0.3:{port}", curve=False)
            plain.send(protocol.encode_request(1, "plain", Kind.PING))
            assert not plain.poll(1000), "a plain socket got an answer"
            events = [recv_monitor_message(monitor)["event"] for _ in range(4) if monitor.poll(200)]
            assert {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL} & set(events), events
            assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events
            plain.close(0)
            monitor.close(0)
        finally:
            ctx.destroy(linger=0)


def test_a_plaintext_plugin_socket_still_stays_on_loopback():
    from kvbridge.cache_server.auth import check_bind_url

    with pytest.raises(BadSettings, match="not encrypted"):
        check_bind_url("tcp://0.0.0.0:5557")
    check_bind_url("tcp://0.0.0.0:5557", encrypted=True)


def test_ipc_runs_curve_too_with_its_key_beside_its_token(settings, tmp_path):
    url = f"ipc://{tmp_path}/cache.sock"
    with running_server(settings, url=url) as srv:
        assert key_file(url).parent == token_file(url).parent and key_file(url).name.startswith("cache-server-ipc-")
        assert oct(key_file(url).stat().st_mode & 0o777) == "0o600"
        assert f"public {srv.keys.public}" in key_file(url).read_text()
        with CacheClient(url, timeout_s=5) as client:
            assert client.store(b"i" * 16, OBJECT, META)[0]
            assert bytes(client.retrieve(b"i" * 16, "ns", zero_copy=False).blob) == OBJECT
        with pytest.raises(ServerNotAuthenticated):
            CacheClient(url, timeout_s=5, server_key=zmq.curve_keypair()[0].decode())
    assert not key_file(url).exists()


# -- what a client trusts on disk, and the configured key pair ------------------------------------------


@pytest.mark.parametrize("flaw", ["readable by others", "symbolic link", "another owner", "damaged"])
def test_a_key_file_this_user_must_not_trust_is_refused_naming_it(settings, tmp_path, flaw):
    if flaw == "another owner" and os.geteuid() != 0:
        pytest.skip("giving a file to another uid needs root")
    with running_server(settings) as srv:
        path = key_file(srv.url)
        if flaw == "readable by others":
            os.chmod(path, 0o644)
        elif flaw == "symbolic link":
            planted = tmp_path / "planted.key"
            planted.write_text(path.read_text())
            os.chmod(planted, 0o600)
            path.unlink()
            path.symlink_to(planted)
        elif flaw == "another owner":
            os.chown(path, 65534, 65534)
        else:
            path.write_text(path.read_text().replace("public ", "public x"))
        with pytest.raises(ServerNotAuthenticated) as refused:
            CacheClient(srv.url, timeout_s=5)
        assert str(path) in str(refused.value)


def test_a_configured_secret_key_keeps_the_public_key_across_restarts(settings):
    public, secret = (k.decode() for k in zmq.curve_keypair())
    named = settings.replace(cache_server_secret_key_env="KVB_TEST_CS_SECRET_KEY")
    assert server_keys(named, {"KVB_TEST_CS_SECRET_KEY": secret}).public == public
    with pytest.raises(BadSettings, match="KVB_CACHE_SERVER_SECRET_KEY_ENV names KVB_TEST_CS_SECRET_KEY"):
        server_keys(named, {})
    with pytest.raises(BadSettings, match="KVB_CACHE_SERVER_SECRET_KEY_ENV") as bad:
        server_keys(named, {"KVB_TEST_CS_SECRET_KEY": "oops-a-short-secret"})
    assert "oops-a-short-secret" not in str(bad.value)
    problems = settings.replace(cache_server_public_key="abc", cache_server_secret_key_env="not a name!").validate()
    assert any("KVB_CACHE_SERVER_PUBLIC_KEY" in p for p in problems)
    assert any("KVB_CACHE_SERVER_SECRET_KEY_ENV" in p for p in problems)
    assert not [p for p in settings.replace(cache_server_public_key=public).validate() if "PUBLIC_KEY" in p]


def test_across_hosts_a_fixed_key_pair_and_a_shared_secret_from_the_settings(settings, tmp_path, monkeypatch):
    """Docs/Security.md's recipe, with the real command and the engine's own store: the server binds every
    interface with its secret key and the shared secret named by settings; a client 'on another host' (no
    files of the server's) reaches it at 127.0.0.2 with only the public key and the secret, also after the
    server restarts (same key pair)."""
    public, secret = (k.decode() for k in zmq.curve_keypair())
    port = int(local_url().rpartition(":")[2])
    server_settings = settings.replace(cache_server_token_env="KVB_TEST_CS_TOKEN",
                                       cache_server_secret_key_env="KVB_TEST_CS_SECRET_KEY")
    env = server_env(server_settings, KVB_TEST_CS_TOKEN="across-hosts-secret", KVB_TEST_CS_SECRET_KEY=secret)
    url = f"tcp://0.0.0.0:{port}"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "engine-host"))   # the client sees no key or token file
    engine_settings = server_settings.replace(store_url=f"tcp://127.0.0.2:{port}", cache_server_public_key=public,
                                              cache_server_secret_key_env="")
    for round_ in ("first", "restarted"):
        server = ServerProcess(env, url, log_path=tmp_path / f"{round_}.log")
        try:
            assert f"CURVE public key {public}" in server.log_path.read_text()   # the same key, both times
            store = RemoteStore.from_settings(engine_settings, namespace="ns",
                                              environ={"KVB_TEST_CS_TOKEN": "across-hosts-secret"})
            try:
                assert store.put(f"{round_}-key-16bytes"[:16].encode(), OBJECT, META)
                found = store.get(f"{round_}-key-16bytes"[:16].encode())
                assert found is not None and bytes(found.blob) == OBJECT
                if found.release is not None:   # same host here: a shared-memory loan
                    found.release()
                assert store.stats()["refused"] == 0
            finally:
                store.close()
            assert server.terminate() == 0
        finally:
            server.close()
