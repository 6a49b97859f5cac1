"""What the same few prompt rows cost llama-server after a slot restore, against after its own reuse (issue 47 §4).

`python -m kvbridge.bench.probes.slot_restore_probe [--reps 9] [--rows 15] [--perf DIR]`

One llama-server, started with the arguments KVBridge gives its own (kvbridge.backends.llama_server.launch) and
a slot directory. A prefix P0 (the built-in handbook) and P1 = P0 + `--rows` more tokens. Alternating, per
repeat:
- native: P0 computed by the server, then P1 sent: the server reuses P0 and computes the rest;
- restore: the slot erased, P0's slot file (saved once) restored, then P1 sent;
- restore, file rewritten: as restore, the slot file written again through a mapping first (as KVBridge
  assembles a restore into its one restore file);
- restore after a save: as restore, after a slot save read and deleted (as KVBridge captures an answer's KV).
The cases run round robin. It prints the server's own `timings.prompt_ms` and `prompt_n` for P1 in each case,
and their medians. `--perf FILE` records `perf record -g` of the server throughout.
"""
from __future__ import annotations

import mmap
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import requests

from kvbridge.backends.llama_server.process import free_port
from kvbridge.backends.llama_server.launch import resolve_binary
from kvbridge.backends.llama_cpp_model import model_path_for
from kvbridge.backends.model_traits import traits_of_file
from kvbridge.backends.base import BATCH_TOKENS
from kvbridge.bench.common.scenarios import builtin_document
from kvbridge.settings import Settings
from kvbridge.settings.cmdline import Parser

QUESTION = "\n\nQuestion: What does the handbook say about meetings? Answer briefly."


def server_args(settings: Settings, slot_dir: Path, port: int) -> list[str]:
    threads = str(settings.resolved_threads())
    model = model_path_for(settings)
    args = ["--model", str(model), "--ctx-size", str(settings.ctx_size), "--threads", threads,
            "--threads-batch", threads, "--parallel", "1", "--cache-ram", "0", "--flash-attn",
            "on" if settings.flash_attn else "off", "--cache-type-k", settings.cache_type_k.lower(),
            "--cache-type-v", settings.cache_type_v.lower(), "--batch-size", str(BATCH_TOKENS),
            "--ubatch-size", str(BATCH_TOKENS), "--no-webui", "--no-warmup", "--host", "127.0.0.1",
            "--port", str(port), "--slot-save-path", str(slot_dir)]
    if traits_of_file(model).n_swa:
        args.append("--swa-full")
    return args


def completion(url: str, tokens: list[int], n_predict: int = 1) -> dict:
    r = requests.post(f"{url}/completion", json={"prompt": tokens, "n_predict": n_predict, "cache_prompt": True,
                                                 "temperature": 0, "id_slot": 0}, timeout=300)
    r.raise_for_status()
    return r.json()


def slot_action(url: str, action: str, filename: str | None = None) -> dict:
    body = {"filename": filename} if filename else {}
    r = requests.post(f"{url}/slots/0?action={action}", json=body, timeout=300)
    r.raise_for_status()
    return r.json()


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m kvbridge.bench.probes.slot_restore_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--perf", type=Path, default=None, help="perf record -g of the server into this file")
    parser.add_argument("--doc-chars", type=int, default=7000)
    args = parser.parse_args(argv)
    settings = Settings.from_env()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="kvb-slot-probe-") as tmp:
        slot_dir = Path(tmp)
        proc = subprocess.Popen([str(resolve_binary(settings))] + server_args(settings, slot_dir, port),
                                stdout=subprocess.DEVNULL, stderr=open(slot_dir / "server.log", "w"),
                                start_new_session=True)
        try:
            for _ in range(600):
                try:
                    if requests.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                time.sleep(0.2)
            doc = builtin_document()[:args.doc_chars]
            p1 = requests.post(f"{url}/tokenize", json={"content": doc + QUESTION}, timeout=30).json()["tokens"]
            p0 = p1[:len(p1) - args.rows]
            completion(url, p0, 0)
            slot_action(url, "save", "p0.bin")

            def native() -> dict:
                slot_action(url, "erase")
                completion(url, p0, 0)
                return completion(url, p1)

            def restore() -> dict:
                slot_action(url, "erase")
                slot_action(url, "restore", "p0.bin")
                return completion(url, p1)

            def restore_rewritten() -> dict:
                # as KVBridge restores: the restore file written again just before (a mapped slot file)
                path = slot_dir / "p0-rewritten.bin"
                data = (slot_dir / "p0.bin").read_bytes()
                with open(path, "r+b" if path.exists() else "w+b") as f:
                    f.truncate(len(data))
                    with mmap.mmap(f.fileno(), len(data)) as m:
                        m[:] = data
                slot_action(url, "erase")
                slot_action(url, "restore", path.name)
                return completion(url, p1)

            def after_save() -> dict:
                # as KVBridge's previous request left it: the slot saved to a file that is read and deleted
                slot_action(url, "save", "last.bin")
                (slot_dir / "last.bin").read_bytes()
                (slot_dir / "last.bin").unlink()
                slot_action(url, "erase")
                slot_action(url, "restore", "p0.bin")
                return completion(url, p1)

            cases = {"native": native, "restore": restore, "restore, file rewritten": restore_rewritten,
                     "restore after a save": after_save}
            results = {name: [] for name in cases}
            for case in cases.values():   # a warm-up of each
                case()
            recorder = None
            if args.perf:
                args.perf.parent.mkdir(parents=True, exist_ok=True)
                recorder = subprocess.Popen(["perf", "record", "-g", "-F", "999", "-o", str(args.perf), "-p",
                                             str(proc.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(0.5)
            for rep in range(args.reps):   # round robin, so the machine's load falls on every case alike
                for name, case in cases.items():
                    t = case()["timings"]
                    results[name].append((t["prompt_ms"], t["prompt_n"]))
            if recorder is not None:
                recorder.send_signal(signal.SIGINT)
                recorder.wait(60)
            print(f"prompt {len(p1)} tokens, P0 {len(p0)}; llama-server {resolve_binary(settings)}")
            for name, rows in results.items():
                ms = [r[0] for r in rows]
                print(f"{name:24s} prompt_n {sorted({r[1] for r in rows})}  prompt_ms median {statistics.median(ms):7.1f}"
                      f"  all {' '.join(f'{m:.1f}' for m in ms)}")
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
