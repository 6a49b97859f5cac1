"""A seeded protocol fuzzer for the cache server: malformed and adversarial messages against a real server.

Place: beside the cache server's tests and benchmarks (tests/test_cache_server_fuzz.py runs a bounded
round in CI; `python -m kvbridge.bench.probes.protocol_fuzz` runs a longer one against a private server and
prints the figures for Docs/Research.md).

Connections speak raw ZMQ. A stranger (a CURVE DEALER that knows the server's public key, which is not
a secret, but not its token) sends anything: random bytes, msgpack of the wrong shape, envelopes of
unknown or valid kinds, unfinished multipart messages; the handshake turns it away, so it must never
get one reply. A member says hello with the owner's keys and token and then sends *valid* messages
with hostile values: huge or negative sizes and ids, thousands of keys, keys of odd lengths, long
strings, wrong numbers of data frames, random lease ids, module calls to methods that do not exist,
and hostile frame sizes (one frame past the message limit, thousands of empty frames). Then
`unfinished_multipart` writes raw ZMTP frames flagged "more" without end, as a peer that does not use
libzmq can (libzmq itself holds such a message on the sender's side), and `squat_round` takes the
port once the server is stopped, to see that the owner's client sends the squatter nothing.
Afterwards the caller checks what a user would: the server is alive, answers a real client, holds no
lease and no pending page once the fuzzer said goodbye, and kept the objects stored before. Messages
that would only erase data (clear) are not sent.
"""
from __future__ import annotations

import collections
import os
import random
import socket
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq

from kvbridge.cache_server import protocol
from kvbridge.cache_server.auth import client_token
from kvbridge.cache_server.curve import apply_client, client_keys
from kvbridge.cache_server.protocol import Kind
from kvbridge.settings.cmdline import Parser

# valid kinds the authenticated connection fuzzes (CLEAR erases data: left out; GOODBYE ends the session)
FUZZED_KINDS = [Kind.PING, Kind.STATUS, Kind.LOOKUP, Kind.RETRIEVE, Kind.RETRIEVE_MANY, Kind.RELEASE,
                Kind.STORE_PREPARE, Kind.STORE_COMMIT, Kind.STORE_PREPARE_MANY, Kind.STORE_COMMIT_MANY,
                Kind.STORE_INLINE, Kind.FLUSH, Kind.SERVER_MODULE_CALL, Kind.SERVER_MODULE_AFFINITY_CALL, Kind.HELLO]


@dataclass
class FuzzReport:
    seed: int
    sent: int = 0
    unauthenticated: int = 0
    unauthenticated_dropped: int = 0   # the stranger's sends that found no connection to queue on
    stranger_replies: int = 0          # replies the stranger got: must stay 0
    hostile_sizes: int = 0             # member messages of hostile frame sizes or counts
    replies: int = 0
    codes: collections.Counter = field(default_factory=collections.Counter)
    seconds: float = 0.0

    def summary(self) -> str:
        codes = ", ".join(f"{code or 'ok'} {n}" for code, n in self.codes.most_common())
        return (f"seed {self.seed}: {self.sent} messages ({self.unauthenticated} unauthenticated, "
                f"{self.stranger_replies} of them answered; {self.hostile_sizes} of hostile frame sizes) in "
                f"{self.seconds:.1f} s, {self.replies} replies ({codes})")


class _Hostile:
    """Values chosen to hurt: boundaries, huge, negative, odd lengths."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def int(self) -> int:
        return self.rng.choice([0, -1, 1, 2**31 - 1, -2**31, 2**62, -2**62, 2**63 - 1,
                                self.rng.randrange(-10**6, 10**6), self.rng.randrange(1 << 40)])

    def size(self) -> int:
        return self.rng.choice([0, 1, -1, 4096, 1 << 20, 1 << 30, 1 << 40, 2**62, self.rng.randrange(1 << 24)])

    def key(self) -> bytes:
        return self.rng.randbytes(self.rng.choice([0, 1, 15, 16, 32, 33, 64, 1024]))

    def text(self) -> str:
        return self.rng.choice(["", "ns", "\x00", "é" * 40, "x" * self.rng.choice([1, 300, 70_000]),
                                "L1", "L2", "kv_events.recent", "nosuch.method", "no-dot"])

    def meta(self) -> protocol.WireMeta:
        return protocol.WireMeta(self.text(), self.int(), self.rng.randbytes(self.rng.choice([0, 16, 200])),
                                 self.rng.choice(["chunk", "tail", "snapshot", "index", "nonsense", ""]),
                                 codec=self.rng.choice(["raw", "zstd", "int8", "bogus"]))

    def keys(self) -> list[bytes]:
        n = self.rng.choice([0, 1, 2, 64, 300, 5000])
        return [self.key() for _ in range(min(n, 5000))]


def _valid_body(kind: str, h: _Hostile, token: str):
    rng = h.rng
    if kind == Kind.HELLO:
        return protocol.Hello(rng.choice([protocol.PROTOCOL_VERSION, 0, 99]), rng.choice([token, "", "wrong"]),
                              rng.choice([0, 5, 9, -1, 10, 2**40]), h.int(), h.text(), h.text())
    if kind == Kind.LOOKUP:
        return protocol.Lookup(h.keys(), rng.choice([None, h.text()]), h.int())
    if kind == Kind.RETRIEVE:
        return protocol.Retrieve(h.key(), rng.choice([None, h.text()]), rng.random() < 0.5)
    if kind == Kind.RETRIEVE_MANY:
        keys = h.keys()
        if keys and rng.random() < 0.3:
            keys = [keys[0]] * rng.choice([2, 4096])   # the amplification request
        return protocol.RetrieveMany(keys, rng.choice([None, h.text()]), rng.random() < 0.5)
    if kind == Kind.RELEASE:
        return protocol.Release([h.int() for _ in range(rng.choice([0, 1, 3, 1000]))])
    if kind == Kind.STORE_PREPARE:
        return protocol.StorePrepare(h.key(), h.size(), h.meta())
    if kind == Kind.STORE_COMMIT:
        return protocol.StoreCommit(h.int())
    if kind == Kind.STORE_PREPARE_MANY:
        return protocol.StorePrepareMany([protocol.StorePrepare(h.key(), h.size(), h.meta())
                                          for _ in range(rng.choice([0, 1, 3, 600]))])
    if kind == Kind.STORE_COMMIT_MANY:
        return protocol.StoreCommitMany([h.int() for _ in range(rng.choice([0, 1, 3, 1000]))])
    if kind == Kind.STORE_INLINE:
        return protocol.StoreInline(h.key(), h.meta())
    if kind in (Kind.SERVER_MODULE_CALL, Kind.SERVER_MODULE_AFFINITY_CALL):
        return protocol.ServerModuleCallRequest(h.text(), rng.randbytes(rng.choice([0, 8, 2000])))
    return None


def _garbage(rng: random.Random) -> list[bytes]:
    choice = rng.randrange(5)
    if choice == 0:
        return [rng.randbytes(rng.randrange(0, 2000))]
    if choice == 1:
        return [msgspec.msgpack.encode(rng.choice([{}, [], 7, "hello", [1, "x", "ping"], {"kind": "ping"}]))]
    if choice == 2:   # an envelope of an unknown kind, or of a known kind with a body that is not one
        kind = rng.choice(["nosuch", "", "x" * 1000, *FUZZED_KINDS])
        return [protocol.encode(protocol.Envelope(rng.randrange(1 << 32), "fuzz", kind,
                                                  msgspec.Raw(msgspec.msgpack.encode(rng.randbytes(20)))))]
    if choice == 3:
        return [b""] * rng.randrange(1, 40)
    return [protocol.encode_request(rng.randrange(1 << 32), "intruder", rng.choice(FUZZED_KINDS), None),
            rng.randbytes(rng.randrange(0, 5000))]


def _hostile_frames(rng: random.Random, limit: int, member_id: str, rid: int) -> list:
    """A ping whose message breaks the whole-message bound: one frame past `limit`, or a flood of empty frames."""
    head = protocol.encode_request(rid, member_id, Kind.PING)
    if rng.random() < 0.5:
        return [head, b"\0" * (limit + 1)]
    return [head] + [b""] * rng.choice([protocol.MAX_REQUEST_FRAMES, 1000, 20_000])


def fuzz(url: str, count: int, seed: int = 0, token: str | None = None, deadline_s: float = 120.0,
         max_message_bytes: int = 256 << 20) -> FuzzReport:
    """Send `count` messages (a fifth from the stranger, one in a hundred of hostile frame sizes); bounded by
    deadline_s; returns what came back. `max_message_bytes`: the server's KVB_CACHE_SERVER_MAX_MESSAGE_BYTES."""
    rng = random.Random(seed)
    hostile = _Hostile(rng)
    token = client_token(url) if token is None else token
    report = FuzzReport(seed)
    ctx = zmq.Context()
    try:
        stranger, member = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        keys = client_keys(url, token)
        public, secret = zmq.curve_keypair()   # the stranger: the server's public key, a key pair of its own
        stranger.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public.encode())
        stranger.setsockopt(zmq.CURVE_PUBLICKEY, public)
        stranger.setsockopt(zmq.CURVE_SECRETKEY, secret)
        apply_client(member, keys)
        for sock in (stranger, member):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.connect(url)
        member_id = f"fuzz-{seed}"
        member.send_multipart([protocol.encode_request(1, member_id, Kind.HELLO,
                                                       protocol.Hello(protocol.PROTOCOL_VERSION, token, 5, os.getpid(),
                                                                      "fuzzer", "protocol fuzzer"))])
        started = time.monotonic()
        poller = zmq.Poller()
        poller.register(stranger, zmq.POLLIN)
        poller.register(member, zmq.POLLIN)
        for i in range(count):
            if time.monotonic() - started > deadline_s:
                break
            if rng.random() < 0.2:
                frames = _garbage(rng)
                more = rng.random() < 0.2   # an unfinished multipart message: its last frame never comes
                try:
                    stranger.send_multipart(frames, zmq.NOBLOCK | (zmq.SNDMORE if more else 0))
                except zmq.Again:   # turned away in the handshake: nothing left to queue on
                    report.unauthenticated_dropped += 1
                report.unauthenticated += 1
            elif rng.random() < 0.01:
                member.send_multipart(_hostile_frames(rng, max_message_bytes, member_id, i + 2))
                report.hostile_sizes += 1
            else:
                kind = rng.choice(FUZZED_KINDS)
                frames = [protocol.encode_request(rng.choice([i + 2, 0, 2**63 - 1]), member_id, kind,
                                                  _valid_body(kind, hostile, token))]
                frames += [rng.randbytes(rng.choice([0, 10, 4096])) for _ in range(rng.choice([0, 0, 1, 2, 3]))]
                member.send_multipart(frames)
            report.sent += 1
            if i % 50 == 49:   # keep up with the replies, so neither side's queues grow without bound
                _drain(poller, report, stranger, wait_ms=200)
        _drain(poller, report, stranger, wait_ms=2000)
        member.send_multipart([protocol.encode_request(3, member_id, Kind.GOODBYE, None)])
        _drain(poller, report, stranger, wait_ms=2000)
        report.seconds = time.monotonic() - started
        return report
    finally:
        ctx.destroy(linger=0)


def unfinished_multipart(url: str, frames: int = 64, frame_bytes: int = 1 << 20, timeout_s: float = 10.0) -> int:
    """Write raw ZMTP 3.0 (NULL mechanism) to a tcp:// server: a greeting, READY as a DEALER, then frames all
    flagged "more". libzmq would hold every such frame until the last one; returns how many bytes of frames
    the server took before it hung up (all of them, for a server that does not authenticate peers first)."""
    host, _, port = url[len("tcp://"):].rpartition(":")
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + bytes(31)
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    payload = os.urandom(frame_bytes)
    sent = 0
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
        try:
            sock.sendall(greeting + b"\x04" + bytes([len(ready)]) + ready)
            for _ in range(frames):
                sock.sendall(b"\x03" + struct.pack(">Q", frame_bytes) + payload)   # MORE | LONG
                sent += frame_bytes
            time.sleep(0.5)   # let the server read them before the connection closes
        except OSError:   # reset: the server hung up on us
            pass
    return sent


def squat_round(url: str, curve: bool = False) -> dict:
    """With the owner's server stopped: a squatter takes `url`; the owner's client (default settings) tries
    to say hello and store. What a user checks: refused, and the squatter received nothing."""
    from kvbridge.bench.probes.squatter import Squatter
    from kvbridge.cache_server.client import CacheClient, CacheServerRefused
    from kvbridge.store.objects import ObjectMeta

    squatter = Squatter(url, curve=curve)
    blob = b"the owner's KV " * 1000
    try:
        try:
            with CacheClient(url, timeout_s=2) as client:
                client.store(b"s" * 16, blob, ObjectMeta(namespace="ns", n_tokens=1, tokens_digest=b"", kind="chunk"))
            refused = ""
        except CacheServerRefused as exc:
            refused = str(exc)
        return {"refused": refused, "messages": squatter.messages, "saw_object": squatter.saw(blob)}
    finally:
        squatter.close()


def _drain(poller: zmq.Poller, report: FuzzReport, stranger: zmq.Socket, wait_ms: int) -> None:
    deadline = time.monotonic() + wait_ms / 1000
    while True:
        left = int((deadline - time.monotonic()) * 1000)
        events = dict(poller.poll(max(0, min(left, 100))))
        if not events:
            if left <= 0:
                return
            continue
        for sock in events:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            report.replies += 1
            report.stranger_replies += sock is stranger
            try:
                report.codes[protocol.decode_reply(frames[0]).code] += 1
            except (msgspec.DecodeError, msgspec.ValidationError):
                report.codes["undecodable reply"] += 1


def main(argv: list[str] | None = None) -> int:
    """A private cache server, a long fuzz round against it, then the checks; prints one report."""
    from kvbridge.bench.common.private_server import PrivateCacheServer
    from kvbridge.cache_server.client import CacheClient
    from kvbridge.settings import Settings
    from kvbridge.store.objects import ObjectMeta

    parser = Parser(prog="python -m kvbridge.bench.probes.protocol_fuzz", description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=50_000, help="messages to send (default 50000)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    settings = Settings.from_env().replace(l1_bytes=64 << 20)
    with tempfile.TemporaryDirectory(prefix="kvb-fuzz-") as tmp:
        server = PrivateCacheServer(settings, Path(tmp))
        try:
            meta = ObjectMeta(namespace="ns", n_tokens=1, tokens_digest=b"", kind="chunk")
            with CacheClient(server.url, timeout_s=10) as client:
                client.store(b"k" * 16, b"kept" * 1000, meta)
            report = fuzz(server.url, args.count, args.seed, deadline_s=1800,
                          max_message_bytes=settings.cache_server_max_message_bytes)
            flooded = unfinished_multipart(server.url, frames=256)
            alive = server.proc.poll() is None
            with CacheClient(server.url, timeout_s=10) as client:
                kept = client.retrieve(b"k" * 16, "ns")
                intact = kept is not None and bytes(kept.blob) == b"kept" * 1000
                if kept is not None:
                    client.release([kept])
                client.lookup([b"z" * 16])   # a round trip after the release (sent without waiting)
                pool = client.status()["storage"]["pool"]
            peak = _peak_rss_mb(server.pid)
        finally:
            server.stop()
        squats = {kind: squat_round(server.url, curve=kind == "curve") for kind in ("says-yes", "curve")}
    print(report.summary())
    print(f"server alive: {alive}; object stored before intact: {intact}; read leases {pool['read_leases']}, "
          f"write leases {pool['write_leases']}; server peak RSS {peak} MB; an unauthenticated peer's "
          f"unfinished multipart message: {flooded >> 20} MiB taken before the server hung up")
    for kind, squat in squats.items():
        print(f"squatter ({kind}) on the stopped server's port: client refused: {bool(squat['refused'])}; "
              f"messages it received: {squat['messages']}")
    squatted = any(not q["refused"] or q["messages"] for q in squats.values())
    return 0 if alive and intact and not report.stranger_replies and not squatted else 1


def _peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return float("nan")


if __name__ == "__main__":
    sys.exit(main())
