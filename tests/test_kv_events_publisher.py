"""KV events (issue 34): the publisher and block view on real ZMQ sockets, and the real vllm-router
binary routing by them.

The scheduler here is a stand-in (`StandInScheduler`: `unsalted_hashes` and `stored_media` over a dict),
only for the view's unit tests: the real scheduler's listener calls are tested end to end with serve.
The router test's workers are stand-ins too (tiny loopback HTTP servers answering /health, the render
endpoint with fixed token ids, and the chat request, which they record): the router only needs those
to route, the real serve worker is tested through the fleet, and here what is proven is the wire format
against the real consumer: the router sends a request where our events say its prefix is.
(tests/test_kv_events.py is the cache server's kv_events module, a different stream.)
"""
from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import requests
import zmq

from conftest import needs_model
from guest_account import guest, guest_result, needs_root, start_guest_subscriber  # noqa: F401 (guest: a fixture)
from kvbridge.kv_events import BlockView, KVEventPublisher, KVEvents, KVEventsUrlError, start_kv_events, wire

pytestmark = pytest.mark.timeout(120)
CS = 4          # chunk size of the unit tests
WAIT_S = 10.0
ROUTER = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "vllm-router"


class StandInScheduler:
    """The two scheduler calls the view makes, over a dict standing for the store."""

    def __init__(self, chunk_size: int = CS):
        self.chunk_size = chunk_size
        self.store: dict[bytes, str] = {}
        self.listeners = []

    def unsalted_hashes(self, tokens) -> list[bytes]:
        out, prev = [], b""
        for i in range(len(tokens) // self.chunk_size):
            chunk = tokens[i * self.chunk_size:(i + 1) * self.chunk_size]
            prev = hashlib.sha256(prev + b"".join(t.to_bytes(4, "little") for t in chunk)).digest()
            out.append(prev)
        return out

    def stored_media(self, hashes) -> list[str | None]:
        return [self.store.get(h) for h in hashes]

    def add_kv_listener(self, listener) -> None:
        self.listeners.append(listener)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """A real SUB socket; `until(pred)` reads messages until one batch makes pred true."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.messages: list[tuple[bytes, int, bytes]] = []

    def batches(self) -> list[list]:
        return [wire.decode_batch(payload)[1] for _, _, payload in self.messages]

    def events(self) -> list:
        return [event for batch in self.batches() for event in batch]

    def until(self, pred, what: str) -> list:
        deadline = time.monotonic() + WAIT_S
        while not pred(self.events()):
            assert time.monotonic() < deadline, f"{what}; got {self.events()}"
            if self.sock.poll(100):
                topic, seq, payload = self.sock.recv_multipart()
                self.messages.append((topic, wire.read_seq(seq), payload))
        return self.events()

    def drain(self, seconds: float) -> None:
        """Read whatever arrives for `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                topic, seq, payload = self.sock.recv_multipart()
                self.messages.append((topic, wire.read_seq(seq), payload))

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def view_and_sub():
    scheduler = StandInScheduler()
    publisher = KVEventPublisher("tcp://127.0.0.1:0")
    view = BlockView(scheduler, publisher.publish, chunk_size=CS, check_s=0.2, resync_interval_s=0.2)
    publisher.on_subscribe = view.request_resync
    sub = Subscriber(publisher.endpoint)
    sub.until(lambda evs: any(isinstance(e, wire.AllBlocksCleared) for e in evs), "a subscriber is told to clear")
    yield scheduler, view, publisher, sub
    view.close()
    publisher.close()
    sub.close()


def stored_claims(events) -> dict[tuple[int, str], None]:
    """(block, medium) claims after applying the events in order, as a consumer would."""
    claims: dict[tuple[int, str], None] = {}
    for e in events:
        if isinstance(e, wire.AllBlocksCleared):
            claims.clear()
        elif isinstance(e, wire.BlockStored):
            claims.update(dict.fromkeys((h, e.medium) for h in e.block_hashes))
        else:
            for h in e.block_hashes:
                claims.pop((h, e.medium), None)
    return claims


def test_a_sub_socket_decodes_vllm_frames(view_and_sub):
    scheduler, view, _, sub = view_and_sub
    tokens = tuple(range(100, 100 + 8 * CS + 3))       # 8 whole chunks and a tail the view leaves out
    view.resident([tokens, tokens[:3 * CS + 1]])
    events = sub.until(lambda evs: len(stored_claims(evs)) == 8, "8 blocks claimed")
    topics = {topic for topic, _, _ in sub.messages}
    seqs = [seq for _, seq, _ in sub.messages]
    assert topics == {b""} and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    ids = [wire.block_id(h) for h in scheduler.unsalted_hashes(list(tokens))]
    assert any(i >= 1 << 63 for i in ids), "a hash with the top bit set shows they travel unsigned"
    raw = msgspec.msgpack.decode(sub.messages[-1][2])
    assert isinstance(raw[0], float) and raw[2] is None
    stored = raw[1][0]
    assert list(stored) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                            "medium", "lora_name"]
    assert stored["type"] == "BlockStored" and stored["block_size"] == CS and stored["medium"] == "GPU"
    assert stored["block_hashes"] == ids and stored["parent_block_hash"] is None
    assert stored["token_ids"] == list(tokens[:8 * CS])
    seen: set[int] = set()
    for e in events:                                      # every parent announced before its child
        if isinstance(e, wire.BlockStored):
            assert e.parent_block_hash is None or e.parent_block_hash in seen
            seen.update(e.block_hashes)


def test_store_media_removals_and_a_late_subscriber(view_and_sub):
    scheduler, view, publisher, sub = view_and_sub
    tokens = tuple(range(4 * CS))
    hashes = scheduler.unsalted_hashes(list(tokens))
    ids = [wire.block_id(h) for h in hashes]
    view.resident([tokens])
    for h in hashes[:3]:
        scheduler.store[h] = "CPU"
    view.stored(tokens, 3)
    want = {**{(i, "GPU"): None for i in ids}, **{(i, "CPU"): None for i in ids[:3]}}
    sub.until(lambda evs: stored_claims(evs) == want, "GPU for 4 blocks, CPU for the 3 stored")

    view.resident([])                                     # evicted from the context: the store's copy stays
    sub.until(lambda evs: stored_claims(evs) == {(i, "CPU"): None for i in ids[:3]}, "only the CPU claims left")
    scheduler.store[hashes[2]] = "DISK"                   # L1 evicted to L2: the recheck moves the claim
    sub.until(lambda evs: stored_claims(evs) == {(ids[0], "CPU"): None, (ids[1], "CPU"): None, (ids[2], "DISK"): None},
              "block 3 moved to DISK")

    late = Subscriber(publisher.endpoint)                 # a late joiner is told everything that holds now
    try:
        late_events = late.until(lambda evs: len(stored_claims(evs)) == 3, "a late subscriber learns the claims")
        assert isinstance(late_events[0], wire.AllBlocksCleared)
    finally:
        late.close()

    scheduler.store.clear()                               # the store lost them: no event but the recheck's
    sub.until(lambda evs: stored_claims(evs) == {}, "every claim removed by the recheck")
    assert view.snapshot()["blocks"] == 0


def test_the_view_holds_at_most_max_blocks():
    scheduler = StandInScheduler()
    published: list = []
    view = BlockView(scheduler, published.extend, chunk_size=CS, check_s=60, max_blocks=4)
    try:
        for start, claims in ((0, 3), (1000, 4)):
            tokens = tuple(range(start, start + 3 * CS))
            for h in scheduler.unsalted_hashes(list(tokens)):
                scheduler.store[h] = "CPU"
            view.stored(tokens, 3)
            deadline = time.monotonic() + WAIT_S
            while len(stored_claims(published)) != claims or view.snapshot()["blocks"] != claims:
                assert time.monotonic() < deadline, published
                time.sleep(0.05)
        removed = [h for e in published if isinstance(e, wire.BlockRemoved) for h in e.block_hashes]
        assert len(removed) == 2      # the two oldest, told to consumers
    finally:
        view.close()


def test_replay_answers_from_a_sequence_number():
    publisher = KVEventPublisher("tcp://127.0.0.1:0")
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        for n in range(3):
            publisher.publish([wire.BlockRemoved([n], "CPU")])
        dealer.connect(publisher.replay_endpoint)
        deadline = time.monotonic() + WAIT_S
        while publisher.seq < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        frames = []
        while True:
            assert dealer.poll(int(WAIT_S * 1000)), frames
            frames.append(dealer.recv_multipart())
            if frames[-1][-2] == wire.END_SEQ:
                break
        answered = [(wire.read_seq(f[2]), wire.decode_batch(f[3])[1]) for f in frames[:-1]]
        assert [len(f) for f in frames[:-1]] == [4, 4]        # [b"", topic, seq, batch], as vLLM answers
        assert answered == [(1, [wire.BlockRemoved([1], "CPU")]), (2, [wire.BlockRemoved([2], "CPU")])]
    finally:
        dealer.close(linger=0)
        ctx.term()
        publisher.close()


def test_an_ipc_endpoint_is_mode_0600(tmp_path):
    path = tmp_path / "events.sock"
    publisher = KVEventPublisher(f"ipc://{path}")
    try:
        assert publisher.endpoint == f"ipc://{path}"
        for sock in (path, Path(f"{path}.replay")):
            assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        sub = Subscriber(publisher.endpoint)
        try:
            deadline = time.monotonic() + WAIT_S
            while publisher.subscriptions == 0:          # the XPUB saw the subscription: it is in place
                assert time.monotonic() < deadline
                time.sleep(0.02)
            publisher.publish([wire.AllBlocksCleared()])
            sub.until(lambda evs: len(evs) >= 1, "an event over ipc")
        finally:
            sub.close()
    finally:
        publisher.close()


def test_a_subscription_storm_costs_one_announcement_per_interval():
    """Every new subscription asks for AllBlocksCleared and every claim, which PUB sends to every subscriber
    (the router too): 60 subscriptions in about a second make at most a few announcements, not 60, and the
    last joiner still learns every claim."""
    scheduler = StandInScheduler()
    publisher = KVEventPublisher("tcp://127.0.0.1:0")
    view = BlockView(scheduler, publisher.publish, chunk_size=CS, check_s=60, resync_interval_s=2.0)
    publisher.on_subscribe = view.request_resync
    router = Subscriber(publisher.endpoint)            # the subscriber that was there first
    storm: list[Subscriber] = []
    try:
        tokens = tuple(range(500, 500 + 3 * CS))
        ids = {(wire.block_id(h), "GPU") for h in scheduler.unsalted_hashes(list(tokens))}
        view.resident([tokens])
        router.until(lambda evs: set(stored_claims(evs)) == ids, "the first subscriber learns the claims")
        time.sleep(2.1)                                # past the interval of the first announcement
        before = sum(isinstance(e, wire.AllBlocksCleared) for e in router.events())
        for _ in range(60):
            storm.append(Subscriber(publisher.endpoint))
            time.sleep(0.02)
        deadline = time.monotonic() + WAIT_S
        while publisher.subscriptions < 61:
            assert time.monotonic() < deadline, publisher.subscriptions
            time.sleep(0.05)
        late = storm[-1].until(lambda evs: set(stored_claims(evs)) == ids, "the last joiner learns every claim")
        assert isinstance(late[0], wire.AllBlocksCleared)
        router.drain(3.0)                              # anything still pending comes out within the interval
        announced = sum(isinstance(e, wire.AllBlocksCleared) for e in router.events()) - before
        assert 1 <= announced <= 3, f"{announced} re-announcements to the first subscriber for 60 subscriptions"
        assert set(stored_claims(router.events())) == ids
        assert view.snapshot()["resyncs"] <= 4
    finally:
        for sub in [router, *storm]:
            sub.close()
        view.close()
        publisher.close()


@needs_root
def test_another_os_account_gets_nothing_from_a_publisher_in_a_private_folder(guest):
    """The fleet's default: an ipc socket (0600) in a folder of mode 0700. The owner's subscriber gets the
    events; a second OS account, subscribing to the same endpoint and asking the replay socket for
    everything, gets nothing at all."""
    folder = Path(tempfile.mkdtemp(prefix="kvb-fleet-"))
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    publisher = KVEventPublisher(f"ipc://{folder}/worker-1.events")
    owner = Subscriber(publisher.endpoint)
    try:
        intruder = start_guest_subscriber(guest, [publisher.endpoint], seconds=4)
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:             # events flow the whole time the guest listens
            publisher.publish([wire.BlockStored([7], None, list(range(CS)), CS, medium="GPU")])
            time.sleep(0.1)
        got = guest_result(intruder)
        owner.until(lambda evs: len(evs) >= 10, "the owner's subscriber receives the events")
    finally:
        owner.close()
        publisher.close()
        shutil.rmtree(folder, ignore_errors=True)
    assert got["uid"] == guest[0].pw_uid
    assert got["stat"] == {publisher.endpoint: "PermissionError"}
    assert got["messages"] == 0 and got["replay_frames"] == 0, got


@pytest.mark.parametrize("url", ["tcp://0.0.0.0:5601", "tcp://10.1.2.3:5601", "tcp://example.com:5601",
                                 "udp://127.0.0.1:5601"])
def test_another_host_is_refused_naming_the_setting(url):
    with pytest.raises(KVEventsUrlError, match="KVB_KV_EVENTS_URL"):
        KVEventPublisher(url)


def test_a_taken_port_is_refused_naming_the_setting():
    """A fixed port another socket holds: a message for a person, not a ZMQ traceback (serve shows it as a bad setting)."""
    first = KVEventPublisher("tcp://127.0.0.1:0")
    try:
        with pytest.raises(KVEventsUrlError, match="KVB_KV_EVENTS_URL.*in use"):
            KVEventPublisher(first.endpoint)
    finally:
        first.close()


def test_start_kv_events_is_off_without_a_url_and_registers_the_view():
    scheduler = StandInScheduler()
    settings = SimpleNamespace(kv_events_url="", kv_events_check_s=1.0, chunk_size=CS)
    assert start_kv_events(settings, scheduler, "a") is None and scheduler.listeners == []
    settings.kv_events_url = "tcp://127.0.0.1:0"
    events = start_kv_events(settings, scheduler, "a")
    sub = Subscriber(events.endpoint)
    try:
        assert scheduler.listeners == [events.view] and events.endpoint.startswith("tcp://127.0.0.1:")
        sub.until(lambda evs: isinstance(evs[-1:] and evs[-1], wire.AllBlocksCleared), "cleared on subscribe")
        n = len(sub.events())
        events.close()                                        # and cleared again at close
        sub.until(lambda evs: len(evs) > n and isinstance(evs[-1], wire.AllBlocksCleared), "cleared at close")
    finally:
        events.close()
        sub.close()


# --- the real vllm-router in front of two stand-in workers -------------------------------------------
ROUTER_BLOCK = 32
PROMPT_TOKENS = list(range(1000, 1000 + 4 * ROUTER_BLOCK + 5))   # 4 whole blocks and a tail


class StandInWorker:
    """/health, the render endpoints (fixed token ids), a chat answer naming the worker, and, once
    `events` is set, the two discovery endpoints from the KVEvents handle; records the paths asked."""

    def __init__(self, name: str):
        self.name, self.paths, self.events = name, [], None
        worker = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, code: int, body) -> None:
                data = json.dumps(body).encode() if not isinstance(body, bytes) else body
                self.send_response(code)
                self.send_header("Content-Type", "application/json" if code == 200 else "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                worker.paths.append(("GET", self.path))
                if self.path == "/health":
                    self._answer(200, {})
                elif self.path == "/get_server_info" and worker.events:
                    self._answer(200, {"model_id": "stand-in", **worker.events.server_info_fields()})
                elif self.path == "/kv_event_sources" and worker.events:
                    self._answer(200, worker.events.kv_event_sources())
                else:
                    self._answer(404, b"not here")

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                worker.paths.append(("POST", self.path))
                if self.path.endswith("/render"):
                    self._answer(200, {"token_ids": PROMPT_TOKENS})
                elif self.path == "/v1/chat/completions":
                    self._answer(200, {
                        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body.get("model"),
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": worker.name}}],
                        "usage": {"prompt_tokens": len(PROMPT_TOKENS), "completion_tokens": 1,
                                  "total_tokens": len(PROMPT_TOKENS) + 1}})
                else:
                    self._answer(404, b"not here")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def stop_router(proc: subprocess.Popen) -> None:
    """By process group: the router renames itself to vllm::router, so no name-based kill finds it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed in .venv (./scripts/setup.sh)")
@pytest.mark.parametrize("sources", ["static", "discovered", "discovered-ipc"])
def test_the_real_vllm_router_routes_by_these_events(tmp_path, sources):
    """static: --kv-event-source/--kv-event-replay-source/--kv-event-block-size/--kv-event-model (0.1.17 takes
    tcp only there); discovered: the router reads GET /get_server_info and GET /kv_event_sources instead;
    discovered-ipc: the same with ipc sockets in a private folder, as the fleet runs it."""
    workers = [StandInWorker("w1"), StandInWorker("w2")]
    schedulers = [StandInScheduler(ROUTER_BLOCK) for _ in workers]
    folder = Path(tempfile.mkdtemp(prefix="kvb-fleet-"))     # short: an ipc path fits in 107 bytes
    urls = ([f"ipc://{folder}/{w.name}.events" for w in workers] if sources == "discovered-ipc"
            else ["tcp://127.0.0.1:0"] * len(workers))
    publishers = [KVEventPublisher(url) for url in urls]
    views = [BlockView(s, p.publish, chunk_size=ROUTER_BLOCK, check_s=0.2, resync_interval_s=0.2)
             for s, p in zip(schedulers, publishers)]
    for w, view, publisher in zip(workers, views, publishers):
        publisher.on_subscribe = view.request_resync
        w.events = KVEvents(publisher, view, w.name, ROUTER_BLOCK)
    port, log_path = free_port(), tmp_path / "router.log"
    args = [str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware",
            "--worker-urls", *(w.url for w in workers), "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1"]
    if sources == "static":
        args += ["--kv-event-block-size", str(ROUTER_BLOCK), "--kv-event-model", "stand-in"]
        for w, p in zip(workers, publishers):
            args += ["--kv-event-source", f"{w.url}={p.endpoint}", "--kv-event-replay-source",
                     f"{w.url}={p.replay_endpoint}"]
    with log_path.open("w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while publishers[0].subscriptions == 0 or publishers[1].subscriptions == 0 or not _answers(port):
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, f"the router up and subscribed:\n{log_path.read_text()}"
            time.sleep(0.2)

        def routed(n: int = 4) -> list[str]:
            names = []
            for _ in range(n):
                r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30, json={
                    "model": "stand-in", "messages": [{"role": "user", "content": "the fixed prompt"}],
                    "max_tokens": 1})
                assert r.status_code == 200, r.text
                names.append(r.json()["choices"][0]["message"]["content"])
            return names

        def prefer(name: str, what: str) -> None:
            """Events reach the router asynchronously: ask until it routes there (or fail at the deadline)."""
            deadline = time.monotonic() + 30
            while (got := routed()) != [name] * 4:
                assert time.monotonic() < deadline, f"{what}: routed {got}\n{log_path.read_text()[-3000:]}"
                time.sleep(0.3)

        # with no claims the router picks one worker by load; every step below moves the choice
        run = tuple(PROMPT_TOKENS)
        views[1].resident([run])                          # w2 holds the prompt in its context
        prefer("w2", "w2 announced the prompt's 4 blocks")
        views[1].resident([])                             # gone from w2 ...
        views[0].resident([run])                          # ... and resident on w1
        prefer("w1", "w2 removed its blocks, w1 stored them")
        for h in schedulers[1].unsalted_hashes(PROMPT_TOKENS):
            schedulers[1].store[h] = "CPU"
        views[1].stored(run, 4)                           # w2 has them in L1 only: GPU on w1 still wins
        assert routed(8) == ["w1"] * 8
        views[0].resident([])
        for h in schedulers[0].unsalted_hashes(PROMPT_TOKENS):
            schedulers[0].store[h] = "DISK"
        views[0].stored(run, 4)                           # w1 on DISK (0.3) loses to w2's CPU (0.8)
        prefer("w2", "CPU on w2 against DISK on w1")
        publishers[1].publish([wire.AllBlocksCleared()])  # w2 cleared: only w1's DISK claim is left
        schedulers[1].store.clear()
        prefer("w1", "w2 cleared everything")

        # a batch the live stream loses (as ZMQ drops one for a subscriber past its high-water mark): the
        # router sees the gap, asks the replay socket, and applies the lost batch
        ids = [wire.block_id(h) for h in schedulers[1].unsalted_hashes(PROMPT_TOKENS)]
        lost = wire.BlockStored(ids, None, PROMPT_TOKENS[:4 * ROUTER_BLOCK], ROUTER_BLOCK, medium="GPU")
        with publishers[1]._cond:                         # fault injection: numbered and kept, never sent
            publishers[1]._keep_for_replay(publishers[1].seq, wire.encode_batch([lost]))
            publishers[1].seq += 1
        publishers[1].publish([wire.BlockRemoved([1], "GPU")])   # the next live batch shows the gap
        prefer("w2", "the lost batch came back through the replay socket")
        assert publishers[1].replays >= 1
        assert all(("POST", "/v1/chat/completions/render") in w.paths for w in workers)
        discovery = {("GET", "/get_server_info"), ("GET", "/kv_event_sources")}
        assert all(discovery <= set(w.paths) for w in workers) == sources.startswith("discovered")
    finally:
        stop_router(proc)
        for w in workers:
            w.events.close()
            w.close()
        shutil.rmtree(folder, ignore_errors=True)


def _answers(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except (requests.ConnectionError, requests.Timeout):   # not listening yet, or busy starting
        return False


# --- the real scheduler on the real model --------------------------------------------------------------
@needs_model
def test_the_real_scheduler_publishes_its_unsalted_prompts_by_medium(make_settings, short_doc):
    """start_kv_events on a real Scheduler: an unsalted prompt's whole chunks are claimed resident (GPU)
    and stored (CPU), with the prompt's own token ids; a cache_salt prompt never appears; when L1 lets
    go the recheck moves the claims to DISK, when L2 does too they are removed; closed, all is cleared."""
    from kvbridge.scheduler import Scheduler

    settings = make_settings(sched_kv_cells=2048, sched_max_running=2, sched_cached_prefixes=2, n_predict=8,
                             ctx_size=1024, kv_events_url="tcp://127.0.0.1:0", kv_events_check_s=0.2)
    open_prompt = [{"role": "user", "content": f"Document:\n{short_doc}\n\nWho leads the operations team?"}]
    salted_prompt = [{"role": "user", "content": f"Secret:\n{short_doc[300:]}\n\nSummarise it."}]
    with Scheduler(settings) as scheduler:
        events = start_kv_events(settings, scheduler, "solo")
        sub = Subscriber(events.endpoint)
        try:
            sub.until(lambda evs: any(isinstance(e, wire.AllBlocksCleared) for e in evs), "subscribed")
            open_tokens, salted_tokens = scheduler.tokens_of(open_prompt), scheduler.tokens_of(salted_prompt)
            scheduler.submit(salted_prompt, cache_salt="tenant-a").result(timeout=120)
            scheduler.submit(open_prompt).result(timeout=120)
            cs = scheduler.chunk_size
            ids = [wire.block_id(h) for h in scheduler.unsalted_hashes(open_tokens)]
            assert ids and len(ids) == len(open_tokens) // cs
            sub.until(lambda evs: {(i, "CPU") for i in ids} <= set(stored_claims(evs))
                      and {(i, "GPU") for i in ids[:-1]} <= set(stored_claims(evs)),
                      "the prompt's chunks claimed in L1 and (its cached prefix) resident")
            tokens_of = {h: e.token_ids[k * cs:(k + 1) * cs] for e in sub.events()
                         if isinstance(e, wire.BlockStored) for k, h in enumerate(e.block_hashes)}
            assert [tokens_of[i] for i in ids] == [open_tokens[k * cs:(k + 1) * cs] for k in range(len(ids))]
            salted_chunks = {tuple(salted_tokens[k * cs:(k + 1) * cs]) for k in range(len(salted_tokens) // cs)}
            assert not salted_chunks & {tuple(t) for t in tokens_of.values()}, "a cache_salt prompt was published"

            scheduler.store.clear("L1")                    # L2 keeps its written-through copies
            sub.until(lambda evs: {(i, "DISK") for i in ids} <= set(stored_claims(evs))
                      and not {(i, "CPU") for i in ids} & set(stored_claims(evs)), "the claims moved to DISK")
            scheduler.store.clear("L2")
            sub.until(lambda evs: not {(i, m) for i in ids for m in ("CPU", "DISK")} & set(stored_claims(evs)),
                      "the store's claims removed by the recheck")
        finally:
            events.close()
        sub.until(lambda evs: isinstance(evs[-1], wire.AllBlocksCleared), "cleared at close")
        sub.close()
