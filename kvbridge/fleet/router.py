"""vllm-router as the fleet's front: where its binary is, and its command line for a policy.

Checked with vllm-router 0.1.17 (see REFERENCE.md, "Routers in front of several servers"): it asks each
worker for the prompt's token ids (`/v1/chat/completions/render`) under cache_aware and kv_aware, and
under kv_aware subscribes to each worker's ZMQ PUB of KV events (`--kv-event-source URL=ENDPOINT`),
hashing blocks of `--kv-event-block-size` tokens itself. Its process renames itself "vllm::router":
it is stopped by pid, never by name.
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


def router_argv(binary: Path, port: int, prometheus_port: int, policy: str, workers, *, pd: bool,
                block_size: int, model_id: str, log_level: str = "info") -> list[str]:
    """The router's command line: regular mode lists every worker; PD mode the prefill and decode ones."""
    argv = [str(binary), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
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
    elif policy == "kv_aware":
        for worker in workers:
            argv += ["--kv-event-source", f"{worker.url}={worker.events_url}"]
        argv += ["--kv-event-block-size", str(block_size), "--kv-event-model", model_id]
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
    """Whether the router's /list_workers names every worker (True when it answers nothing readable)."""
    listed = get_json(f"{router_url}/list_workers")
    if not isinstance(listed, dict):   # no such endpoint: /health already answered
        return True
    text = json.dumps(listed)
    return all(url in text for url in worker_urls)
