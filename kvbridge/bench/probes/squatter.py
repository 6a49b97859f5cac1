"""A squatter: a server on the cache server's address that says yes to any hello and keeps every frame.

What another account can run on the owner's port while the owner's cache server is down (after a
crash, during a restart, before boot brought it up). Place: the protocol fuzzer's last round
(`squat_round`), tests/test_cache_server_owner.py (run there as a second OS user) and
tests/test_cache_server_curve.py. It answers hello as a server would, says "stored" to every store
and hands back a planted object to every retrieve, so a client that trusted it would both leak its KV
and restore the squatter's. `curve=True`: it speaks CURVE with a key pair of its own and admits any
client key (a kvbridge cache server of that account, whose ZAP handler knows only that account's
clients, would admit no one; this is the more permissive squatter).

`python -m kvbridge.bench.probes.squatter URL [--curve]` runs one until stdin closes, then prints one JSON
line: messages and bytes received, and whether the bytes given with --watch were among them.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import uuid

import msgspec
import zmq

from kvbridge.cache_server import protocol
from kvbridge.cache_server.protocol import Kind
from kvbridge.settings.cmdline import Parser

PLANTED = b"planted KV that the squatter hands to anyone who asks"


class Squatter:
    def __init__(self, url: str, curve: bool = False) -> None:
        self.url = url
        self.messages = 0
        self.bytes = 0
        self.kinds: list[str] = []
        self._frames: list[bytes] = []
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        if curve:
            public, secret = zmq.curve_keypair()
            self._router.setsockopt(zmq.CURVE_SERVER, 1)
            self._router.setsockopt(zmq.CURVE_SECRETKEY, secret)
            self._router.setsockopt(zmq.CURVE_PUBLICKEY, public)
        self._router.bind(url)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="squatter", daemon=True)
        self._thread.start()

    def saw(self, data: bytes) -> bool:
        """Did any frame it received contain `data` (or its first 4 KiB, for a copy split across frames)?"""
        needle = data[:4096]
        return any(needle in frame for frame in self._frames)

    def summary(self, watch: bytes = b"") -> dict:
        return {"messages": self.messages, "bytes": self.bytes, "kinds": self.kinds[:20],
                "saw_watched": bool(watch) and self.saw(watch)}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._router.close(0)
        self._ctx.destroy(linger=0)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(100):
                continue
            identity, *frames = self._router.recv_multipart()
            self.messages += 1
            self.bytes += sum(len(f) for f in frames)
            self._frames.extend(frames)
            self._router.send_multipart([identity, *self._answer(frames)])

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        try:
            envelope = protocol.decode_envelope(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
            return [protocol.encode_reply(0)]
        self.kinds.append(envelope.kind)
        rid = envelope.request_id
        if envelope.kind == Kind.HELLO:
            return [protocol.encode_reply(rid, protocol.HelloReply(
                protocol.PROTOCOL_VERSION, uuid.uuid4().hex, ["L1", "L2"], 0.0, 30.0))]
        if envelope.kind in (Kind.STORE_INLINE, Kind.STORE_COMMIT):
            return [protocol.encode_reply(rid, protocol.StoreReply(True))]
        if envelope.kind == Kind.RETRIEVE:
            meta = protocol.WireMeta("ns", 1, b"", "chunk")
            return [protocol.encode_reply(rid, protocol.RetrieveReply(True, "L1", meta)), PLANTED]
        return [protocol.encode_reply(rid)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = Parser(prog="python -m kvbridge.bench.probes.squatter", description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--curve", action="store_true", help="speak CURVE with a key pair of its own")
    parser.add_argument("--watch", default="", help="a file whose bytes to look for among those received")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    """Squat until stdin closes; print one JSON line of what was received. (Imports nothing new, so a caller
    may parse the arguments, drop to another uid, then call this.)"""
    watch = open(args.watch, "rb").read() if args.watch else b""
    squatter = Squatter(args.url, curve=args.curve)
    print("squatting", flush=True)
    sys.stdin.read()   # until the caller closes our stdin
    squatter.close()
    print(json.dumps(squatter.summary(watch)), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
