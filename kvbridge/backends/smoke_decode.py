#!/usr/bin/env python3
"""Smoke decode: does this llama.cpp build actually run on this CPU?

A CPU can advertise instructions its hypervisor will not execute (AMX tiles on some cloud VMs):
a build made with -march=native then dies at its first decode. So after every build,
scripts/build_variants.py runs this script as a child process and reads its fate:

    smoke_decode.py llama  --model M [--variant V]            load M with llama-cpp-python, decode
    smoke_decode.py server --model M --binary B [--variant V]  start llama-server B on loopback,
                                                                one /completion, stop it

Exit 0 and one JSON line on stdout: the build runs. Death by a signal, a hang, or exit 1: the build
does not run here (the parent steps down its ladder). Exit 3: the environment is wrong (llama_cpp
not importable, no model file), which no other instruction set would fix.

Test hook: KVB_SMOKE_CRASH_VARIANTS=claimed,no-amx makes the decode of those variants die by a
real SIGILL (in llama mode this process, in server mode the llama-server process), so the
fallback can be tested on a CPU that runs every instruction it claims. Never set it otherwise.

Imports only the standard library and llama_cpp: it must not depend on the package it vets.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

PROMPT = "The capital of France is"
N_PREDICT = 8
EXIT_DOES_NOT_RUN = 1
EXIT_ENVIRONMENT = 3
CRASH_HOOK_VAR = "KVB_SMOKE_CRASH_VARIANTS"


def crash_hook_variants() -> set[str]:
    """Variant names the test hook should crash (see the module docstring)."""
    return {name.strip() for name in os.environ.get(CRASH_HOOK_VAR, "").split(",") if name.strip()}


def no_core_files() -> None:
    """A crash here is an expected outcome, not something to debug: leave no core file behind."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def loaded_library(fragment: str) -> str:
    """Path of the first mapped shared object whose name contains fragment (Linux), else ''."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split(maxsplit=5)[-1] if len(line.split()) >= 6 else ""
            if fragment in Path(path).name:
                return path
    except OSError:
        pass
    return ""


def smoke_llama(model: Path, variant: str) -> int:
    """Load the model in-process and decode a prompt plus a few greedy tokens."""
    try:
        import llama_cpp
    except ImportError as error:
        print(f"llama_cpp cannot be imported: {error}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    if not model.is_file():
        print(f"model file {model} not found", file=sys.stderr)
        return EXIT_ENVIRONMENT
    start = time.perf_counter()
    try:
        llm = llama_cpp.Llama(model_path=str(model), n_ctx=256, n_batch=64, seed=0, verbose=False)
    except ValueError as error:   # llama.cpp refused the file (an architecture or tensor it does not know):
        print(f"llama.cpp could not load {model}: {error}", file=sys.stderr)   # the model's fault, not the build's
        return EXIT_ENVIRONMENT
    if variant in crash_hook_variants():
        no_core_files()
        os.kill(os.getpid(), signal.SIGILL)  # where a real AMX build dies: the first decode
    out = llm.create_completion(PROMPT, max_tokens=N_PREDICT, temperature=0.0)
    print(json.dumps({"engine": "llama-cpp-python", "variant": variant, "text": out["choices"][0]["text"],
                      "seconds": round(time.perf_counter() - start, 2),
                      "libggml_cpu": loaded_library("libggml-cpu")}))
    return 0


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_json(url: str, body: dict | None, timeout: float) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"died by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


def smoke_server(model: Path, binary: Path, variant: str, timeout: float) -> int:
    """Start llama-server on a loopback port, run one greedy /completion, stop it."""
    for path, what in ((binary, "llama-server binary"), (model, "model file")):
        if not path.is_file():
            print(f"{what} {path} not found", file=sys.stderr)
            return EXIT_ENVIRONMENT
    port = free_loopback_port()
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "256", "-np", "1"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              preexec_fn=no_core_files)
    base, deadline, start = f"http://127.0.0.1:{port}", time.monotonic() + timeout, time.perf_counter()
    try:
        while True:
            if server.poll() is not None:
                return report_server_death(server, "while loading the model")
            try:
                if http_json(f"{base}/health", None, timeout=2).get("status") == "ok":
                    break
            except (urllib.error.URLError, OSError, ValueError):
                pass  # not listening yet, or still loading (503)
            if time.monotonic() > deadline:
                print(f"llama-server was not healthy within {timeout:.0f} s", file=sys.stderr)
                return EXIT_DOES_NOT_RUN
            time.sleep(0.2)
        if variant in crash_hook_variants():
            os.kill(server.pid, signal.SIGILL)
        try:
            out = http_json(f"{base}/completion", {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0,
                                                   "cache_prompt": False},
                            timeout=max(1.0, deadline - time.monotonic()))
        except (urllib.error.URLError, OSError, ValueError) as error:
            try:
                server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                print(f"/completion failed ({error}) and llama-server is still running", file=sys.stderr)
                return EXIT_DOES_NOT_RUN
            return report_server_death(server, "during the first decode")
        print(json.dumps({"engine": "llama-server", "variant": variant, "text": out.get("content", ""),
                          "seconds": round(time.perf_counter() - start, 2)}))
        return 0
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def report_server_death(server: subprocess.Popen, when: str) -> int:
    tail = (server.stderr.read() if server.stderr else "").strip().splitlines()[-3:]
    print(f"llama-server {describe_exit(server.returncode)} {when}" + "".join(f"\n  {t}" for t in tail),
          file=sys.stderr)
    return EXIT_DOES_NOT_RUN


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)   # run by path: no kvbridge import, no short flags
    parser.add_argument("engine", choices=("llama", "server"))
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--variant", default="", help="build variant name (for the test hook and the report)")
    parser.add_argument("--binary", type=Path, help="llama-server binary (server mode)")
    parser.add_argument("--timeout", type=float, default=120.0, help="server mode: seconds for load + decode")
    args = parser.parse_args(argv)
    if args.engine == "llama":
        return smoke_llama(args.model, args.variant)
    if args.binary is None:
        parser.error("server mode needs --binary")
    return smoke_server(args.model, args.binary, args.variant, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
