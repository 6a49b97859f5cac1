"""A fault-injection soak: engines asking questions whose cold answers they know, while a driver breaks
everything around them with real signals, bounded in time.

Place: a benchmark (`python -m kvbridge.bench.probes.fault_soak --seconds 300`) and, short, a CI test
(tests/test_fault_soak.py). Real parts only: a private redis-server as L3, a private cache server
process (`KVB_STORE_URL`), and N engine processes (CachedEngine, in-process llama.cpp on the embedded
model) that first compute each question's cold answer, then ask in lmcache mode over and over and
write every answer, with whether it equals the cold one, to a JSON-lines file. Meanwhile the driver
(seeded) SIGSTOPs engines past the server's reap timeout, SIGKILLs and restarts them, SIGSTOPs and
SIGKILLs the cache server (and starts it again on the same address), restarts it cleanly under the
clients (the first fault, always: the new server has a new CURVE key pair and token, so every client
must find the new key file and authenticate again; while none exists its calls are refused, counted
misses), pauses and kills Redis (and starts it again), and fills the server's shared-memory pool.
Afterwards: every answer must equal its cold answer; each client must answer again after the last
fault; no lease, pending page or segment may be left. The report is the reliability table of
Docs/Research.md §14, with the store calls the clients counted as refused or unavailable.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvbridge.settings import WORK_DIR, Settings, settings_to_env
from kvbridge.settings.cmdline import Parser

QUESTIONS = ["Who leads the operations team?", "How deep are the wells?", "When is the annual meeting held?",
             "What happens when turbidity is high?"]
RECOVERY_S = 120.0   # after the last fault, how long every client has to answer again
FAULTS = ("client-stop", "client-kill", "server-stop", "server-kill", "server-restart", "redis-pause", "redis-kill",
          "pool-fill")


@dataclass
class SoakReport:
    seconds: float = 0.0
    answers: int = 0
    wrong: int = 0
    serve_answers: int = 0                            # through serve (HTTP, the scheduler on the cache server)
    serve_wrong: int = 0
    serve_failed: int = 0
    failed: int = 0                                   # requests that ended in an error (a KVBridge error)
    restored: int = 0                                 # answers that reused stored KV (matched > 0)
    store_refused: int = 0                            # engines' store calls refused (no key file yet, handshake)
    store_unavailable: int = 0                        # ... and those that found no server in time
    faults: collections.Counter = field(default_factory=collections.Counter)
    recovery_s: dict = field(default_factory=dict)    # fault kind -> longest time to a client's next answer
    clients_back: bool = True
    leftovers: list = field(default_factory=list)

    def table(self) -> str:
        rows = [f"| answers (restored from the store) | {self.answers} ({self.restored}) |",
                f"| wrong answers | **{self.wrong}** |", f"| failed requests | {self.failed} |",
                f"| engines' store calls refused (server not authenticated yet) / unavailable, each a miss | "
                f"{self.store_refused} / {self.store_unavailable} |",
                f"| serve requests answered (wrong, failed) | {self.serve_answers} "
                f"(**{self.serve_wrong}**, {self.serve_failed}) |",
                f"| every client answering after the last fault | {'yes' if self.clients_back else 'NO'} |",
                f"| leases, pending pages, segments left | {', '.join(self.leftovers) or 'none'} |"]
        for kind in FAULTS:
            if self.faults[kind]:
                rows.append(f"| {kind}: injected, longest recovery | {self.faults[kind]}, "
                            f"{self.recovery_s.get(kind, float('nan')):.1f} s |")
        return "| figure | value |\n| --- | --- |\n" + "\n".join(rows)


# -- the client process ---------------------------------------------------------------------------------
def client_main(args) -> int:
    from kvbridge.backends import make_backend
    from kvbridge.bench.common.scenarios import builtin_document
    from kvbridge.engine.cached_engine import CachedEngine

    settings = Settings.from_env()
    doc = builtin_document()[:1200]
    prompts = {q: [{"role": "user", "content": f"Document:\n{doc}\n\nQuestion: {q}"}] for q in QUESTIONS}
    out = open(args.out, "a", buffering=1)
    engine = CachedEngine(settings, make_backend("llamacpp", settings)).start()
    cold = {q: engine.infer(p, mode="cold").text for q, p in prompts.items()}
    out.write(json.dumps({"kind": "ready", "pid": os.getpid(), "t": time.time()}) + "\n")
    rng = random.Random(args.seed)
    while not Path(args.stop).exists():
        q = rng.choice(QUESTIONS)
        record = engine.infer(prompts[q], mode="lmcache")
        out.write(json.dumps({"kind": "answer", "t": time.time(), "ok": record.text == cold[q], "error": record.error,
                              "matched": record.matched_tokens, "tier": record.tier, "notes": record.notes[:200],
                              "pid": os.getpid(), "store_faults": engine.store.fault_counts()}) + "\n")
    engine.close()
    return 0


# -- serve, asked through HTTP --------------------------------------------------------------------------
class _ServeAsker:
    """`python -m kvbridge serve` on the same cache server (its scheduler swaps and restores through it),
    run as its answers are proven equal to solo runs: KVB_SCHED_EXACT=1 on the default f16 K/V with two running
    sequences (kvbridge.scheduler.exact), asked from a thread. Each question's cold answer comes first, with a
    cache_salt of its own (a salt shares nothing: a real cold prefill)."""

    def __init__(self, directory: Path, env: dict) -> None:
        import threading

        self.log = directory / "serve.log"
        env = dict(env, KVB_SCHED_EXACT="1", KVB_SCHED_MAX_RUNNING="2", KVB_SERVE_MAX_TOKENS="12")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvbridge", "serve", "--port", "0"], env=env,
                                         cwd=WORK_DIR,
                                         stdout=log, stderr=subprocess.STDOUT)
        self.url = ""
        self.answers: list[tuple[float, bool, str]] = []   # (time, equal to cold, error)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-serve", daemon=True)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.url:
            text = self.log.read_text(errors="replace")
            if "KVBridge serve ready on " in text:
                self.url = text.split("KVBridge serve ready on ", 1)[1].split()[0]
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the soak's serve did not start; its log ends: {text[-1500:]}")
            else:
                time.sleep(0.3)
        self._thread.start()

    def _ask(self, question: str, salt: str = "") -> str:
        import requests

        from kvbridge.bench.common.scenarios import builtin_document

        body = {"model": "x", "temperature": 0, "max_tokens": 12, "messages": [
            {"role": "user", "content": f"Document:\n{builtin_document()[:1200]}\n\nQuestion: {question}"}]}
        if salt:
            body["cache_salt"] = salt
        reply = requests.post(self.url + "/v1/chat/completions", json=body, timeout=120)
        reply.raise_for_status()
        return reply.json()["choices"][0]["message"]["content"]

    def _run(self) -> None:
        import requests

        cold = {}
        for i, q in enumerate(QUESTIONS):
            while q not in cold and not self._stop.is_set():
                try:
                    cold[q] = self._ask(q, salt=f"cold-{i}-{time.time()}")
                except requests.RequestException:
                    time.sleep(1)
        rng = random.Random(5)
        while not self._stop.is_set():
            q = rng.choice(QUESTIONS)
            try:
                self.answers.append((time.time(), self._ask(q) == cold[q], ""))
            except requests.RequestException as exc:
                self.answers.append((time.time(), False, str(exc)[:200]))
                time.sleep(0.5)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=150)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# -- the driver -----------------------------------------------------------------------------------------
class _Client:
    def __init__(self, index: int, directory: Path, env: dict, seed: int) -> None:
        self.index, self.directory, self.env, self.seed = index, directory, env, seed
        self.out = directory / f"client-{index}.jsonl"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        log = open(self.directory / f"client-{self.index}.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvbridge.bench.probes.fault_soak", "--client",
                                      "--out", str(self.out), "--stop", str(self.directory / "stop"),
                                      "--seed", str(self.seed + self.index)],
                                     env=self.env, cwd=WORK_DIR, stdout=log, stderr=log)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)


def soak(seconds: float, n_clients: int = 2, seed: int = 1, interval_s: float = 5.0,
         settings: Settings | None = None, with_serve: bool = True, min_faults: int = 0,
         min_serve_answers: int = 0, min_answers: int = 0) -> SoakReport:
    """Inject faults for `seconds`, and on past that until `min_faults` were injected (a loaded machine
    makes each fault's own time longer: a clean stop flushes L1) and the engines answered `min_answers`
    in all (a short window on a loaded machine leaves few), but never past four times `seconds`;
    then wait (up to RECOVERY_S) for every client, and serve, to answer again, and for serve to have
    answered `min_serve_answers` in all (its cold answers come first, and take longer on a loaded machine)."""
    from kvbridge.bench.common.private_redis import PrivateRedis
    from kvbridge.bench.common.private_server import PrivateCacheServer
    from kvbridge.cache_server.client import CacheClient
    from kvbridge.cache_server.connection import CacheServerError, CacheServerRefused, CacheServerUnavailable
    from kvbridge.cache_server.shm import stale_segments
    from kvbridge.store.objects import ObjectMeta

    rng = random.Random(seed)
    report = SoakReport()
    with tempfile.TemporaryDirectory(prefix="kvb-soak-") as tmp:
        directory = Path(tmp)
        (directory / "redis").mkdir()
        redis = PrivateRedis(directory / "redis", maxmemory="256mb")
        base = (settings or Settings.from_env()).replace(
            chunk_size=32, ctx_size=1024, n_predict=12, l1_bytes=48 << 20, l2_dir=str(directory / "l2"),
            l3_url=redis.url, l3_timeout=1.0, cache_server_timeout=2.0, cache_server_reap_timeout=3.0,
            cache_server_registration_grace=30.0, cache_server_lease_timeout=10.0, threads=1)
        server = PrivateCacheServer(base, directory)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVB_")}
        env.update(settings_to_env(base.replace(store_url=server.url)))
        env["PYTHONPATH"] = str(WORK_DIR)
        clients = [_Client(i, directory, env, seed) for i in range(n_clients)]
        asker = _ServeAsker(directory, env) if with_serve else None
        started = time.monotonic()
        fault_log: list[tuple[float, str, int | None]] = []   # (time.time() it ended, kind, client index)
        try:
            _wait_ready(clients, timeout_s=300)
            if asker is not None:
                asker.wait_ready(timeout_s=300)
            deadline = time.monotonic() + seconds
            ceiling = time.monotonic() + 4 * seconds
            while time.monotonic() < deadline or (
                    (len(fault_log) < min_faults or _answer_count(clients) < min_answers)
                    and time.monotonic() < ceiling):
                time.sleep(rng.uniform(0.5, 1.5) * interval_s)
                kind = rng.choice(FAULTS) if fault_log else "server-restart"   # the restart at least once
                target = rng.randrange(n_clients)
                if kind == "client-stop":
                    clients[target].signal(signal.SIGSTOP)
                    time.sleep(rng.uniform(1.0, 5.0))        # past the server's 3 s reap timeout, sometimes
                    clients[target].signal(signal.SIGCONT)
                elif kind == "client-kill":
                    clients[target].signal(signal.SIGKILL)
                    clients[target].proc.wait()
                    clients[target].start()
                elif kind == "server-stop":
                    os.kill(server.pid, signal.SIGSTOP)
                    time.sleep(rng.uniform(1.0, 4.0))
                    os.kill(server.pid, signal.SIGCONT)
                    target = None
                elif kind == "server-kill":
                    server.kill()
                    server = PrivateCacheServer(base, directory, url=server.url)   # same address; stale segment removed
                    target = None
                elif kind == "server-restart":   # clean stop (key and token files removed), a new key pair
                    server.stop()
                    time.sleep(rng.uniform(0.5, 2.0))
                    server = PrivateCacheServer(base, directory, url=server.url)
                    target = None
                elif kind == "redis-pause":
                    _redis_command(redis.port, "CLIENT", "PAUSE", str(rng.randrange(1000, 4000)), "ALL")
                    target = None
                elif kind == "redis-kill":
                    redis.kill()
                    time.sleep(rng.uniform(0.5, 2.0))
                    redis = PrivateRedis(directory / "redis", maxmemory="256mb", port=redis.port)
                    target = None
                else:   # pool-fill: another client stores junk until the pool refuses
                    target = None
                    try:
                        with CacheClient(server.url, timeout_s=2.0, priority=1) as filler:
                            meta = ObjectMeta(namespace="soak-junk", n_tokens=1, tokens_digest=b"", kind="chunk")
                            for i in range(64):
                                if not filler.store(rng.randbytes(16), b"\0" * (2 << 20), meta)[0]:
                                    break
                    except (CacheServerUnavailable, CacheServerError, CacheServerRefused):
                        pass
                report.faults[kind] += 1
                fault_log.append((time.time(), kind, target))
            # faults over: every client must answer again, within a bounded time (a killed one reloads the
            # model and recomputes its cold answers first)
            last_fault = fault_log[-1][0] if fault_log else 0.0
            back_by = time.monotonic() + RECOVERY_S
            while time.monotonic() < back_by and not all(_answered_since(c, last_fault) for c in clients):
                time.sleep(0.5)
            if asker is not None:
                back_by = time.monotonic() + RECOVERY_S
                while time.monotonic() < back_by and not (
                        any(t > last_fault and not e for t, _, e in asker.answers)
                        and len(asker.answers) >= min_serve_answers):
                    time.sleep(0.5)
                asker.stop()
                _read_serve(asker, last_fault, report)
            (directory / "stop").touch()
            for client in clients:
                client.signal(signal.SIGCONT)
                try:
                    client.proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    client.proc.kill()
                    report.leftovers.append(f"client {client.index} did not stop")
            report.seconds = time.monotonic() - started
            _read_answers(clients, fault_log, report)
            try:
                with CacheClient(server.url, timeout_s=10) as probe:
                    probe.lookup([b"z" * 16])
                    pool = probe.status()["storage"]["pool"]
                for name in ("read_leases", "write_leases", "pending_pages"):
                    if pool[name]:
                        report.leftovers.append(f"{pool[name]} {name.replace('_', ' ')}")
            except (CacheServerUnavailable, CacheServerError, CacheServerRefused) as exc:
                report.leftovers.append(f"the cache server did not answer at the end: {exc}")
        finally:
            if asker is not None:
                asker.stop()
            (directory / "stop").touch()
            for client in clients:
                client.signal(signal.SIGCONT)
                client.signal(signal.SIGKILL)
            server.stop()
            redis.stop()
        stale = stale_segments()
        if stale:
            report.leftovers.append(f"{len(stale)} shared-memory segment(s) of dead servers")
    return report


def _read_serve(asker: _ServeAsker, last_fault: float, report: SoakReport) -> None:
    for _, ok, error in asker.answers:
        report.serve_answers += 1
        if error:
            report.serve_failed += 1
        elif not ok:
            report.serve_wrong += 1
    if not any(t > last_fault and not e for t, _, e in asker.answers):
        report.clients_back = False


def _answer_count(clients: list[_Client]) -> int:
    """The answers the engines wrote so far, right or wrong."""
    return sum(client.out.read_text().count('"kind": "answer"') for client in clients if client.out.exists())


def _answered_since(client: _Client, since: float) -> bool:
    for line in client.out.read_text().splitlines()[::-1]:
        if '"answer"' in line:
            answer = json.loads(line)
            if answer["t"] > since and not answer["error"]:
                return True
    return False


def _wait_ready(clients: list[_Client], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for client in clients:
        while not (client.out.exists() and '"ready"' in client.out.read_text()):
            if client.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"soak client {client.index} did not get ready (exit {client.proc.poll()}); see "
                                   f"{client.directory / f'client-{client.index}.log'}")
            time.sleep(0.2)


def _read_answers(clients: list[_Client], fault_log: list, report: SoakReport) -> None:
    last_fault = fault_log[-1][0] if fault_log else 0.0
    for client in clients:
        answers = [json.loads(line) for line in client.out.read_text().splitlines() if '"answer"' in line]
        last_faults = {a["pid"]: a["store_faults"] for a in answers}   # each process's counters, as it last wrote them
        report.store_refused += sum(f.get("refused", 0) for f in last_faults.values())
        report.store_unavailable += sum(f.get("unavailable", 0) for f in last_faults.values())
        for a in answers:
            report.answers += 1
            report.restored += a["matched"] > 0
            if a["error"]:
                report.failed += 1
            elif not a["ok"]:
                report.wrong += 1
        times = [a["t"] for a in answers if not a["error"]]
        if not any(t > last_fault for t in times):
            report.clients_back = False
        for ended, kind, target in fault_log:
            if target is not None and target != client.index:
                continue
            after = [t for t in times if t > ended]
            if after:
                report.recovery_s[kind] = max(report.recovery_s.get(kind, 0.0), after[0] - ended)


def _redis_command(port: int, *words: str) -> None:
    import redis as redis_py

    try:
        redis_py.Redis(host="127.0.0.1", port=port, socket_timeout=2).execute_command(*words)
    except redis_py.RedisError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m kvbridge.bench.probes.fault_soak", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="how long faults are injected (default 300)")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--interval", type=float, default=5.0, help="mean seconds between faults")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--stop", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        return client_main(args)
    report = soak(args.seconds, args.clients, args.seed, args.interval)
    print(f"fault soak, {args.clients} engine processes, seed {args.seed}, {report.seconds:.0f} s:")
    print(report.table())
    return 0 if report.wrong == 0 and report.serve_wrong == 0 and report.clients_back and not report.leftovers else 1


if __name__ == "__main__":
    sys.exit(main())
