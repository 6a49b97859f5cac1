"""A private SeaweedFS cluster for tests and benches: master, two volume servers, a filer and S3, replicated.

Place in the flow: the cluster test (tests/test_s3_cluster.py) points KVB_S3_URL at it, as the other S3
tests do at `weed mini` (kvbridge.bench.common.private_s3, whose binary lookup, identities file, keys and
env() this reuses). The difference is what can fail: every part is its own process, and the master's
`-defaultReplication=001` keeps one extra copy of every object on the other volume server (same data
centre, same rack), so one volume server can die (SIGKILL, `kill_volume`) while reads go on.

    weed master  -defaultReplication=001 -volumeSizeLimitMB=64   metadata in <dir>/master
    weed volume  x2  -master=<master>  -dir=<dir>/volume-N        the objects' bytes, each copy on one
    weed filer   -master=<master>  -defaultStoreDir=<dir>/filer   the names (an embedded leveldb)
    weed s3      -filer=<filer>  -config=<identities>             the S3 endpoint, auth on

Everything on 127.0.0.1 (-ip and -ip.bind; the defaults are a public address and 0.0.0.0), free ports,
one temp folder with a subfolder per process, the filer's and S3's unix sockets inside it (their default
is /tmp/seaweedfs-*.sock, which would outlive the run), no telemetry, no Iceberg or Lance ports. Started
in dependency order with a bounded wait for each; stopped in reverse.

    with private_s3_cluster() as cluster:
        env = {**os.environ, **cluster.env()}     # KVB_S3_URL, KVB_S3_BUCKET, the key names and their values
        cluster.kill_volume(1)                    # SIGKILL one volume server: its copies are gone

Deliberately left out: several masters (raft), several filers, erasure coding, racks and data centres
(replication 001 needs neither) and TLS.
"""
from __future__ import annotations

import contextlib
import json
import logging
import secrets
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from kvbridge.bench.common.private_s3 import (ACCESS_KEY_ENV, SECRET_KEY_ENV, STARTUP_S, STOP_S, _free_ports,
                                              anonymous_status, find_weed)
from kvbridge.errors import KVBridgeError

log = logging.getLogger(__name__)
REPLICATION = "001"          # one extra copy on another volume server in the same rack
VOLUME_SIZE_MB = 64          # small volumes: a test writes a few MB, and growth allocates several at once
VOLUMES = 2
FILER_STOP_S = 3.0           # weed filer 4.48's graceful gRPC stop waits on its own metadata subscription
                             # (seen here: >12 s after SIGTERM); its data is in the temp folder, so SIGKILL after 3 s


@dataclass
class _Part:
    """One weed process of the cluster: its name, command line and log."""

    name: str
    command: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self, cwd: Path) -> None:
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(self.command, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log_file,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=STOP_S)

    def stop(self) -> None:
        if not self.running:
            return
        grace = FILER_STOP_S if self.name == "filer" else STOP_S
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            (log.debug if self.name == "filer" else log.warning)(
                "weed %s (pid %d) ignored SIGTERM for %.0f s: killed", self.name, self.proc.pid, grace)
            self.kill()

    def log_tail(self, chars: int = 1200) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


@dataclass
class PrivateS3Cluster:
    """A master, VOLUMES volume servers, a filer and an S3 gateway on 127.0.0.1, replication 001."""

    directory: Path
    binary: str
    bucket: str = "kvbridge"
    access_key: str = field(default_factory=lambda: "KVB" + secrets.token_hex(8).upper())
    secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    ports: dict[str, int] = field(default_factory=dict)
    parts: dict[str, _Part] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self, prefix: str = "kvb") -> dict[str, str]:
        """The KVB_S3_ settings for this endpoint, and the two variables holding its keys (as PrivateS3.env)."""
        return {"KVB_S3_URL": self.url, "KVB_S3_BUCKET": self.bucket, "KVB_S3_PREFIX": prefix,
                "KVB_S3_ACCESS_KEY_ENV": ACCESS_KEY_ENV, "KVB_S3_SECRET_KEY_ENV": SECRET_KEY_ENV,
                ACCESS_KEY_ENV: self.access_key, SECRET_KEY_ENV: self.secret_key}

    def volume_names(self) -> list[str]:
        return [f"volume-{i}" for i in range(VOLUMES)]

    def _commands(self) -> dict[str, list[str]]:
        """Each part's command line, in start order (every flag as `weed <part> -h` names it)."""
        p, d, loop = self.ports, self.directory, ["-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        master = f"127.0.0.1:{p['master']}.{p['master.grpc']}"     # host:http.grpc (grpc is not http+10000 here)
        commands = {"master": [self.binary, "master", *loop, f"-port={p['master']}", f"-port.grpc={p['master.grpc']}",
                               f"-mdir={d / 'master'}", f"-defaultReplication={REPLICATION}",
                               f"-volumeSizeLimitMB={VOLUME_SIZE_MB}", "-telemetry=false"]}
        for name in self.volume_names():
            commands[name] = [self.binary, "volume", *loop, f"-port={p[name]}", f"-port.grpc={p[name + '.grpc']}",
                              f"-dir={d / name}", "-max=16", f"-master={master}", "-preStopSeconds=0",
                              "-minFreeSpace=1GiB"]
        commands["filer"] = [self.binary, "filer", *loop, f"-port={p['filer']}", f"-port.grpc={p['filer.grpc']}",
                             f"-master={master}", f"-defaultStoreDir={d / 'filer'}",
                             f"-localSocket={d / 'filer.sock'}"]
        commands["s3"] = [self.binary, "s3", *loop, f"-port={p['s3']}", f"-port.grpc={p['s3.grpc']}",
                          f"-filer=127.0.0.1:{p['filer']}.{p['filer.grpc']}", f"-config={d / 'identities.json'}",
                          "-port.iceberg=0", "-port.lance=0", f"-localSocket={d / 's3.sock'}"]
        return commands

    def start(self) -> "PrivateS3Cluster":
        """Start every part in order, each waited for, then make the bucket; stop all on any failure."""
        names = ["master", *self.volume_names(), "filer", "s3"]
        if not self.ports:
            wanted = [n for name in names for n in (name, name + ".grpc")]
            self.ports = dict(zip(wanted, _free_ports(len(wanted))))
        identities = self.directory / "identities.json"
        identities.write_text(json.dumps({"identities": [{
            "name": "kvbridge", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        identities.chmod(0o600)
        try:
            for name, command in self._commands().items():
                folder = self.directory / name
                folder.mkdir(parents=True, exist_ok=True)
                part = self.parts[name] = _Part(name, command, self.directory / f"{name}.log")
                part.start(cwd=folder)     # the filer looks for filer.toml in its cwd first: an empty folder
                self._wait_for(name)
            self._make_bucket()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_for(self, name: str) -> None:
        """Until the part answers: the master with its volume servers registered, the S3 gateway with 403."""
        deadline = time.monotonic() + STARTUP_S
        part = self.parts[name]
        while True:
            if self._ready(name):
                return
            if not part.running or time.monotonic() > deadline:
                raise KVBridgeError(f"weed {name} on port {self.ports[name]} did not become ready (exit "
                                    f"{part.proc.poll()}); its log ends: {part.log_tail()}")
            time.sleep(0.1)

    def _ready(self, name: str) -> bool:
        if name == "s3":
            return anonymous_status(f"{self.url}/") == 403          # up, and auth on
        if name.startswith("volume"):                             # registered with the master
            return self.ports[name] in self.volume_ports_known()
        return anonymous_status(f"http://127.0.0.1:{self.ports[name]}/") is not None

    def volume_ports_known(self) -> set[int]:
        """The ports of the volume servers the master lists as alive (its /dir/status topology)."""
        status = _get_json(f"http://127.0.0.1:{self.ports['master']}/dir/status")
        ports = set()
        for centre in (status or {}).get("Topology", {}).get("DataCenters") or []:
            for rack in centre.get("Racks") or []:
                for node in rack.get("DataNodes") or []:
                    ports.add(int(str(node.get("Url", "")).rpartition(":")[2] or 0))
        return ports

    def _make_bucket(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        from kvbridge.store.s3_link import connect

        client = connect(self.url, "us-east-1", self.access_key, self.secret_key, timeout=10.0)
        deadline = time.monotonic() + STARTUP_S
        while True:      # the gateway answers before the filer has told it everything: retry briefly
            try:
                client.create_bucket(Bucket=self.bucket)
                return
            except (BotoCoreError, ClientError) as error:
                if "BucketAlreadyOwnedByYou" in str(error) or "BucketAlreadyExists" in str(error):
                    return
                if time.monotonic() > deadline:
                    raise KVBridgeError(f"weed s3 did not create bucket {self.bucket!r}: {error}") from None
                time.sleep(0.2)

    def kill_volume(self, index: int) -> int:
        """SIGKILL volume server `index` (a host dying with its copies); its pid."""
        part = self.parts[f"volume-{index}"]
        pid = part.proc.pid
        part.kill()
        return pid

    def pids(self) -> dict[str, int]:
        return {name: part.proc.pid for name, part in self.parts.items() if part.running}

    def stop(self) -> None:
        """SIGTERM each part in reverse start order (SIGKILL after STOP_S)."""
        for part in reversed(list(self.parts.values())):
            part.stop()


@contextlib.contextmanager
def private_s3_cluster(binary: str | None = None, bucket: str = "kvbridge") -> Iterator[PrivateS3Cluster]:
    """A private SeaweedFS cluster for the duration of a test or bench; its folder is removed after."""
    weed = find_weed(binary)
    with tempfile.TemporaryDirectory(prefix="kvb-s3c-") as temp:
        cluster = PrivateS3Cluster(Path(temp), weed, bucket=bucket)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()


def _get_json(url: str, timeout: float = 2.0) -> dict | None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # loopback: never through a proxy
    try:
        with opener.open(url, timeout=timeout) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None
