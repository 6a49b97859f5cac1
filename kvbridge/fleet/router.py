"""vllm-router as the fleet's front: where its binary is, and its command line for a policy.

Checked with vllm-router 0.1.17 (see REFERENCE.md, "Routers in front of several servers"): it asks each
worker for the prompt's token ids (`/v1/chat/completions/render`) under cache_aware and kv_aware, and
under kv_aware subscribes to each worker's ZMQ PUB of KV events, hashing the blocks' token ids itself.
What 0.1.17 accepts, tried against the binary (Docs/Fleet.md, "What the router takes"):
- a static `--kv-event-source` / `--kv-event-replay-source` must be tcp://HOST:PORT ("KV endpoint must be
  tcp://HOST:PORT without credentials or paths"); the sources it discovers itself (GET /get_server_info and
  /kv_event_sources of each worker) and `--pd-kv-events` may be ipc://PATH. The fleet uses discovery, so its
  workers publish on ipc sockets in a folder only this user can enter. Its ZeroMQ (zmq 0.10, libzmq 4.3.4
  vendored without CURVE) has no way to authenticate a TCP publisher.
- `--api-key` is the key it sends (Bearer) on the requests it makes itself: /render, /get_server_info,
  /kv_event_sources. It forwards each client's own Authorization on completions (regular mode) and sends an
  empty `Bearer ` on both legs in PD mode. Its launcher is Python (vllm_router.launch_router), so the fleet
  hands it the key through the environment with `ROUTER_LAUNCHER`, never on a command line.
Its process renames itself "vllm::router": it is stopped by pid, never by name.
"""
from __future__ import annotations

import json
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path

from kvbridge.errors import BadSettings

PINNED = "vllm-router==0.1.17"
PD_BLOCK_SIZE = 16     # 0.1.17 reads PD KV events (--pd-kv-events) in 16-token blocks, not configurable
ROUTER_KEY_VAR = "KVBRIDGE_FLEET_ROUTER_KEY"   # the variable holding the router key (workers and router)
# vllm-router's own entry point with the key read from the environment, so that it is on no command line
# (/proc/PID/cmdline is readable by every local account; /proc/PID/environ only by this user and root)
ROUTER_LAUNCHER = ("import os, sys\n"
                   "from vllm_router.launch_router import launch_router, parse_router_args\n"
                   "args = parse_router_args(sys.argv[1:])\n"
                   f"args.api_key = os.environ.pop({ROUTER_KEY_VAR!r}, '') or None\n"
                   "launch_router(args)\n")


def router_binary() -> Path:
    """The vllm-router beside this Python (the venv's), else one on PATH; BadSettings saying how to install it."""
    beside = Path(sys.executable).parent / "vllm-router"
    if beside.is_file():
        return beside
    found = shutil.which("vllm-router")
    if found:
        return Path(found)
    raise BadSettings(f"`kvbridge fleet` needs the vllm-router binary, found neither beside {sys.executable} "
                      f"nor on PATH: run ./scripts/setup.sh in a checkout, or {sys.executable} -m pip install "
                      f"{PINNED}")


def launcher_python(binary: Path) -> str | None:
    """The Python interpreter of a pip-installed vllm-router entry script (its #! line), else None."""
    try:
        with open(binary, "rb") as script:
            first = script.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    interpreter = first[2:].strip().split(b" ")[0].decode(errors="replace")
    return interpreter if "python" in Path(interpreter).name else None


def router_command(binary: Path, args: list[str], key: str) -> tuple[list[str], dict]:
    """(argv, environment additions) that start the router with `key` as its worker key: through its Python
    launcher with the key in the environment; a router that is no Python entry script (built from source)
    takes it as --api-key, the only way it has, and the key is then readable in /proc/PID/cmdline."""
    python = launcher_python(binary)
    if python is not None:
        return [python, "-c", ROUTER_LAUNCHER, *args], {ROUTER_KEY_VAR: key}
    return [str(binary), *args, "--api-key", key], {}


def router_argv(port: int, prometheus_port: int, policy: str, workers, *, pd: bool,
                log_level: str = "info") -> list[str]:
    """The router's arguments: regular mode lists every worker; PD mode the prefill and decode ones. Under
    kv_aware the router finds each worker's KV events itself (GET /get_server_info, /kv_event_sources, with
    its key): static --kv-event-source takes tcp only, and the workers publish on ipc sockets."""
    argv = ["--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            "--worker-startup-check-interval", "1", "--log-level", log_level]
    if pd:
        argv.append("--vllm-pd-disaggregation")
        for worker in workers:
            argv += ["--prefill" if worker.role == "prefill" else "--decode", worker.url]
    else:
        argv += ["--worker-urls", *(worker.url for worker in workers)]
    if policy == "kv_aware" and pd:    # events of the prefill workers only, in 16-token blocks (PD_BLOCK_SIZE)
        argv += ["--decode-policy", "round_robin"]
        for worker in workers:
            if worker.role == "prefill":
                argv += ["--pd-kv-events", f"{worker.url}={worker.events_url}"]
    return argv


def get_json(url: str, timeout_s: float = 2.0):
    """The JSON a GET returns; None on any HTTP or connection error (the router is not ready yet)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read()
    except (urllib.error.URLError, OSError):
        return None
    try:
        return json.loads(body) if body.strip() else {}
    except ValueError:
        return {}


def lists_workers(router_url: str, worker_urls: list[str]) -> bool:
    """Whether the router's /list_workers ({"urls": [...]} in 0.1.17) names every worker; an unreadable or
    missing answer is no."""
    listed = get_json(f"{router_url}/list_workers")
    if not isinstance(listed, dict) or not isinstance(listed.get("urls"), list):
        return False
    return set(worker_urls) <= set(listed["urls"])
