"""What the cache server costs, next to the plainest way to do the same work.

Place in the flow: an engine's RemoteStore -> CacheClient -> a private cache server (a child process,
kvbridge.bench.common.private_server) -> its shared-memory L1 and an L2 in a temp dir. **This module times
those steps.** Every figure is a ratio measured side by side in one run, since the machine is shared:

- bench_restore_through_server: a 2k-token restore through the server's shared memory against the
  same restore from the embedded store, interleaved per repeat (the `bench-restore` server row);
- bench_inline_vs_socket: the same objects retrieved as inline bytes over loopback TCP (CURVE) against a
  plain TCP socket sending the same bytes, whole and in frames, and the cipher alone on the same bytes
  (`bench-restore`, for clients on another host);
- bench_store_vs_copy: one store call against a plain copy of the object into warm memory (`bench-cache-server`);
- measure_server_memory and measure_idle_cpu: the server's resident memory above its pool, and its
  CPU while idle with connected clients (`bench-cache-server`).

Deliberately left out: a remote host (loopback only), several engines storing at once, and any
timing threshold; the commands print the targets next to the figures and Docs/Research.md judges.
"""
from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from kvbridge.bench.common.private_server import PrivateCacheServer, bench_client, private_cache_server
from kvbridge.bench.common.report import plain_copy_ms, stored_prefix
from kvbridge.bench.store_bench import _paired_median_ms
from kvbridge.errors import KVBridgeError
from kvbridge.settings import Settings

MB = 1e6
WARM_RING_BYTES = 128 << 20   # the warm-copy baseline's ring: larger than a CPU's last-level cache (32 MiB here)
BENCH_NAMESPACE = "bench-cache-server"


# -- restore through the server --------------------------------------------------------------------
def bench_restore_through_server(engine, remote_store, prompt_tokens: int = 2048, repeats: int = 7) -> dict:
    """The same prefix restored from the embedded store and through the server's shared memory.

    Restore = lookup + fetch + confirm + assemble + the engine's set call, as in bench_restore. The
    two paths share the loaded model; each has its own assembly buffer (prefaulted alike). Per
    repeat both run back to back, the order swapped every repeat so noise and cache warmth hit both
    alike, then a plain copy of the bytes; one untimed round first. Medians are reported.
    """
    from kvbridge.engine.chunks import ChunkKV

    backend = engine.backend
    record, tokens, hashes = stored_prefix(engine, prompt_tokens)
    local_kv = engine._kv
    remote_kv = ChunkKV(remote_store, engine.namespace, getattr(engine.hasher, "seed", b""), engine.settings.chunk_size,
                        engine.geometry)
    remote_kv.prefault_scratch, remote_kv.cold_cut = local_kv.prefault_scratch, local_kv.cold_cut   # the same restore
    remote_kv.cut_rule = local_kv.cut_rule
    local_kv.hot_restores = remote_kv.hot_restores = False   # both paths read and assemble every time
    try:
        remote_kv.store_prompt(backend.save_state(), tokens, hashes)   # the same cells, now on the server too
        paths = {"embedded": local_kv, "server_shm": remote_kv}
        times: dict[str, list[float]] = {name: [] for name in [*paths, "memcpy"]}
        plans = {}
        for i in range(-1, repeats):
            order = list(paths) if i % 2 else list(paths)[::-1]
            for name in order:
                start = time.perf_counter()
                plan = paths[name].plan_restore(tokens, hashes, buffer_for=backend.state_buffer)
                backend.restore_state(plan.state, plan.tokens)
                elapsed = (time.perf_counter() - start) * 1e3
                backend.reset_native_cache()
                # the server plan's pieces view the server's pages: keep only what the report needs
                plans[name] = plan if name == "embedded" else (plan.matched_tokens, plan.tier)
                if i >= 0:
                    times[name].append(elapsed)
            copy_ms = plain_copy_ms(np.frombuffer(bytes(plans["embedded"].state.data), dtype=np.uint8))
            if i >= 0:
                times["memcpy"].append(copy_ms)
    finally:
        local_kv.hot_restores = True
        remote_kv.close()
    ms = {name: float(np.median(values)) for name, values in times.items()}
    local, (server_tokens, server_tier) = plans["embedded"], plans["server_shm"]
    keys = restored_keys(local, hashes, remote_kv.seed)
    return {"restored_tokens": local.matched_tokens, "server_restored_tokens": server_tokens,
            "server_tier": server_tier, "state_bytes": len(local.state.data), "objects": len(keys),
            "embedded_ms": ms["embedded"], "server_shm_ms": ms["server_shm"], "memcpy_ms": ms["memcpy"],
            "server_vs_embedded": ms["server_shm"] / ms["embedded"], "embedded_vs_copy": ms["embedded"] / ms["memcpy"],
            "shm_retrieves": remote_store.client.counters["shm_retrieves"],
            "keys": keys, "first_record_error": record.error}


def restored_keys(plan, hashes: Sequence[bytes], seed: bytes) -> list[bytes]:
    """The store keys of a restore's objects: its chunks, then the tail after the last of them."""
    from kvbridge.engine.hashing import tail_key

    keys = list(hashes[:plan.chunks_hit])
    if len(plan.pieces) > plan.chunks_hit:
        keys.append(tail_key(hashes[plan.chunks_hit - 1] if plan.chunks_hit else seed))
    return keys


# -- inline bytes over TCP -------------------------------------------------------------------------
class PlainSocketPeer:
    """The baseline for inline retrieves: a loopback TCP peer answering "send N bytes" with N bytes.

    One request per object, like a retrieve; the sender (a thread: sendall releases the GIL) holds
    the bytes ready, the receiver reads them into fresh memory, as ZMQ does for a message.
    """

    _REQUEST = struct.Struct("<Q")

    def __init__(self, max_bytes: int) -> None:
        self._payload = np.random.default_rng(2).integers(0, 256, size=max_bytes, dtype=np.uint8).tobytes()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._thread = threading.Thread(target=self._serve, name="kvb-bench-plain-peer", daemon=True)
        self._thread.start()
        self._conn = socket.create_connection(self._listener.getsockname())
        self._conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            view = memoryview(self._payload)
            while True:
                request = conn.recv(self._REQUEST.size, socket.MSG_WAITALL)
                if len(request) < self._REQUEST.size:
                    return
                conn.sendall(view[:self._REQUEST.unpack(request)[0]])

    def fetch(self, size: int) -> np.ndarray:
        self._conn.sendall(self._REQUEST.pack(size))
        out = np.empty(size, dtype=np.uint8)
        view, got = memoryview(out), 0
        while got < size:
            n = self._conn.recv_into(view[got:])
            if not n:
                raise ConnectionError("the plain socket peer closed the connection")
            got += n
        return out

    def close(self) -> None:
        self._conn.close()
        self._thread.join(timeout=5)
        self._listener.close()


def bench_inline_vs_socket(client, keys: Sequence[bytes], namespace: str | None, repeats: int = 7,
                           server_pid: int | None = None) -> dict:
    """All `keys` retrieved as inline bytes over CURVE (client made with use_shm=False) against a plain TCP
    transfer of the same sizes, side by side, alternated, medians (issue 47, Research §32):

    - `whole`: object by object, each object in one frame (the wire before issue 47);
    - `framed`: object by object, in frames of protocol.INLINE_FRAME_BYTES (the figure held to the target);
    - `many`: one retrieve_many of them all, framed (the call a restore makes);
    - `cipher`: the cipher alone, no socket: libsodium's XSalsa20-Poly1305 (what CURVE runs per frame)
      encrypting and then decrypting the same bytes in frames of the same size, on one core.

    Beside each median wall time, the median CPU time it took (this process, which holds the client and the
    plain socket's peer, plus the server at `server_pid`): on a machine shared with other work the wall
    times stretch with the load, the CPU each way of sending costs much less so.
    """
    from kvbridge.cache_server.protocol import INLINE_FRAME_BYTES

    sizes = []
    for key in keys:
        found = client.retrieve(key, namespace)
        if found is None or found.lease_id:
            raise KVBridgeError(f"object {key.hex()[:16]} did not come back inline from the cache server")
        sizes.append(len(found.blob))
    peer = PlainSocketPeer(max(sizes))
    cipher = SodiumBox.load()
    framed = client.frame_bytes or INLINE_FRAME_BYTES

    def one_by_one(frame_bytes: int):
        def run(_: int) -> None:
            client.frame_bytes = frame_bytes
            for key in keys:
                if client.retrieve(key, namespace) is None:
                    raise KVBridgeError(f"object {key.hex()[:16]} vanished from the cache server during the bench")
        return run

    def many(_: int) -> None:
        client.frame_bytes = framed
        if any(found is None for found in client.retrieve_many(list(keys), namespace)):
            raise KVBridgeError("an object vanished from the cache server during the bench")

    actions = {"plain_socket": lambda _: [peer.fetch(size) for size in sizes],
               "whole": one_by_one(0), "framed": one_by_one(framed), "many": many}
    if cipher is not None:
        payload = np.random.default_rng(5).integers(0, 256, size=max(sizes), dtype=np.uint8)
        actions["cipher"] = lambda _: [cipher.seal_and_open(payload[:size], framed) for size in sizes]
    try:
        ms, cpu = _paired_wall_and_cpu_ms(actions, repeats, server_pid)
    finally:
        peer.close()
        client.frame_bytes = framed
    socket_ms = ms["plain_socket"]
    return {"objects": len(keys), "bytes": sum(sizes), "frame_bytes": framed, "socket_ms": socket_ms, "cpu_ms": cpu,
            "inline_ms": ms["framed"], "inline_vs_socket": ms["framed"] / socket_ms,
            "whole_ms": ms["whole"], "whole_vs_socket": ms["whole"] / socket_ms,
            "many_ms": ms["many"], "many_vs_socket": ms["many"] / socket_ms,
            "cipher_ms": ms.get("cipher"), "cipher_vs_socket": ms["cipher"] / socket_ms if "cipher" in ms else None}


def _paired_wall_and_cpu_ms(actions: dict, repeats: int, server_pid: int | None) -> tuple[dict, dict]:
    """As store_bench._paired_median_ms (interleaved, one untimed round first), with the CPU time of this
    process and the server beside the wall time: two dicts of medians, in ms."""
    def cpu_now() -> float:
        return cpu_seconds(os.getpid()) + (cpu_seconds(server_pid) if server_pid else 0.0)

    for action in actions.values():
        action(-1)
    wall: dict[str, list[float]] = {name: [] for name in actions}
    cpu: dict[str, list[float]] = {name: [] for name in actions}
    for i in range(repeats):
        for name, action in actions.items():
            cpu_0, start = cpu_now(), time.perf_counter()
            action(i)
            wall[name].append((time.perf_counter() - start) * 1e3)
            cpu[name].append((cpu_now() - cpu_0) * 1e3)
    return ({name: float(np.median(v)) for name, v in wall.items()}, {name: float(np.median(v)) for name, v in cpu.items()})


class SodiumBox:
    """libsodium's crypto_secretbox (XSalsa20-Poly1305: the cipher CurveZMQ applies to every message once
    the handshake's Curve25519 key is agreed), called through ctypes on the very libsodium pyzmq's libzmq
    loads; None from load() where none is found (the bench then leaves the row out)."""

    ZEROBYTES = 32   # the NaCl API's zero padding in front of a message (crypto_secretbox_ZEROBYTES)

    def __init__(self, lib) -> None:
        import ctypes

        self._lib = lib
        for fn in (lib.crypto_secretbox, lib.crypto_secretbox_open):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_void_p]
        self._key = bytes(range(32))
        self._nonce = bytes(24)
        self._buffers: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    @classmethod
    def load(cls) -> "SodiumBox | None":
        import ctypes
        import ctypes.util

        import zmq

        bundled = sorted((Path(zmq.__file__).parent.parent / "pyzmq.libs").glob("libsodium*.so*"))
        name = str(bundled[0]) if bundled else ctypes.util.find_library("sodium")
        if not name:
            return None
        lib = ctypes.CDLL(name)
        return cls(lib) if lib.sodium_init() >= 0 else None

    def seal_and_open(self, data: np.ndarray, frame_bytes: int) -> None:
        """Encrypt `data` frame by frame, then decrypt it (as a sender's and a receiver's IO threads would)."""
        for start in range(0, len(data), frame_bytes):
            piece = data[start:start + frame_bytes]
            plain, box, back = self._frame_buffers(len(piece))
            plain[self.ZEROBYTES:] = piece
            n = len(piece) + self.ZEROBYTES
            self._lib.crypto_secretbox(box.ctypes.data, plain.ctypes.data, n, self._nonce, self._key)
            if self._lib.crypto_secretbox_open(back.ctypes.data, box.ctypes.data, n, self._nonce, self._key) != 0:
                raise KVBridgeError("libsodium failed to open what it sealed (the cipher bench is broken)")

    def _frame_buffers(self, size: int):
        if size not in self._buffers:   # warm buffers: the figure is the cipher, not page faults
            self._buffers[size] = tuple(np.zeros(size + self.ZEROBYTES, dtype=np.uint8) for _ in range(3))
        return self._buffers[size]


# -- a store call ----------------------------------------------------------------------------------
def bench_store_vs_copy(client, object_bytes: int, repeats: int = 15) -> dict:
    """One CacheClient.store of a chunk-sized object against one plain copy of the same bytes into warm memory.

    A single object's store: the copy into pages the server lent ahead and one round trip naming it (a
    grant, issue 47), timed against the same store without grants (prepare, a round trip; copy; commit, a
    round trip, waited for: the server holds the object when store returns); the disk write is the server's
    background job.
    The baseline (issue 47) copies into memory touched before, as the pool's pages are (MAP_POPULATE), and
    goes round a ring of such buffers larger than the CPU's caches, as stores go round the pool, so neither
    side is a copy between two cache-resident buffers; a copy into fresh memory (page faults included, the
    baseline before issue 47) is timed beside it. A ping, and a plain TCP round trip, are timed beside them
    too: the store pays two round trips. Alternated, medians; every store gets a fresh key (a repeated key
    answers "exists", cheaper).
    """
    from kvbridge.store import ObjectMeta

    source = np.random.default_rng(3).integers(0, 256, size=object_bytes, dtype=np.uint8)
    blob = source.tobytes()
    meta = ObjectMeta(namespace=BENCH_NAMESPACE, n_tokens=256, tokens_digest=bytes(16), note="bench")
    refusals: list[str] = []
    ring = [np.ones(object_bytes, dtype=np.uint8) for _ in range(max(4, WARM_RING_BYTES // max(object_bytes, 1)))]

    def store(grants: bool):
        def run(_: int) -> None:
            client.grants = grants
            stored, reason = client.store(fresh_key(), blob, meta)
            if not stored:
                refusals.append(reason)
        return run

    def warm_copy(i: int) -> None:
        np.copyto(ring[i % len(ring)], source)

    peer = PlainSocketPeer(8)
    try:
        ms = _paired_median_ms({"warm_copy": warm_copy, "server_store": store(True), "two_round_trips": store(False),
                                "fresh_copy": lambda _: source.copy(), "ping": lambda _: client.ping(),
                                "socket_round_trip": lambda _: peer.fetch(8)}, repeats)
    finally:
        peer.close()
        client.grants = True
    if refusals:
        raise KVBridgeError(f"the cache server refused {len(refusals)} bench store(s) ({', '.join(set(refusals))}): "
                            "raise KVB_L1_BYTES or lower --object-mb/--repeats")
    return {"object_bytes": object_bytes, "store_ms": ms["server_store"], "copy_ms": ms["warm_copy"],
            "fresh_copy_ms": ms["fresh_copy"], "ping_ms": ms["ping"], "socket_round_trip_ms": ms["socket_round_trip"],
            "store_vs_copy": ms["server_store"] / ms["warm_copy"],
            "store_vs_fresh_copy": ms["server_store"] / ms["fresh_copy"], "shared_memory": client.shared_memory,
            "two_round_trips_ms": ms["two_round_trips"], "two_round_trips_vs_copy": ms["two_round_trips"] / ms["warm_copy"]}


def bench_prompt_store_vs_copy(client, object_bytes: int, n_objects: int = 8, repeats: int = 7) -> dict:
    """The store call an engine makes after a prompt (ChunkKV.store_prompt -> put_many): its new
    objects in one store_many (one prepare round trip, copies, one commit sent), against numpy copies
    of the same objects. Alternated, medians, fresh keys."""
    from kvbridge.store import ObjectMeta

    sources = [np.random.default_rng(seed).integers(0, 256, size=object_bytes, dtype=np.uint8)
               for seed in range(n_objects)]
    blobs = [source.tobytes() for source in sources]
    meta = ObjectMeta(namespace=BENCH_NAMESPACE, n_tokens=256, tokens_digest=bytes(16), note="bench")
    refused: list[str] = []

    def store(_: int) -> None:
        refused.extend(reason for ok, reason in client.store_many([(fresh_key(), b, meta) for b in blobs]) if not ok)

    ms = _paired_median_ms({"memory_copy": lambda _: [source.copy() for source in sources], "server_store": store},
                           repeats)
    if refused:
        raise KVBridgeError(f"the cache server refused {len(refused)} bench store(s): raise KVB_L1_BYTES")
    return {"object_bytes": object_bytes, "objects": n_objects, "store_ms": ms["server_store"],
            "copy_ms": ms["memory_copy"], "store_vs_copy": ms["server_store"] / ms["memory_copy"]}


def bench_store_both_ways(client, object_bytes: int, repeats: int = 15) -> dict:
    """bench_store_vs_copy twice: into pool pages this client never touched (a new engine process pays
    a page fault per 4 KiB of its mapping), then, after L1 is emptied, into the same pages again."""
    first_touch = bench_store_vs_copy(client, object_bytes, repeats)
    client.flush()
    client.clear("L1")
    return {"first_touch": first_touch, "pages_mapped": bench_store_vs_copy(client, object_bytes, repeats)}


_key_counter = itertools.count()


def fresh_key() -> bytes:
    """A key no earlier store of this process used (32 bytes, like a chunk hash)."""
    return b"bench" + os.getpid().to_bytes(4, "big") + next(_key_counter).to_bytes(8, "big") + bytes(15)


# -- memory and idle cost --------------------------------------------------------------------------
def proc_status(pid: int) -> dict[str, int]:
    """The memory lines of /proc/PID/status, in bytes (VmRSS, VmHWM, RssAnon, RssFile, RssShmem), and Threads."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[name] = int(value.split()[0]) * 1024
        elif name == "Threads":
            out[name] = int(value)
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process from /proc/PID/stat, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_server_memory(client, pid: int, pool_bytes: int, fill: float = 0.7, object_bytes: int = 6_000_000) -> dict:
    """The server's resident memory once its pool holds `fill` of its capacity (below the eviction mark).

    The pool is a mapped /dev/shm file: its pages count in RssShmem once the server touched them
    (the write-through to L2 reads every object). Reported: VmRSS minus the whole pool (the figure
    held to the target) and RssAnon + RssFile (what is not the pool at all), after a flush so the
    L2 writer is done; VmHWM is the peak while filling.
    """
    from kvbridge.store import ObjectMeta

    before = proc_status(pid)
    blob = np.random.default_rng(4).integers(0, 256, size=object_bytes, dtype=np.uint8).tobytes()
    meta = ObjectMeta(namespace=BENCH_NAMESPACE, n_tokens=256, tokens_digest=bytes(16), note="bench fill")
    storage = client.status()["storage"]
    filled = storage["tiers"]["L1"]["bytes"]
    while filled + object_bytes <= fill * pool_bytes:
        stored, reason = client.store(fresh_key(), blob, meta)
        if not stored:
            break
        filled += object_bytes
    client.flush()
    after = proc_status(pid)
    l1 = client.status()["storage"]["tiers"]["L1"]
    return {"pool_bytes": pool_bytes, "filled_bytes": l1["bytes"], "objects": l1["objects"],
            "rss_before": before["VmRSS"], "rss": after["VmRSS"], "rss_peak": after["VmHWM"],
            "rss_shmem": after["RssShmem"], "rss_anon": after["RssAnon"], "rss_file": after["RssFile"],
            "rss_minus_pool": after["VmRSS"] - pool_bytes, "non_pool_rss": after["RssAnon"] + after["RssFile"],
            "threads": after["Threads"]}


def measure_idle_cpu(server: PrivateCacheServer, seconds: float = 20.0, n_clients: int = 2) -> dict:
    """CPU the server uses while `n_clients` are connected and send nothing but their heartbeats.

    utime + stime over the interval, as a share of one core; the bench process (which holds the
    clients and their threads) is measured over the same interval for comparison.
    """
    clients = [bench_client(server) for _ in range(n_clients)]
    try:
        for client in clients:
            client.ping()
        time.sleep(min(1.0, seconds))   # the hellos' and pings' work is over
        server_0, own_0, wall_0 = cpu_seconds(server.pid), cpu_seconds(os.getpid()), time.monotonic()
        time.sleep(seconds)
        server_1, own_1, wall_1 = cpu_seconds(server.pid), cpu_seconds(os.getpid()), time.monotonic()
    finally:
        for client in clients:
            client.close()
    wall = wall_1 - wall_0
    return {"seconds": wall, "clients": n_clients, "server_cpu_s": server_1 - server_0,
            "server_core_pct": 100 * (server_1 - server_0) / wall, "bench_process_core_pct": 100 * (own_1 - own_0) / wall}


# -- the command -----------------------------------------------------------------------------------
def run_bench_cache_server(settings: Settings, object_mb: float = 6.0, repeats: int = 15, fill: float = 0.7,
                           idle_s: float = 20.0) -> dict:
    """`bench-cache-server`: store vs copy, memory above the pool, idle CPU, on one private server."""
    object_bytes = int(object_mb * MB)
    with private_cache_server(settings) as server:
        with bench_client(server) as client:
            store = bench_store_both_ways(client, object_bytes, repeats)
            client.flush()
            client.clear("L1")
            store["prompt"] = bench_prompt_store_vs_copy(client, object_bytes, repeats=max(3, repeats // 2))
            memory = measure_server_memory(client, server.pid, server.pool_bytes, fill, object_bytes)
        idle = measure_idle_cpu(server, idle_s)
    return {"url": server.url, "store": store, "memory": memory, "idle": idle}


def format_bench_cache_server(result: dict) -> str:
    store, memory, idle = result["store"], result["memory"], result["idle"]
    lines = [f"KVBridge bench-cache-server: a private server on {result['url']}"]
    for regime, what in (("first_touch", "into pool pages new to this client"),
                         ("pages_mapped", "into pool pages this client mapped before")):
        s = store[regime]
        path = "shared memory" if s["shared_memory"] else "inline bytes"
        lines.append(f"store of a {s['object_bytes'] / MB:.1f} MB object ({path}) {what}: {s['store_ms']:.2f} ms, "
                     f"one copy into warm memory {s['copy_ms']:.2f} ms, ratio {s['store_vs_copy']:.2f}x (target <= 3x); "
                     f"a copy into fresh memory {s['fresh_copy_ms']:.2f} ms ({s['store_vs_fresh_copy']:.2f}x); the same "
                     f"store without pages lent ahead (prepare + commit, before issue 47) {s['two_round_trips_ms']:.2f} ms "
                     f"({s['two_round_trips_vs_copy']:.2f}x); "
                     f"one round trip (ping) {s['ping_ms']:.2f} ms, a plain TCP round trip "
                     f"{s['socket_round_trip_ms']:.3f} ms; medians, alternated")
    prompt = store.get("prompt")
    if prompt:
        lines.append(f"a prompt's store ({prompt['objects']} objects of {prompt['object_bytes'] / MB:.1f} MB in one "
                     f"store_many, as ChunkKV stores a prompt): {prompt['store_ms']:.2f} ms, plain memory copies "
                     f"{prompt['copy_ms']:.2f} ms, ratio {prompt['store_vs_copy']:.2f}x (target <= 3x)")
    lines += [
        f"memory with the pool {memory['filled_bytes'] / memory['pool_bytes']:.0%} full ({memory['objects']} objects, "
        f"pool {memory['pool_bytes'] / 2**20:.0f} MiB): RSS {memory['rss'] / 2**20:.0f} MiB, of it pool pages "
        f"(RssShmem) {memory['rss_shmem'] / 2**20:.0f} MiB; RSS - pool {memory['rss_minus_pool'] / 2**20:+.0f} MiB, "
        f"RssAnon + RssFile {memory['non_pool_rss'] / 2**20:.0f} MiB (target <= ~150 MB above the pool); "
        f"before filling {memory['rss_before'] / 2**20:.0f} MiB, peak {memory['rss_peak'] / 2**20:.0f} MiB, "
        f"{memory['threads']} threads",
        f"idle with {idle['clients']} clients for {idle['seconds']:.0f} s: server {idle['server_cpu_s']:.2f} CPU-s = "
        f"{idle['server_core_pct']:.2f}% of one core (target < 2%); the bench process holding the clients "
        f"{idle['bench_process_core_pct']:.2f}%",
    ]
    return "\n".join(lines)
