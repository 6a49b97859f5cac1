"""CacheServer: the ZMQ ROUTER loop that routes each request to the handler a module registered.

Place in the flow: engines' CacheClients (DEALER) -> **this loop** -> handlers of the composed
modules (kvbridge.cache_server.module) -> the ServerStore (L1 pool in shared memory, L2 below).

Who gets in is settled before the loop sees a byte: the ROUTER runs CURVE with this server's key
pair, and its ZAP handler admits only clients whose key comes from the server's token
(kvbridge.cache_server.curve); the public key (never the secret one) and the token are written to
owner-only files beside each other after the bind. How many connections it holds and how long one
may take to authenticate: kvbridge.cache_server.door. What a SIGKILLed predecessor on the address
left is removed at start (kvbridge.cache_server.leftovers). A message is read frame by frame and one over MAX_REQUEST_FRAMES frames
or KVB_CACHE_SERVER_MAX_MESSAGE_BYTES is dropped as it is read, answered "too large".

The loop itself knows only the envelope: it decodes it, checks the hello (protocol version and the
shared secret, again), touches the caller's instance id on every liveness target, and hands the call to a
worker: requests whose handler needs client affinity (store, retrieve, release and affinity
server-module calls) run on the caller's affinity thread, in the order they arrived; the rest run
on a small shared pool. Workers send replies back through an inproc socket the loop drains, since
a ZMQ socket belongs to one thread. Handlers registered as fast (lookup, store prepare and commit,
release, ping) run on the loop thread itself when nothing of the caller's is queued, which saves two
thread switches per request. The loop blocks in poll (no busy waiting).

Bad input never stops the server: an envelope that does not decode, an unknown kind, a body of the
wrong shape, an oversized message, a lease of another client: each is a logged, counted error reply.
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import os
import signal
import socket
import stat
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import zmq

from kvbridge.cache_server import protocol
from kvbridge.cache_server.auth import REFUSED_TOKEN, check_bind_url, new_token, read_token, write_token_file
from kvbridge.cache_server.curve import ZapGate, apply_server, client_key_pair, server_keys, write_key_file
from kvbridge.cache_server.door import ConnectionCap, apply_handshake_interval, check_door_settings
from kvbridge.cache_server.leftovers import forget_server_files
from kvbridge.cache_server.shm import remove_stale_segments
from kvbridge.cache_server.calls import Answer, Call, ClientInfo, RequestFailed
from kvbridge.cache_server.clients import ClientTable
from kvbridge.cache_server.context import ServerContext
from kvbridge.cache_server.module import ComposedModules, ModuleSpec, compose
from kvbridge.cache_server.protocol import Code, Kind
from kvbridge.errors import BadSettings
from kvbridge.settings import Settings

log = logging.getLogger("kvbridge.cache_server")

IDLE_POLL_MS = 1000   # a backstop only: requests, replies, stop() and signals all wake the poll at once
AFFINITY_THREADS = 4
WORKER_THREADS = 4
_REPLY_ENDPOINT = "inproc://kvb-replies-{}"


class CacheServer:
    """Build with the settings and module specs; `serve_forever()` until `stop()` (or a signal)."""

    def __init__(self, settings: Settings, url: str | None = None, module_specs: list[ModuleSpec] = (),
                 metrics_port: int | None = None, token: str | None = None, segment_dir: str | None = None) -> None:
        from kvbridge.cache_server.server_store import ServerStore
        from kvbridge.cache_server.metrics import ServerMetrics

        self.settings = settings
        self.url = url or settings.cache_server_url
        check_bind_url(self.url, encrypted=True)
        check_door_settings(settings)
        configured = read_token(settings) if token is None else token
        self.token = configured or new_token()   # generated: written to the owner's token file at bind
        self._token_generated = not configured
        self.token_path: Path | None = None   # the generated token's file (owner-only), removed at close
        self.keys = server_keys(settings)       # CURVE: what clients authenticate this server by
        self.key_path: Path | None = None     # the public key's file (owner-only), removed at close
        self._zap: ZapGate | None = None
        self.server_id = uuid.uuid4().hex
        self.clients = ClientTable()
        self.metrics = ServerMetrics()
        left = forget_server_files(self.url)   # a SIGKILLed predecessor's files and segment, found by the address
        if left:
            log.info("removed what a cache server killed at %s left: %s", self.url, ", ".join(str(p) for p in left))
        removed = remove_stale_segments(segment_dir)
        if removed:
            log.info("removed %d shared-memory segment(s) left by cache servers that died: %s", len(removed),
                     ", ".join(str(p) for p in removed))
        self.store = ServerStore(settings, segment_dir=segment_dir)
        port = settings.cache_server_metrics_port if metrics_port is None else metrics_port
        self.context = ServerContext(settings=settings, store=self.store, metrics=self.metrics, clients=self.clients,
                                     server_id=self.server_id, url=self.url, metrics_port=port)
        self.ctx = zmq.Context()
        try:
            self.modules: ComposedModules = compose(list(module_specs), self.context)
        except BaseException:
            self.store.close(flush=False)
            self.ctx.destroy(linger=0)   # also closes the workers' reply sockets
            raise
        self.context.modules = self.modules
        self._router = self.ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, 2 * settings.cache_server_max_message_bytes + (1 << 20))
        apply_server(self._router, self.keys)
        apply_handshake_interval(self._router, settings)
        self._door = ConnectionCap(self._router, settings.cache_server_max_connections)
        self._replies_url = _REPLY_ENDPOINT.format(self.server_id)
        self._replies = self.ctx.socket(zmq.PULL)
        self._replies.bind(self._replies_url)
        self._stop = threading.Event()
        self._wake = self.ctx.socket(zmq.PAIR)
        self._wake.bind(f"inproc://kvb-wake-{self.server_id}")
        self._local = threading.local()
        self._lanes_lock = threading.Lock()
        self._lane_load = [0] * AFFINITY_THREADS   # requests queued or running on each affinity thread
        self._workers = ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="kvb-cs-worker")
        self._affinity = [ThreadPoolExecutor(1, thread_name_prefix=f"kvb-cs-affinity{i}") for i in range(AFFINITY_THREADS)]
        self._bound = False
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------
    def bind(self) -> str:
        """Start the ZAP handler, bind the ROUTER (ipc sockets mode 0600), write the token and key files,
        then let modules register their own services."""
        if self._bound:
            return self.url
        if self._zap is None:   # before the bind: a handshake with no handler would admit any CURVE client
            self._zap = ZapGate(self.ctx, {client_key_pair(self.token).public})
        try:
            if self.url.startswith("ipc://"):
                path = Path(self.url[len("ipc://"):])
                old = os.umask(0o177)
                try:
                    self._router.bind(self.url)
                finally:
                    os.umask(old)
                os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
            else:
                self._router.bind(self.url)
        except zmq.ZMQError as exc:
            raise BadSettings(f"the cache server cannot listen on {self.url}: {exc} (another cache server there? "
                              "choose another address with --url, --host/--port or KVB_CACHE_SERVER_URL)") from None
        self._bound = True
        self._door.watch()
        # after the bind, so a second server refused the address never overwrites the first one's files
        if self._token_generated:   # nothing configured: a token only this OS user can read
            self.token_path = write_token_file(self.url, self.token)
        self.key_path = write_key_file(self.url, self.keys, segment=str(self.store.segment.path))
        self.modules.register_zmq_services(self)
        log.info("cache server %s listening on %s (L1 %s, tiers %s)", self.server_id[:8], self.url,
                 self.store.segment.path, ", ".join(self.store.tier_names))
        log.info("CURVE public key %s (in %s; clients that cannot read that file set "
                 "KVB_CACHE_SERVER_PUBLIC_KEY to it)", self.keys.public, self.key_path)
        return self.url

    def serve_forever(self) -> None:
        self.bind()
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        poller.register(self._door.socket, zmq.POLLIN)
        wake = self.ctx.socket(zmq.PAIR)
        wake.connect(f"inproc://kvb-wake-{self.server_id}")
        poller.register(wake, zmq.POLLIN)
        # A signal the OS hands to another thread does not interrupt this poll; Python's wakeup fd
        # does (its C handler writes a byte), and the handler itself then runs here and calls stop().
        signal_r = signal_w = None
        previous_fd = None
        if threading.current_thread() is threading.main_thread():
            signal_r, signal_w = socket.socketpair()
            signal_r.setblocking(False)
            signal_w.setblocking(False)
            previous_fd = signal.set_wakeup_fd(signal_w.fileno(), warn_on_full_buffer=False)
            poller.register(signal_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(IDLE_POLL_MS))
                if signal_r is not None and signal_r.fileno() in events:
                    with contextlib.suppress(BlockingIOError):
                        signal_r.recv(4096)
                if self._replies in events:
                    self._drain_replies()
                if self._door.socket in events:
                    self._door.drain()
                if self._router in events:
                    self._receive_requests()
        finally:
            poller.unregister(wake)
            wake.close(0)
            if signal_r is not None:
                signal.set_wakeup_fd(previous_fd)
                signal_r.close()
                signal_w.close()

    def stop(self) -> None:
        """Ask serve_forever to return (safe from a signal handler or another thread)."""
        self._stop.set()
        try:
            self._wake.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        """Modules closed in reverse order, L1 flushed to L2, shared memory released. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for pool in [self._workers, *self._affinity]:
            pool.shutdown(wait=True, cancel_futures=True)
        self.modules.close()
        self.store.close(flush=True)
        for path in (self.token_path, self.key_path):
            if path is not None:
                path.unlink(missing_ok=True)
        if self._zap is not None:
            self._zap.close()
        self._door.close()
        self._router.close(0)
        self._replies.close(0)
        self._wake.close(0)
        self.ctx.destroy(linger=0)   # also closes the workers' reply sockets

    # -- the loop --------------------------------------------------------------------------------
    def _receive_requests(self) -> None:
        while True:
            try:
                identity = self._router.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._accept(identity, *self._read_parts(identity))

    def _read_parts(self, identity) -> tuple[list, str]:
        """The message's frames after the identity, read one at a time: past MAX_REQUEST_FRAMES frames or the
        byte limit the rest are read and dropped, so one message never holds more than the limit here
        (libzmq hands a message over only once complete: its peer passed the CURVE handshake)."""
        limit = self.settings.cache_server_max_message_bytes
        parts: list = []
        size = 0
        overflow = ""
        more = identity.more
        while more:
            frame = self._router.recv(copy=False)
            more = frame.more
            if not overflow and len(parts) >= protocol.MAX_REQUEST_FRAMES:
                overflow = (f"a message of more than {protocol.MAX_REQUEST_FRAMES} frames (a request is an envelope "
                            "and a few data frames)")
            elif not overflow and size + len(frame) > limit:
                overflow = (f"a message of more than {limit} bytes exceeds KVB_CACHE_SERVER_MAX_MESSAGE_BYTES "
                            f"({limit})")
            if overflow:
                continue
            parts.append(frame)
            size += len(frame)
        return parts, overflow

    def _drain_replies(self) -> None:
        while True:
            try:
                frames = self._replies.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._router.send_multipart(frames, copy=False)
            except zmq.ZMQError as exc:   # the client went away: nothing to deliver to
                log.debug("reply not delivered: %s", exc)

    def _accept(self, identity, parts: list, overflow: str = "") -> None:
        if not parts:
            return self._refuse(identity, 0, Code.TOO_LARGE if overflow else Code.BAD_REQUEST,
                                overflow or "empty message")
        try:
            envelope = protocol.decode_envelope(parts[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self._refuse(identity, 0, Code.BAD_REQUEST, f"malformed request: {exc}")
        rid = envelope.request_id
        if overflow:
            return self._refuse(identity, rid, Code.TOO_LARGE, f"{overflow}: dropped as it was read")
        try:
            body = protocol.decode_body(envelope.kind, envelope.body)
        except KeyError:
            return self._refuse(identity, rid, Code.UNKNOWN_KIND, f"unknown request type {envelope.kind!r}")
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self._refuse(identity, rid, Code.BAD_REQUEST, f"malformed {envelope.kind} request: {exc}")
        if envelope.kind == Kind.HELLO:
            return self._reply(identity, rid, self._hello(envelope.instance_id, body, identity.bytes))
        client = self.clients.get(envelope.instance_id)
        if client is None:
            return self._refuse(identity, rid, Code.HELLO_REQUIRED,
                                "this server does not know the client (restarted, or the client was reaped); say hello")
        if not hmac.compare_digest(client.connection, identity.bytes):
            # identity is the connection that authenticated, not the id a request carries: another
            # connection naming this client (to release its leases, say) must say hello with the token
            return self._refuse(identity, rid, Code.HELLO_REQUIRED,
                                "this connection has not said hello as that client; say hello")
        self.clients.touch(envelope.instance_id)
        self.modules.touch(envelope.instance_id)
        call = Call(envelope.instance_id, envelope.kind, body, client, [f.buffer for f in parts[1:]])
        handler, failure = self._handler_for(call)
        if handler is None:
            return self._refuse(identity, rid, *failure)
        lane = hash(call.instance_id) % AFFINITY_THREADS if handler.affinity else None
        with self._lanes_lock:
            # A fast handler runs right here when nothing of the caller's lane is queued or running, so
            # the order of that client's requests holds; everything else goes to a worker thread.
            inline = handler.fast and (lane is None or not self._lane_load[lane])
            if not inline and lane is not None:
                self._lane_load[lane] += 1
        if inline:
            self._router.send_multipart([identity, *self._answer(rid, handler, call)], copy=False)
            return
        executor = self._affinity[lane] if lane is not None else self._workers
        executor.submit(self._run, identity, rid, handler, call, lane)

    def _handler_for(self, call: Call):
        router = self.modules.router
        if call.kind in (Kind.SERVER_MODULE_CALL, Kind.SERVER_MODULE_AFFINITY_CALL):
            handler = router.method(call.body.method)
            if handler is None:
                return None, (Code.BAD_REQUEST, f"unknown server module method: {call.body.method}")
            wants_affinity = call.kind == Kind.SERVER_MODULE_AFFINITY_CALL
            if handler.affinity != wants_affinity:
                right = "server_module_affinity_call" if handler.affinity else "server_module_call"
                return None, (Code.BAD_REQUEST, f"server module method {call.body.method} must be called with {right}")
            return handler, None
        handler = router.core(call.kind)
        if handler is None:
            return None, (Code.UNKNOWN_KIND, f"no module handles {call.kind!r} requests on this server")
        return handler, None

    def _run(self, identity, rid: int, handler, call: Call, lane: int | None) -> None:
        try:
            frames = self._answer(rid, handler, call)
        finally:
            if lane is not None:
                with self._lanes_lock:
                    self._lane_load[lane] -= 1
        self._send_from_worker([identity, *frames])

    def _answer(self, rid: int, handler, call: Call) -> list:
        """The reply frames for one call: the handler's answer, its refusal, or an internal error."""
        started = time.perf_counter()
        try:
            if call.kind in (Kind.SERVER_MODULE_CALL, Kind.SERVER_MODULE_AFFINITY_CALL):
                answer = Answer(self._module_call(handler, call))
            else:
                answer = handler.fn(call)
            reply = protocol.encode_reply(rid, answer.body)
            data = answer.data
        except RequestFailed as failed:
            self.metrics.count_error(failed.code)
            log.info("request %s from %s refused: %s", call.kind, call.instance_id[:8], failed.message)
            reply, data = protocol.encode_reply(rid, error=failed.message, code=failed.code), ()
        except Exception as exc:   # a handler bug: logged, counted, answered; the server keeps serving
            log.exception("handler for %s failed", call.kind)
            self.metrics.count_error(Code.INTERNAL)
            reply, data = protocol.encode_reply(rid, error=f"internal error in {handler.owner or 'server'}: {exc}",
                                                code=Code.INTERNAL), ()
        self.metrics.observe_request(call.kind, time.perf_counter() - started)
        return [reply, *data]

    def _module_call(self, handler, call: Call) -> protocol.ServerModuleCallResponse:
        try:
            payload = handler.fn(call.body.payload)
        except Exception as exc:   # the plugin's failure is the caller's answer, not the server's
            log.warning("server module method %s failed: %s", call.body.method, exc)
            self.metrics.count_error("module_call_failed")
            return protocol.ServerModuleCallResponse(False, b"", f"{call.body.method} failed: {exc}")
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            return protocol.ServerModuleCallResponse(False, b"", f"{call.body.method} returned "
                                                     f"{type(payload).__name__}, not bytes")
        return protocol.ServerModuleCallResponse(True, bytes(payload), "")

    def _send_from_worker(self, frames: list) -> None:
        sock = getattr(self._local, "push", None)
        if sock is None:
            sock = self._local.push = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._replies_url)
        sock.send_multipart(frames, copy=False)

    def _reply(self, identity, rid: int, answer: Answer | tuple) -> None:
        if isinstance(answer, tuple):
            return self._refuse(identity, rid, *answer)
        self._router.send_multipart([identity, protocol.encode_reply(rid, answer.body), *answer.data], copy=False)

    def _refuse(self, identity, rid: int, code: str, message: str) -> None:
        self.metrics.count_error(code)
        log.warning("refused a request (%s): %s", code, message)
        try:
            self._router.send_multipart([identity, protocol.encode_reply(rid, error=message, code=code)])
        except zmq.ZMQError:
            pass

    def _hello(self, instance_id: str, hello: protocol.Hello, connection: bytes) -> Answer | tuple:
        if hello.protocol_version != protocol.PROTOCOL_VERSION:
            return (Code.VERSION, f"protocol version mismatch: the client speaks version {hello.protocol_version}, "
                                  f"this server speaks version {protocol.PROTOCOL_VERSION}; use the same KVBridge "
                                  "release on both sides")
        if not hmac.compare_digest(hello.token.encode(), self.token.encode()):
            return (Code.UNAUTHORIZED, REFUSED_TOKEN)
        if not instance_id or not 0 <= hello.priority <= 9:
            return (Code.BAD_REQUEST, "hello needs an instance id and a priority from 0 to 9")
        info = ClientInfo(instance_id, hello.priority, hello.pid, hello.hostname, hello.label, time.time(), connection)
        self.clients.register(info)
        self.modules.touch(instance_id)
        log.info("client %s registered (pid %d on %s, priority %d, %s)", instance_id[:8], hello.pid,
                 hello.hostname or "?", hello.priority, hello.label or "no label")
        shm_ok = self.settings.cache_server_shm
        timeout = self.settings.cache_server_reap_timeout
        return Answer(protocol.HelloReply(
            protocol_version=protocol.PROTOCOL_VERSION, server_id=self.server_id, tier_names=self.store.tier_names,
            heartbeat_s=timeout / 4 if timeout else 0.0, lease_timeout_s=self.settings.cache_server_lease_timeout,
            shm_path=str(self.store.segment.path) if shm_ok else "",
            shm_nonce=self.store.segment.nonce if shm_ok else b"",
            page_bytes=self.store.segment.page_bytes, modules=[m.module_name for m in self.modules.modules],
            frame_bytes=protocol.INLINE_FRAME_BYTES))

