"""Real Redis servers and clusters for the tests: Debian's `redis-server` as child processes on free
loopback ports, each with a private directory. No fakes.

    with RedisServer(password="pw", maxmemory=4 << 20) as server:   # started, PING answered
        server.client().set(b"k", b"v")
    with RedisCluster() as cluster:                                  # 3 masters, 1 replica each
        port = cluster.kill_master_for_key(b"k")
        cluster.wait_failover(port)

Nothing here persists: every server runs with `--save ""` and `--appendonly no`, so a restarted
server starts EMPTY. Tests define their own fixtures with these classes (there are none here).
Port 6379 (where Debian's packaged service may listen) is never used.
"""
from __future__ import annotations

import atexit
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path

import pytest
import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
HOST = "127.0.0.1"
CLUSTER_BUS_OFFSET = 10000       # a cluster node also listens on port + 10000 (the cluster bus)
CLUSTER_SLOTS = 16384

_missing = [name for name, path in (("redis-server", REDIS_SERVER), ("redis-cli", REDIS_CLI)) if not path]
needs_redis = pytest.mark.skipif(
    bool(_missing),
    reason=f"{' and '.join(_missing)} not found: ./scripts/setup.sh installs Debian's redis-server and redis-tools")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def cluster_ports(count: int = 6, limit: int = 55000) -> list[int]:
    """`count` distinct ports p < limit with p and p + 10000 (the cluster bus) both free on 127.0.0.1.

    The sockets are held until all are chosen, so no port is picked twice; another process could
    still take one before the servers bind it (the servers then fail to start, with their log)."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(count * 200):
            if len(ports) == count:
                return ports
            s = socket.socket()
            held.append(s)
            s.bind((HOST, 0))
            port = s.getsockname()[1]
            if port >= limit or port < 1024:
                continue
            bus = socket.socket()
            held.append(bus)
            try:
                bus.bind((HOST, port + CLUSTER_BUS_OFFSET))
            except OSError:
                continue
            ports.append(port)
        raise RuntimeError(f"found only {len(ports)} of {count} ports p < {limit} with p + 10000 free")
    finally:
        for s in held:
            s.close()


_LIVE: "weakref.WeakSet[RedisServer]" = weakref.WeakSet()


@atexit.register
def _kill_leftovers() -> None:
    # a test that forgot stop(), or an interrupted run: no redis-server outlives the test process
    for server in list(_LIVE):
        server.kill()


class RedisServer:
    """One `redis-server` child process on 127.0.0.1:<port> with a private --dir (its log there too).

    `start()` returns once PING answers (10 s at most). Data is never persisted: `restart()` brings the
    server back on the same port and directory, EMPTY. Use as a context manager (start, then stop and
    remove its own temporary directory) or call start()/stop()/close() yourself."""

    def __init__(self, port: int | None = None, *, password: str | None = None, maxmemory: int | None = None,
                 maxmemory_policy: str = "allkeys-lru", extra_args: list[str] | tuple[str, ...] = (),
                 dir: str | Path | None = None, start_timeout: float = 10.0) -> None:
        if not REDIS_SERVER:
            raise RuntimeError("redis-server not found: ./scripts/setup.sh installs Debian's redis-server")
        self.host = HOST
        self.port = port or free_port()
        self.password = password
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.extra_args = list(extra_args)
        self.start_timeout = start_timeout
        self._own_dir = dir is None
        self.dir = Path(dir) if dir is not None else Path(tempfile.mkdtemp(prefix=f"kvb-redis-{self.port}-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / "redis.log"
        self.proc: subprocess.Popen | None = None

    # ---- life cycle -------------------------------------------------------------------------------------
    def command(self) -> list[str]:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", self.host, "--dir", str(self.dir.resolve()),
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no",
                "--logfile", str(self.log_path.resolve())]
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.maxmemory is not None:
            args += ["--maxmemory", str(int(self.maxmemory)), "--maxmemory-policy", self.maxmemory_policy]
        return args + self.extra_args

    def spawn(self) -> None:
        """Starts the process without waiting for it (RedisCluster starts its nodes side by side)."""
        if self.running:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        with open(self.dir / "stdout.log", "ab") as out:   # config errors go to stderr, before the log opens
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, cwd=self.dir)
        _LIVE.add(self)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Until PING answers; on exit or timeout: kills the process and raises with the log's tail."""
        deadline = time.monotonic() + (self.start_timeout if timeout is None else timeout)
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"redis-server on port {self.port} exited ({code}) at start:\n{self.log_tail()}")
            try:
                with self.client(socket_timeout=1, socket_connect_timeout=1) as c:
                    if c.ping():
                        return
            except redis.RedisError as exc:
                last = exc
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING within the timeout ({last!r}):"
                           f"\n{self.log_tail()}")

    def start(self) -> "RedisServer":
        self.spawn()
        self.wait_ready()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (redis shuts down cleanly), SIGKILL after `timeout` seconds; waits for the exit."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _LIVE.discard(self)

    def kill(self) -> None:
        """SIGKILL, as in a crash; waits for the exit."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        _LIVE.discard(self)

    def restart(self) -> "RedisServer":
        """Stops the server if running and starts it again on the same port and dir: EMPTY (no persistence)."""
        self.stop()
        return self.start()

    def close(self) -> None:
        """stop(), then removes the directory if this object made it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- state and use ----------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def client(self, **kwargs) -> redis.Redis:
        """A redis.Redis for this server: its password, 5 s socket timeouts and NO retries unless given
        (redis-py's default retries a refused or failed connection 3 times with 1-10 s backoffs, which
        would hide a dead server for seconds; pass retry=... for that behaviour)."""
        kwargs.setdefault("retry", Retry(NoBackoff(), 0))
        kwargs.setdefault("socket_timeout", 5)
        kwargs.setdefault("socket_connect_timeout", 5)
        if self.password is not None:
            kwargs.setdefault("password", self.password)
        return redis.Redis(host=self.host, port=self.port, **kwargs)

    def pause(self, seconds: float) -> None:
        """`CLIENT PAUSE <ms> ALL`: every client's commands wait that long (a slow server). Returns at
        once; the pause cannot be lifted early (CLIENT UNPAUSE would wait too)."""
        with self.client() as c:
            c.execute_command("CLIENT", "PAUSE", str(max(1, int(seconds * 1000))), "ALL")

    def log_tail(self, chars: int = 3000) -> str:
        parts = []
        for path in (self.dir / "stdout.log", self.log_path):
            if path.is_file():
                text = path.read_text(errors="replace").strip()
                if text:
                    parts.append(f"--- {path.name} ---\n{text[-chars:]}")
        return "\n".join(parts) or "(no log)"

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisServer({self.host}:{self.port}, {state})"


def _cluster_nodes(text: str) -> list[dict]:
    """CLUSTER NODES' lines: id, port, flags (a set), master id, link, slot ranges [(first, last)]."""
    nodes = []
    for line in text.strip().splitlines():
        fields = line.split()
        address = fields[1].split("@")[0]
        ranges = []
        for entry in fields[8:]:
            if entry.startswith("["):            # a slot being imported or migrated
                continue
            first, _, last = entry.partition("-")
            ranges.append((int(first), int(last or first)))
        nodes.append({"id": fields[0], "port": int(address.rsplit(":", 1)[1]), "flags": set(fields[2].split(",")),
                      "master_id": fields[3], "link": fields[7], "slots": ranges})
    return nodes


def _info_fields(text: str) -> dict[str, str]:
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line and not line.startswith("#"))


class RedisCluster:
    """Six `redis-server` cluster nodes on 127.0.0.1 (3 masters with 1 replica each, made by
    `redis-cli --cluster create`), each with its own dir. `start()` returns once every node says
    cluster_state:ok and sees the same 3 masters and 3 replicas, and every replica's master link is up
    (30 s at most).

    Nodes use --cluster-node-timeout 1000 (a dead master fails over in a few seconds) and
    --repl-diskless-sync-delay 0 (replicas sync at once instead of after redis's default 5 s)."""

    def __init__(self, *, node_timeout_ms: int = 1000, extra_args: list[str] | tuple[str, ...] = (),
                 start_timeout: float = 30.0) -> None:
        if not (REDIS_SERVER and REDIS_CLI):
            raise RuntimeError("redis-server or redis-cli not found: ./scripts/setup.sh installs Debian's "
                               "redis-server and redis-tools")
        self.start_timeout = start_timeout
        self.root = Path(tempfile.mkdtemp(prefix="kvb-redis-cluster-"))
        self.ports = cluster_ports(6)
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms), "--repl-diskless-sync-delay", "0",
                *extra_args]
        self.nodes = [RedisServer(port, extra_args=args, dir=self.root / str(port)) for port in self.ports]
        self.dead: set[int] = set()                 # ports killed through this object
        self._killed_slots: dict[int, list[tuple[int, int]]] = {}
        self.startup_s: float | None = None          # how long start() took

    # ---- life cycle -------------------------------------------------------------------------------------
    def start(self) -> "RedisCluster":
        began = time.monotonic()
        try:
            for node in self.nodes:
                node.spawn()
            for node in self.nodes:
                node.wait_ready(timeout=10)
            addresses = [f"{HOST}:{p}" for p in self.ports]
            created = subprocess.run([REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "1",
                                      "--cluster-yes"], stdin=subprocess.DEVNULL, capture_output=True,
                                     text=True, timeout=max(5.0, self.start_timeout))
            if created.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed ({created.returncode}):\n"
                                   f"{created.stdout[-3000:]}\n{created.stderr[-2000:]}")
            self._wait_healthy(began + self.start_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - began
        return self

    def _wait_healthy(self, deadline: float) -> None:
        problem = "not checked yet"
        while time.monotonic() < deadline:
            problem = self._health_problem()
            if problem is None:
                return
            time.sleep(0.05)
        raise RuntimeError(f"cluster not healthy within {self.start_timeout} s: {problem}\n"
                           + "\n".join(f"[{n.port}] {n.log_tail(800)}" for n in self.nodes))

    def _health_problem(self) -> str | None:
        """None when every node says cluster_state:ok and sees 3 masters holding slots and 3 replicas, and
        every replica's master link is up."""
        masters = replicas = 0
        for node in self.live_nodes():
            try:
                with node.client(socket_timeout=1, decode_responses=True) as c:
                    state = _info_fields(c.execute_command("CLUSTER", "INFO")).get("cluster_state")
                    if state != "ok":
                        return f"node {node.port}: cluster_state:{state}"
                    repl = c.info("replication")
                    view = _cluster_nodes(c.execute_command("CLUSTER", "NODES"))
            except redis.RedisError as exc:
                return f"node {node.port}: {exc!r}"
            # INFO says what a node is; CLUSTER NODES what it has heard of the others (gossip lags)
            seen_masters = sum(1 for n in view if "master" in n["flags"] and n["slots"])
            seen_replicas = sum(1 for n in view if "slave" in n["flags"])
            if (seen_masters, seen_replicas) != (3, 3) or any(n["flags"] & {"fail", "fail?"} for n in view):
                return f"node {node.port} sees {seen_masters} masters, {seen_replicas} replicas: {view}"
            if repl.get("role") == "slave":
                if repl.get("master_link_status") != "up":
                    return f"replica {node.port}: master_link_status:{repl.get('master_link_status')}"
                replicas += 1
            else:
                masters += 1
        if (masters, replicas) != (3, 3):
            return f"{masters} masters and {replicas} replicas, not 3 and 3"
        return None

    def stop(self) -> None:
        """Stops every node (SIGTERM, SIGKILL after 5 s) side by side and removes the cluster's dir."""
        threads = [threading.Thread(target=node.stop) for node in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "RedisCluster":
        if not any(n.running for n in self.nodes):
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- views ------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"{HOST}:{p}" for p in self.ports[:3])

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def live_nodes(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.port not in self.dead and n.running]

    def cluster_nodes(self, port: int | None = None) -> list[dict]:
        """CLUSTER NODES as seen from `port` (default: the first live node), parsed."""
        node = self.node(port) if port is not None else self.live_nodes()[0]
        with node.client(decode_responses=True) as c:
            return _cluster_nodes(c.execute_command("CLUSTER", "NODES"))

    def masters(self) -> list[int]:
        """Ports of the live nodes that are masters now (a killed or failed node is left out)."""
        return sorted(n["port"] for n in self.cluster_nodes() if "master" in n["flags"]
                      and not n["flags"] & {"fail", "fail?"} and n["port"] not in self.dead)

    def replicas(self) -> list[int]:
        """Ports of the live nodes that are replicas now."""
        return sorted(n["port"] for n in self.cluster_nodes() if "slave" in n["flags"]
                      and not n["flags"] & {"fail", "fail?"} and n["port"] not in self.dead)

    def master_for_key(self, key: bytes | str) -> int:
        """The port of the live master serving `key`'s slot (as the first live node sees it)."""
        slot = key_slot(key.encode() if isinstance(key, str) else key)
        for n in self.cluster_nodes():
            if "master" in n["flags"] and any(a <= slot <= b for a, b in n["slots"]):
                return n["port"]
        raise RuntimeError(f"no master serves slot {slot}")

    def client(self, **kwargs) -> redis.cluster.RedisCluster:
        """A redis.cluster.RedisCluster with every live node as a startup node (5 s socket timeouts)."""
        kwargs.setdefault("socket_timeout", 5)
        kwargs.setdefault("socket_connect_timeout", 5)
        startup = [redis.cluster.ClusterNode(HOST, n.port) for n in self.live_nodes()]
        return redis.cluster.RedisCluster(startup_nodes=startup, **kwargs)

    # ---- faults -----------------------------------------------------------------------------------------
    def kill_master_for_key(self, key: bytes | str) -> int:
        """SIGKILLs the master holding `key`'s slot; returns its port."""
        port = self.master_for_key(key)
        self._killed_slots[port] = next(n["slots"] for n in self.cluster_nodes() if n["port"] == port)
        self.node(port).kill()
        self.dead.add(port)
        return port

    def wait_failover(self, dead_port: int, timeout: float = 20.0) -> int:
        """Waits until every surviving node says cluster_state:ok and the dead master's slots are served
        by a promoted replica (a live master); returns that replica's port. TimeoutError otherwise."""
        ranges = self._killed_slots.get(dead_port)
        if ranges is None:     # killed some other way: its slots as the survivors still remember them
            self.dead.add(dead_port)
            ranges = next(n["slots"] for n in self.cluster_nodes() if n["port"] == dead_port)
        if not ranges:
            raise ValueError(f"node {dead_port} served no slots: nothing to fail over")
        deadline = time.monotonic() + timeout
        problem = "not checked yet"
        while time.monotonic() < deadline:
            problem, promoted = self._failover_problem(dead_port, ranges)
            if problem is None:
                return promoted
            time.sleep(0.05)
        raise TimeoutError(f"no failover of node {dead_port} within {timeout} s: {problem}")

    def _failover_problem(self, dead_port: int, ranges: list[tuple[int, int]]) -> tuple[str | None, int]:
        promoted = -1
        for node in self.live_nodes():
            try:
                with node.client(socket_timeout=1, decode_responses=True) as c:
                    state = _info_fields(c.execute_command("CLUSTER", "INFO")).get("cluster_state")
                    nodes = _cluster_nodes(c.execute_command("CLUSTER", "NODES"))
            except redis.RedisError as exc:
                return f"node {node.port}: {exc!r}", -1
            if state != "ok":
                return f"node {node.port}: cluster_state:{state}", -1
            owners = set()
            for first, last in ranges:
                owner = [n["port"] for n in nodes if "master" in n["flags"]
                         and any(a <= first and last <= b for a, b in n["slots"])]
                if not owner:
                    return f"node {node.port}: no master serves slots {first}-{last}", -1
                owners.update(owner)
            if len(owners) != 1 or dead_port in owners or owners & self.dead:
                return f"node {node.port}: slots {ranges} served by {sorted(owners)}", -1
            if promoted not in (-1, *owners):
                return f"nodes disagree on the promoted replica: {promoted} or {sorted(owners)}", -1
            promoted = owners.pop()
        try:
            with self.node(promoted).client(socket_timeout=1, decode_responses=True) as c:
                role = c.info("replication").get("role")
        except redis.RedisError as exc:
            return f"promoted node {promoted}: {exc!r}", -1
        if role != "master":
            return f"promoted node {promoted}: role:{role}", -1
        return None, promoted

    def __repr__(self) -> str:
        return f"RedisCluster({self.url}, dead={sorted(self.dead)})"
