"""What the cache server leaves on disk, over real servers and real signals: the key file holds no secret,
token and key files are named by a canonical host and the port (two servers on one port of two addresses
keep apart, 127.0.0.1 and localhost still meet), a token file with loose permissions is named with its
mode, and what a SIGKILLed server leaves (files and its /dev/shm segment) is found from its address and
removed, by `forget_server_files` or by the next server on that address.
"""
from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from cache_server_helpers import SMALL_POOL, ServerProcess, free_port, local_url, running_server, server_env
from kvbridge.cache_server.auth import token_file
from kvbridge.cache_server.client import CacheClient, CacheServerRefused
from kvbridge.cache_server.curve import key_file
from kvbridge.store.objects import ObjectMeta

pytestmark = [pytest.mark.live, pytest.mark.timeout(180)]
META = ObjectMeta("ns", 4, bytes(16))
SECRET_KEY_VARIABLE = "KVB_TEST_CS_SECRET_KEY"


@pytest.fixture
def settings(make_settings):
    return make_settings(**SMALL_POOL)


# -- the secret key never on disk --------------------------------------------------------------------


@pytest.mark.parametrize("pair", ["configured", "generated"])
def test_the_key_file_holds_the_public_key_and_never_the_secret(settings, monkeypatch, pair):
    import zmq

    if pair == "configured":
        public, secret = (k.decode() for k in zmq.curve_keypair())
        monkeypatch.setenv(SECRET_KEY_VARIABLE, secret)
        settings = settings.replace(cache_server_secret_key_env=SECRET_KEY_VARIABLE)
    with running_server(settings) as srv:
        text = key_file(srv.url).read_text()
        assert srv.keys.secret not in text, f"the secret key is written to {key_file(srv.url)}"
        assert f"public {srv.keys.public}" in text
        if pair == "configured":
            assert srv.keys.public == public
        with CacheClient(srv.url, timeout_s=5) as client:   # the public key is all a client needs
            assert client.ping().server_id == srv.server_id


# -- files named by a canonical host and the port ------------------------------------------------------


def port_free_on(*hosts: str) -> int:
    for _ in range(20):
        port = free_port()
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue
    raise AssertionError(f"no port free on all of {hosts}")


def test_two_servers_on_one_port_of_two_addresses_keep_their_own_files(settings, tmp_path):
    port = port_free_on("127.0.0.1", "127.0.0.2")
    first_url, second_url = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.2:{port}"
    assert token_file(first_url) != token_file(second_url) and key_file(first_url) != key_file(second_url)
    first = ServerProcess(server_env(settings.replace(l2_dir=str(tmp_path / "first-l2"))), first_url,
                          log_path=tmp_path / "first.log")
    try:
        second = ServerProcess(server_env(settings.replace(l2_dir=str(tmp_path / "second-l2"))), second_url,
                               log_path=tmp_path / "second.log")
        try:
            with CacheClient(first_url, timeout_s=5) as a, CacheClient(second_url, timeout_s=5) as b:
                assert a.ping().server_id != b.ping().server_id
                assert a.store(b"a" * 16, b"first's KV", META)[0] and b.store(b"b" * 16, b"second's KV", META)[0]
                with CacheClient(f"tcp://localhost:{port}", timeout_s=5) as by_name:   # localhost meets 127.0.0.1
                    assert by_name.ping().server_id == a.ping().server_id
                assert first.terminate() == 0
                assert token_file(second_url).exists() and key_file(second_url).exists()
                assert bytes(b.retrieve(b"b" * 16, "ns", zero_copy=False).blob) == b"second's KV"
            with CacheClient(second_url, timeout_s=5) as fresh:   # a new client of the second still finds it
                assert bytes(fresh.retrieve(b"b" * 16, "ns", zero_copy=False).blob) == b"second's KV"
        finally:
            second.close()
    finally:
        first.close()


def test_loopback_names_and_a_wildcard_bind_name_one_server_and_other_addresses_their_own():
    assert len({token_file(f"tcp://{host}:5555") for host in ("127.0.0.1", "localhost", "[::1]", "*", "0.0.0.0")}) == 1
    assert len({token_file(f"tcp://{host}:5555") for host in ("127.0.0.1", "127.0.0.2", "10.1.2.3")}) == 3
    assert token_file("tcp://127.0.0.1:5555") != token_file("tcp://127.0.0.1:5556")


# -- a token file with loose permissions ----------------------------------------------------------------


def test_a_token_file_readable_by_others_is_named_with_its_mode_and_the_fix(settings):
    with running_server(settings) as srv:
        path = token_file(srv.url)
        os.chmod(path, 0o644)
        with pytest.raises(CacheServerRefused) as refused:
            CacheClient(srv.url, timeout_s=5)
        message = str(refused.value)
        assert str(path) in message and "0644" in message and f"chmod 600 {path}" in message, message
        assert "wrong or missing token" not in message
        os.chmod(path, 0o600)
        with CacheClient(srv.url, timeout_s=5) as client:
            assert client.ping().server_id == srv.server_id


# -- what a SIGKILLed server leaves ---------------------------------------------------------------------


def killed_server(settings, tmp_path, url: str) -> Path:
    """A child cache server on `url`, SIGKILLed after a client stored something; its segment's path."""
    server = ServerProcess(server_env(settings), url, log_path=tmp_path / "killed.log")
    try:
        with CacheClient(url, timeout_s=5) as client:
            assert client.store(b"k" * 16, b"KV", META)[0]
            segment = Path(client._session.hello.shm_path)
        server.proc.send_signal(signal.SIGKILL)
        assert server.proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        server.close()
    assert segment.exists() and token_file(url).exists() and key_file(url).exists()   # what the kill left
    return segment


def test_forget_server_files_removes_what_a_killed_server_left(settings, tmp_path):
    from kvbridge.cache_server.leftovers import forget_server_files

    url = local_url()
    segment = killed_server(settings, tmp_path, url)
    removed = forget_server_files(url)
    assert not segment.exists(), f"{segment} is left in shared memory"
    assert not token_file(url).exists() and not key_file(url).exists()
    assert set(removed) == {segment, token_file(url), key_file(url)}
    assert forget_server_files(url) == []   # nothing left: a second call is a no-op


def test_forget_server_files_leaves_a_running_server_alone(settings, tmp_path):
    from kvbridge.cache_server.leftovers import forget_server_files

    url = local_url()
    server = ServerProcess(server_env(settings), url, log_path=tmp_path / "running.log")
    try:
        with CacheClient(url, timeout_s=5) as client:
            segment = Path(client._session.hello.shm_path)
            assert forget_server_files(url) == []
            assert segment.exists() and token_file(url).exists() and key_file(url).exists()
            assert client.ping()
    finally:
        server.close()


def test_the_next_server_on_the_address_cleans_what_a_killed_one_left(settings, tmp_path):
    url = local_url()
    segment = killed_server(settings, tmp_path, url)
    old_key = key_file(url).read_text()
    with running_server(settings, url=url) as srv:
        assert not segment.exists()
        assert key_file(url).read_text() != old_key
        with CacheClient(url, timeout_s=5) as client:
            assert client.ping().server_id == srv.server_id
