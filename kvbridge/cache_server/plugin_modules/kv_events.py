"""KvEventsModule: what the store does, as it happens, on a ZMQ PUB socket of the module's own (opt-in).

Place in the flow: the ServerStore changes an object (stored in L1 or L2, evicted from L1, removed
by a clear) -> its listener here numbers the event and puts it on a bounded queue -> this module's
publisher thread, the only user of the PUB socket, publishes it as a two-frame message
[b"kv." + event, msgpack map] and keeps the last `history` events for the `kv_events.recent`
envelope call (the GUI's event log reads that).

Never in the store's way: the listener runs on the thread that changed the store (an eviction runs
under the pool's lock), so it only queues; a full queue drops the event and counts it. Every event
the store reports gets the next seq, published or not, so a subscriber that sees a gap in seq knows
it missed events (a full queue here, or ZMQ's high-water mark for a slow reader).

    python -m kvbridge cache-server --server-module \\
        '{"module_path": "kvbridge.cache_server.plugin_modules.kv_events", "config": {"url": "tcp://127.0.0.1:5557"}}'

Config: url (default tcp://127.0.0.1:0, a free port; `kv_events.info` says which one), history
(events kept for `kv_events.recent`, default 200). Deliberately left out: replay beyond the history,
and subscriber authentication (events carry key hashes and sizes, never KV bytes; a url beyond
loopback is honoured, with a warning that anyone who can reach it can read the stream).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Annotated

import msgspec
import zmq

from kvbridge.cache_server.auth import check_bind_url
from kvbridge.cache_server.module import (DiscoverableModule, ModuleBuildContext, ModuleStartupError,
                                          server_module_handler)
from kvbridge.cache_server.modules.storage import StorageModule
from kvbridge.errors import BadSettings

log = logging.getLogger("kvbridge.cache_server")

FORMAT_VERSION = 1
TOPIC_PREFIX = b"kv."
EVENT_NAMES = ("stored", "evicted", "removed")   # what ServerStore reports
TOPICS = [(TOPIC_PREFIX + name.encode()).decode() for name in EVENT_NAMES]
FORMAT = ("two frames: topic (kv.stored, kv.evicted or kv.removed), then a msgpack map {event, key (hex), "
          "tier, size (bytes), time (unix seconds), seq}; seq counts every store event since the server "
          "started, so a gap means missed events. Subscribe to b'kv.' for all of them.")
DEFAULT_URL = "tcp://127.0.0.1:0"
DEFAULT_HISTORY = 200
QUEUE_CAPACITY = 10_000    # events waiting for the publisher; beyond that they are dropped and counted
CONFIG_KEYS = ("url", "history")
_STOP = object()           # the publisher's last queue item


class KvEvent(msgspec.Struct):
    """One store event, as published (a msgpack map) and as `kv_events.recent` returns it."""

    event: str       # stored | evicted | removed
    key: str         # the object's key (its chunk hash), hex
    tier: str        # L1, L2, ...
    size: int        # bytes
    time: float      # unix seconds, when the store reported it
    seq: int         # 1, 2, 3, ... since the server started


class RecentRequest(msgspec.Struct, forbid_unknown_fields=True):
    """`kv_events.recent` payload (empty payload: everything kept)."""

    since_seq: int = 0                                          # only events after this one
    limit: Annotated[int, msgspec.Meta(ge=0)] | None = None     # at most this many, the newest


class RecentReply(msgspec.Struct):
    events: list[KvEvent]     # oldest first
    last_seq: int             # the newest seq handed out (published or dropped)
    dropped: int


class InfoReply(msgspec.Struct):
    endpoint: str             # connect a SUB socket here
    topics: list[str]
    format: str
    format_version: int = FORMAT_VERSION


_encoder = msgspec.msgpack.Encoder()


class KvEventsModule(DiscoverableModule):
    module_name = "kv_events"
    dependencies = (StorageModule,)   # the store's objects are the storage module's; start after it, close before

    def __init__(self, context, url: str = DEFAULT_URL, history: int = DEFAULT_HISTORY) -> None:
        super().__init__(context)
        self.url = url
        self.endpoint = ""            # the real one, once bound (port 0 becomes a free port)
        self.published = 0
        self.dropped = 0
        self.send_errors = 0
        self._seq = 0
        self._lock = threading.Lock()   # seq, counters, history; never held while calling the store
        self._queue: queue.Queue = queue.Queue(QUEUE_CAPACITY)
        self._recent: deque[KvEvent] = deque(maxlen=history)
        self._accepting = True
        self._socket = None
        self._publisher: threading.Thread | None = None
        context.store.add_listener(self._on_store_event)

    @classmethod
    def create(cls, build_ctx: ModuleBuildContext) -> "KvEventsModule":
        config = build_ctx.config_for(cls)
        unknown = sorted(set(config) - set(CONFIG_KEYS))
        if unknown:
            raise ModuleStartupError(f"kv_events: unknown config key(s) {', '.join(map(repr, unknown))}; "
                                     f"it takes {' and '.join(CONFIG_KEYS)}")
        url = config.get("url", DEFAULT_URL)
        if not isinstance(url, str) or not url.startswith(("tcp://", "ipc://")):
            raise ModuleStartupError(f"kv_events: url must be tcp://HOST:PORT or ipc:///path, got {url!r}")
        history = config.get("history", DEFAULT_HISTORY)
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ModuleStartupError(f"kv_events: history must be a whole number of events, at least 1; got {history!r}")
        try:
            check_bind_url(url, token="")
        except BadSettings:
            log.warning("kv_events publishes on %s, beyond this machine: anyone who can reach it reads which "
                        "objects are stored and evicted (the stream has no token)", url)
        return cls(build_ctx.server_context, url, history)

    # -- the store's side: number and queue, nothing more ----------------------------------------
    def _on_store_event(self, event: str, key: bytes, tier: str, size: int) -> None:
        now = time.time()
        with self._lock:   # seq order is queue order
            if not self._accepting:
                return
            self._seq += 1
            try:
                self._queue.put_nowait(KvEvent(event, bytes(key).hex(), tier, int(size), now, self._seq))
            except queue.Full:
                self.dropped += 1

    # -- the publisher: the only thread that touches the PUB socket ------------------------------
    def register_zmq_services(self, server) -> None:
        sock = server.ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.url)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise ModuleStartupError(f"kv_events cannot publish on {self.url}: {exc}; give another url in its "
                                     "config (tcp://127.0.0.1:0 picks a free port)") from None
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._socket = sock
        self._publisher = threading.Thread(target=self._publish_loop, name="kvb-cs-kv-events", daemon=True)
        self._publisher.start()
        log.info("kv_events publishing on %s (topics %s)", self.endpoint, ", ".join(TOPICS))

    def _publish_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                # a PUB socket never blocks: a subscriber past its high-water mark loses messages (seq shows it)
                self._socket.send_multipart([TOPIC_PREFIX + item.event.encode(), _encoder.encode(item)])
                sent = True
            except zmq.ZMQError as exc:
                log.warning("kv_events: event %d not published: %s", item.seq, exc)
                sent = False
            with self._lock:
                self._recent.append(item)   # the history is what the store did, published or not
                if sent:
                    self.published += 1
                else:
                    self.send_errors += 1

    # -- envelope methods ------------------------------------------------------------------------
    @server_module_handler("kv_events.info")
    def info(self, payload: bytes) -> bytes:
        """Where to subscribe, and what the messages look like."""
        return _encoder.encode(InfoReply(self.endpoint, list(TOPICS), FORMAT))

    @server_module_handler("kv_events.recent")
    def recent(self, payload: bytes) -> bytes:
        """The kept events after `since_seq` (at most `limit`, the newest), oldest first."""
        request = msgspec.msgpack.decode(payload, type=RecentRequest) if payload else RecentRequest()
        with self._lock:
            events = [event for event in self._recent if event.seq > request.since_seq]
            last_seq, dropped = self._seq, self.dropped
        if request.limit is not None:
            events = events[-request.limit:] if request.limit else []
        return _encoder.encode(RecentReply(events, last_seq, dropped))

    # -- module contract -------------------------------------------------------------------------
    def report_status(self) -> dict:
        with self._lock:
            return {"endpoint": self.endpoint, "topics": list(TOPICS), "published": self.published,
                    "dropped": self.dropped, "send_errors": self.send_errors, "last_seq": self._seq,
                    "queued": self._queue.qsize(), "history": self._recent.maxlen,
                    "publishing": bool(self._publisher and self._publisher.is_alive())}

    def quiesce(self) -> None:
        """Stop taking events, publish what is queued, stop the publisher."""
        with self._lock:
            self._accepting = False
        self.context.store.remove_listener(self._on_store_event)
        if self._publisher is not None and self._publisher.is_alive():
            try:
                self._queue.put(_STOP, timeout=5)   # behind every queued event: they are published first
            except queue.Full:
                log.warning("kv_events: publisher not draining its queue; stopping without it")
            self._publisher.join(timeout=5)
            if self._publisher.is_alive():
                log.warning("kv_events: publisher thread did not stop within 5 s")

    def close(self) -> None:
        self.quiesce()
        if self._socket is not None:
            self._socket.close(0)   # the server's zmq.Context cannot terminate while this is open
            self._socket = None
