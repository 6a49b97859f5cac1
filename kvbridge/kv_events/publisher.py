"""The ZMQ side of KV events: one PUB socket (bound to 127.0.0.1 or an ipc:// path of mode 0600), a
replay ROUTER socket next to it, and one sender thread that owns both.

Frames are vLLM's: [topic b"", seq (8 bytes big-endian, from 0, no gaps), batch]. `publish(events)`
only queues; the sender thread numbers and sends. The queue is bounded: a publisher that cannot keep up
makes its one producer (the BlockView's thread) wait, never the scheduler, and nothing is dropped, so
a consumer's view is never left holding a block nobody told it was removed. ZMQ itself drops messages
for a subscriber that is too slow (its high-water mark); that subscriber sees a gap in the sequence
numbers and asks the replay socket for what it missed (vllm-router: --kv-event-replay-source), from a
ring of the last REPLAY_BATCHES batches.

The PUB socket is an XPUB: a new subscriber's subscription reaches `on_subscribe`, so the block view can
announce everything it holds to it (a PUB/SUB joiner otherwise sees only what is published after it).
"""
from __future__ import annotations

import collections
import logging
import os
import threading
from urllib.parse import urlparse

import zmq

from kvbridge.kv_events import wire

log = logging.getLogger(__name__)
QUEUE_BATCHES = 256      # queued batches before publish() waits
REPLAY_BATCHES = 4096    # sent batches kept for replay ...
REPLAY_BYTES = 64 << 20  # ... and at most this many bytes of them
MAX_EVENTS_PER_BATCH = 512
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


class KVEventsUrlError(ValueError):
    """KVB_KV_EVENTS_URL names something this publisher will not bind."""


def check_events_url(url: str) -> None:
    """Events name the prompts this instance holds: tcp on loopback or an ipc path, nothing else."""
    parsed = urlparse(url)
    if parsed.scheme == "ipc" and (parsed.netloc + parsed.path):
        return
    if parsed.scheme == "tcp" and parsed.hostname in LOOPBACK_HOSTS:
        return
    raise KVEventsUrlError(
        f"KVB_KV_EVENTS_URL={url!r}: use tcp://127.0.0.1:PORT (this machine only) or ipc:///path (a socket "
        "file of mode 0600); KV events carry the token ids of the prompts this instance holds")


def _bind(sock: zmq.Socket, url: str) -> str:
    """Bind; tcp port 0 (or none) takes a free port; ipc files are made 0600 at once. The bound URL."""
    parsed = urlparse(url)
    if parsed.scheme == "tcp":
        log.warning("KV events on %s: every local account can subscribe (a TCP publisher cannot be authenticated: "
                    "vllm-router has no CURVE); an ipc:// path in a folder only this user can enter keeps them "
                    "private, as `kvbridge fleet` does", url)
        host = "127.0.0.1" if parsed.hostname in ("127.0.0.1", "localhost") else "[::1]"
        if host == "[::1]":
            sock.setsockopt(zmq.IPV6, 1)
        if not parsed.port:
            port = sock.bind_to_random_port(f"tcp://{host}")
            return f"tcp://{host}:{port}"
        sock.bind(f"tcp://{host}:{parsed.port}")
        return f"tcp://{host}:{parsed.port}"
    path = parsed.netloc + parsed.path
    # the file is never group- or world-accessible, not even for a moment (the umask is process-wide: a
    # file another thread creates meanwhile is at worst private too)
    old_umask = os.umask(0o177)
    try:
        sock.bind(f"ipc://{path}")
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    return f"ipc://{path}"


def _bind_or_explain(sock: zmq.Socket, url: str) -> str:
    """_bind, with a taken port or an unusable path said for a person (naming KVB_KV_EVENTS_URL)."""
    try:
        return _bind(sock, url)
    except (zmq.ZMQError, OSError) as exc:
        raise KVEventsUrlError(f"KV events cannot bind {url} (KVB_KV_EVENTS_URL): {exc}; the port is in use or the "
                               "path is not writable: choose another port, tcp://127.0.0.1:0 for a free one, "
                               "or another ipc:// path") from None


def replay_url_for(url: str) -> str:
    """The replay socket's address: a free loopback port for tcp, the path plus ".replay" for ipc."""
    parsed = urlparse(url)
    if parsed.scheme == "ipc":
        return f"ipc://{parsed.netloc + parsed.path}.replay"
    return f"tcp://{parsed.hostname}:0"


class KVEventPublisher:
    """`publish(events)` from one producer thread; `.endpoint` and `.replay_endpoint` for the router."""

    def __init__(self, url: str = "tcp://127.0.0.1:0", *, topic: bytes = b"", on_subscribe=None):
        check_events_url(url)
        self._topic = topic
        self.on_subscribe = on_subscribe
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)   # every subscriber's subscription, not only the first
        self._pub.setsockopt(zmq.LINGER, 500)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        try:
            self.endpoint = _bind_or_explain(self._pub, url)
            self.replay_endpoint = _bind_or_explain(self._replay, replay_url_for(url))
        except BaseException:
            self._pub.close(linger=0)
            self._replay.close(linger=0)
            self._ctx.term()
            raise
        self._queue: collections.deque[list] = collections.deque()
        self._ring: collections.deque[tuple[int, bytes]] = collections.deque()
        self._ring_bytes = 0
        self._cond = threading.Condition()
        self._closing = False
        self.seq = 0                 # the next batch's sequence number
        self.subscriptions = 0
        self.replays = 0
        # the sender wakes on a queued batch through this inproc pair, so it can also poll the sockets
        self._wake_addr = f"inproc://kv-events-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.connect(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kv-events-sender", daemon=True)
        self._thread.start()

    def publish(self, events: list) -> bool:
        """Queue events (split into batches of at most MAX_EVENTS_PER_BATCH); waits while the queue is
        full. False once closed."""
        if not events:
            return True
        with self._cond:
            for start in range(0, len(events), MAX_EVENTS_PER_BATCH):
                while len(self._queue) >= QUEUE_BATCHES and not self._closing:
                    self._cond.wait(0.5)
                if self._closing:
                    return False
                self._queue.append(events[start:start + MAX_EVENTS_PER_BATCH])
                self._wake()
        return True

    def _wake(self) -> None:
        with self._wake_lock:
            if not self._wake_tx.closed:
                try:
                    self._wake_tx.send(b"", zmq.NOBLOCK)
                except zmq.Again:
                    pass    # a wake-up is already waiting

    def close(self, final_events: list | None = None) -> None:
        """Send what is queued (and final_events), then close; returns within about a second."""
        if final_events:
            self.publish(final_events)
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._wake()
        self._thread.join(timeout=5)
        with self._wake_lock:
            self._wake_tx.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (self._wake_rx, self._pub, self._replay):
            poller.register(sock, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(1000))
                if self._wake_rx in ready:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                if self._pub in ready:
                    self._read_subscriptions()
                if self._replay in ready:
                    self._answer_replay()
                closing = self._send_queued()
                if closing:
                    return
        finally:
            self._pub.close()           # LINGER lets what was just sent reach connected subscribers
            self._replay.close(linger=0)
            self._wake_rx.close(linger=0)

    def _send_queued(self) -> bool:
        while True:
            with self._cond:      # numbered and kept under the lock: seq and the replay ring stay in step
                if not self._queue:
                    return self._closing
                events = self._queue.popleft()
                self._cond.notify_all()
                payload = wire.encode_batch(events)
                seq = self.seq
                self.seq += 1
                self._keep_for_replay(seq, payload)
            self._pub.send_multipart((self._topic, wire.seq_frame(seq), payload))

    def _keep_for_replay(self, seq: int, payload: bytes) -> None:
        self._ring.append((seq, payload))
        self._ring_bytes += len(payload)
        while len(self._ring) > REPLAY_BATCHES or (self._ring_bytes > REPLAY_BYTES and len(self._ring) > 1):
            self._ring_bytes -= len(self._ring.popleft()[1])

    def _read_subscriptions(self) -> None:
        while self._pub.poll(0):
            message = self._pub.recv()
            if message[:1] == b"\x01":
                self.subscriptions += 1
                if self.on_subscribe is not None:
                    self.on_subscribe()

    def _answer_replay(self) -> None:
        """vLLM's replay: [identity, b"", start_seq] in; every kept batch from start_seq as
        [identity, b"", topic, seq, batch], then [identity, b"", b"", END_SEQ, b""]."""
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != wire.SEQ_BYTES:
                log.warning("KV events: a replay request of %d frames ignored (expected identity, empty, "
                            "8-byte start seq)", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            self.replays += 1
            with self._cond:
                kept = list(self._ring)
            for seq, payload in kept:
                if seq >= start:
                    self._replay.send_multipart((identity, b"", self._topic, wire.seq_frame(seq), payload))
            self._replay.send_multipart((identity, b"", b"", wire.END_SEQ, b""))
