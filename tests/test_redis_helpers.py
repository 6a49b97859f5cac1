"""The Redis test helpers themselves, with real redis-server processes: a standalone server (password,
maxmemory, kill and restart, pause) and a 3-master cluster that fails over when a master dies."""
from __future__ import annotations

import socket
import time

import pytest
import redis

from tests.redis_helpers import CLUSTER_BUS_OFFSET, RedisCluster, RedisServer, cluster_ports, needs_redis

pytestmark = [needs_redis, pytest.mark.live]


@pytest.mark.timeout(20)
def test_server_starts_and_serves():
    with RedisServer() as server:
        assert server.running
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        with server.client() as c:
            assert c.set(b"k", b"v")
            assert c.get(b"k") == b"v"
        with redis.Redis.from_url(server.url) as c:
            assert c.get(b"k") == b"v"
        directory = server.dir
    assert not server.running
    assert not directory.exists()


@pytest.mark.timeout(20)
def test_password_server_refuses_unauthenticated_clients():
    with RedisServer(password="s3cret") as server:
        with server.client(password=None) as anonymous:
            with pytest.raises((redis.AuthenticationError, redis.ResponseError)) as caught:
                anonymous.set(b"k", b"v")
        if not isinstance(caught.value, redis.AuthenticationError):
            assert "NOAUTH" in str(caught.value)
        with server.client() as c:   # the server's own client carries the password
            assert c.set(b"k", b"v") and c.get(b"k") == b"v"


@pytest.mark.timeout(20)
def test_maxmemory_noeviction_refuses_writes_with_oom():
    with RedisServer(maxmemory=4 << 20, maxmemory_policy="noeviction") as server:
        with server.client() as c:
            assert c.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
            value = b"x" * (256 << 10)
            with pytest.raises(redis.exceptions.OutOfMemoryError, match="maxmemory"):   # the OOM reply
                for i in range(64):           # 16 MiB at most, against a 4 MiB limit
                    c.set(f"big:{i}".encode(), value)


@pytest.mark.timeout(30)
def test_kill_then_restart_serves_again_on_the_same_port_empty():
    with RedisServer() as server:
        port, pid = server.port, server.pid
        with server.client() as c:
            c.set(b"k", b"v")
        server.kill()
        assert not server.running
        with pytest.raises(redis.ConnectionError):
            with server.client(socket_connect_timeout=1) as c:
                c.ping()
        server.restart()
        assert server.port == port and server.pid != pid
        with server.client() as c:
            assert c.ping()
            assert c.get(b"k") is None        # nothing is persisted: a restarted server is empty


@pytest.mark.timeout(20)
def test_pause_delays_commands():
    with RedisServer() as server, server.client() as c:
        c.ping()
        server.pause(0.5)
        began = time.monotonic()
        assert c.ping()
        assert time.monotonic() - began >= 0.4


@pytest.mark.timeout(10)
def test_cluster_ports_leave_the_bus_port_free():
    ports = cluster_ports(6)
    assert len(set(ports)) == 6 and all(p < 55000 for p in ports)
    for p in ports:
        for port in (p, p + CLUSTER_BUS_OFFSET):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


@pytest.mark.timeout(60)
def test_cluster_has_three_masters_with_a_replica_each():
    with RedisCluster() as cluster:
        masters, replicas = cluster.masters(), cluster.replicas()
        assert len(masters) == 3 and len(replicas) == 3
        assert sorted(masters + replicas) == sorted(cluster.ports)
        assert cluster.url.startswith("redis-cluster://127.0.0.1:") and cluster.url.count(",") == 2
        client = cluster.client()
        try:
            for i in range(30):               # keys on every master's slots
                client.set(f"key:{i}".encode(), str(i).encode())
            assert [client.get(f"key:{i}".encode()) for i in range(30)] == [str(i).encode() for i in range(30)]
            assert {cluster.master_for_key(f"key:{i}".encode()) for i in range(30)} == set(masters)
        finally:
            client.close()


@pytest.mark.timeout(90)
def test_cluster_fails_over_when_a_master_is_killed():
    key = b"kvb:failover"
    with RedisCluster() as cluster:
        client = cluster.client()
        try:
            client.set(key, b"survives")
        finally:
            client.close()
        master = cluster.master_for_key(key)
        with cluster.node(master).client() as direct:   # replication is asynchronous: wait for the replica
            assert direct.execute_command("WAIT", 1, 2000) >= 1

        dead = cluster.kill_master_for_key(key)
        assert dead == master
        promoted = cluster.wait_failover(dead, timeout=20)

        assert promoted != dead and promoted in cluster.masters()
        assert dead not in cluster.masters() and len(cluster.masters()) == 3
        fresh = cluster.client()
        try:
            assert fresh.get(key) == b"survives"
            assert fresh.set(key, b"written after failover") and fresh.get(key) == b"written after failover"
        finally:
            fresh.close()
