"""From Settings to a llama-server to talk to: our own child process, or one the user runs.

Place in the flow: LlamaServerBackend.start() -> **start_own_server() or attach_to()** -> /props ->
the engine is ready. The child process itself (its group, its private directory, no orphans) is
ServerProcess in kvbridge.backends.llama_server.process; this module chooses its binary and arguments.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import requests

from kvbridge.settings import Settings
from kvbridge.errors import EngineUnavailable
from kvbridge.formats.architectures import ModelTraits
from kvbridge.backends.llama_server.process import (
    ServerProcess, build_advice, built_binary, free_port, pinned_llama_cpp_version, port_is_free)
from kvbridge.backends.base import BATCH_TOKENS
from kvbridge.backends.llama_cpp_model import check_model_file, ggml_type_id, model_path_for


def start_own_server(settings: Settings, traits_of: Callable[[Path], ModelTraits]) -> tuple[ServerProcess, Path, Path]:
    """Start our own healthy llama-server (one slot, no RAM prompt cache); returns (server, binary, model)."""
    binary = resolve_binary(settings)
    model = model_path_for(settings)
    check_model_file(model)
    ggml_type_id(settings.cache_type_k, "KVB_CACHE_TYPE_K")
    ggml_type_id(settings.cache_type_v, "KVB_CACHE_TYPE_V")
    chosen_port = settings.llama_server_port
    if chosen_port and not port_is_free(chosen_port):
        raise EngineUnavailable(
            f"Port {chosen_port} on 127.0.0.1 is already in use (KVB_LLAMA_SERVER_PORT); "
            f"choose another port or 0 for any free one.")
    threads = str(settings.resolved_threads())
    args = [
        "--model", str(model), "--ctx-size", str(settings.ctx_size),
        "--threads", threads, "--threads-batch", threads,
        "--parallel", "1", "--cache-ram", "0",
        "--flash-attn", "on" if settings.flash_attn else "off",
        "--cache-type-k", settings.cache_type_k.lower(),
        "--cache-type-v", settings.cache_type_v.lower(),
        # the in-process engine's batch sizes, so both evaluate prompts the same way
        "--batch-size", str(BATCH_TOKENS), "--ubatch-size", str(BATCH_TOKENS),
        "--no-webui", "--no-warmup",
    ]
    if traits_of(model).n_swa:
        # every cell of the sliding-window cache is kept, so earlier window rows can be captured
        # (capture_window) and the server trims a restored prompt like any other (see Docs/Models.md)
        args.append("--swa-full")
    for attempt in (1, 2):
        server = ServerProcess(binary, args, "127.0.0.1", chosen_port or free_port())
        server.start()
        try:
            server.wait_healthy(settings.llama_start_timeout)
            break
        except EngineUnavailable as exc:
            # a free port can be taken between our probe and the server's bind: try another once
            if chosen_port or attempt == 2 or "KVB_LLAMA_SERVER_PORT" not in str(exc):
                raise
    return server, binary, model


def resolve_binary(settings: Settings) -> Path:
    """KVB_LLAMA_SERVER_BIN, else the build of the pinned llama.cpp; an error says how to get one."""
    if settings.llama_server_bin:
        binary = Path(settings.llama_server_bin).expanduser()
        where = f"KVB_LLAMA_SERVER_BIN={settings.llama_server_bin}"
    else:
        binary = built_binary(pinned_llama_cpp_version())
        where = "the default build location; KVB_LLAMA_SERVER_BIN can point at another binary"
    if not binary.is_file():
        raise EngineUnavailable(f"llama-server binary {binary} does not exist ({where}). "
                                f"{build_advice()}.")
    if not binary.stat().st_mode & 0o111:
        raise EngineUnavailable(f"llama-server binary {binary} is not executable ({where}).")
    return binary


def attach_to(http: requests.Session, url: str, settings: Settings) -> Path | None:
    """Check that the server at `url` is healthy; returns its slot directory when it is on this machine."""
    try:
        ok = http.get(f"{url}/health", timeout=5).status_code == 200
    except requests.RequestException as exc:
        raise EngineUnavailable(f"No llama-server answers at {url} (KVB_LLAMA_SERVER_URL): {exc}") from exc
    if not ok:
        raise EngineUnavailable(f"llama-server at {url} (KVB_LLAMA_SERVER_URL) is not healthy (still loading?).")
    slot_dir = settings.llama_server_slot_dir
    if slot_dir and not Path(slot_dir).expanduser().is_dir():
        raise EngineUnavailable(f"KVB_LLAMA_SERVER_SLOT_DIR={slot_dir} is not a directory on this machine.")
    return Path(slot_dir).expanduser() if slot_dir else None
