"""Settings checks: what `Settings.validate()` runs; each check returns messages and never raises.

The middle of the settings flow (`.env` + environment -> Settings -> these checks -> messages in
the CLI and GUI). General checks (ranges, cache types, URLs) hold for every engine; the
engine-specific ones are data (`ENGINE_CHECKS`, keyed by registry key), so nothing here branches
on engine names. Messages are written for a person and name the KVB_ variable to change. This
module imports nothing from kvbridge.config at run time (config imports and re-exports it), and
imports the engine registry lazily, on the first validate(), because the registry imports config.
"""
from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from .cloud_presets import CLOUD_PRESETS, CloudPreset
from .envfile import is_variable_name, looks_like_secret

if TYPE_CHECKING:
    from .config import Settings

CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
_DURATION_RE = re.compile(r"-?(?:\d+(?:\.\d+)?(?:ns|us|ms|s|m|h)?)+")


def settings_problems(s: Settings, environ: Mapping[str, str]) -> list[str]:
    """Every check for `s`: the general ones, then those of the engine KVB_ENGINE resolves to."""
    problems = _value_problems(s)
    engine_key, engine_problems = _resolve_engine_key(s.engine)
    problems += engine_problems
    for check in ENGINE_CHECKS.get(engine_key, ()):
        problems += check(s, environ)
    return problems


def url_problem(var: str, url: str) -> str | None:
    """A message when `url` is not http(s)://host[:port][/path], else None."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return f"{var}={url!r} has a bad port; use http://host:port with a port from 1 to 65535"
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url):
        return f"{var}={url!r} is not a URL; use http://host:port or https://host/path"
    if parts.username or parts.password:
        return (f"{var} must not carry a user name or password; "
                "the key goes in the variable named by KVB_CLOUD_API_KEY_ENV")
    if port == 0:
        return f"{var}={url!r} has port 0; use a port from 1 to 65535"
    if parts.query or parts.fragment:
        return f"{var}={url!r} must not have a query or fragment"
    return None


def _value_problems(s: Settings) -> list[str]:
    """Checks that hold whatever the engine: numbers in range, URLs well formed."""
    problems = []
    rules = (
        (s.chunk_size < 1, f"KVB_CHUNK_SIZE={s.chunk_size} must be at least 1 (LMCache uses 256)"),
        (s.chunk_size >= 1 and s.ctx_size < max(64, s.chunk_size),
         f"KVB_CTX_SIZE={s.ctx_size} is too small: it must be at least 64 "
         f"and at least KVB_CHUNK_SIZE ({s.chunk_size})"),
        (s.threads < 0, f"KVB_THREADS={s.threads} cannot be negative (0 means all cores)"),
        (s.n_predict < 1, f"KVB_N_PREDICT={s.n_predict} must be at least 1"),
        (s.l1_bytes < 0, f"KVB_L1_BYTES={s.l1_bytes} cannot be negative"),
        (s.l2_bytes < 0, f"KVB_L2_BYTES={s.l2_bytes} cannot be negative"),
        (not s.host.strip(), "KVB_HOST is empty; use 127.0.0.1 (this machine only) or 0.0.0.0 (all interfaces)"),
        (not 1 <= s.port <= 65535, f"KVB_PORT={s.port} is not a port; use 1 to 65535 (default 7860)"),
        (not 0 <= s.llama_server_port <= 65535,
         f"KVB_LLAMA_SERVER_PORT={s.llama_server_port} is not a port; use 1 to 65535, or 0 for a free one"),
        (s.llama_start_timeout <= 0, f"KVB_LLAMA_START_TIMEOUT={s.llama_start_timeout} must be more than 0 seconds"),
        (s.cloud_token_budget < 0,
         f"KVB_CLOUD_TOKEN_BUDGET={s.cloud_token_budget} cannot be negative (0 means no budget)"),
        (s.cloud_timeout <= 0, f"KVB_CLOUD_TIMEOUT={s.cloud_timeout} must be more than 0 seconds"),
        (s.cloud_max_retries < 0, f"KVB_CLOUD_MAX_RETRIES={s.cloud_max_retries} cannot be negative"),
        (not s.engine.strip(), "KVB_ENGINE is empty; use llamacpp (the default) or another registered engine"),
    )
    problems += [message for failed, message in rules if failed]
    # Variable names spelt out, as in every message here: this module does not import config.
    for var, value in (("KVB_CACHE_TYPE_K", s.cache_type_k), ("KVB_CACHE_TYPE_V", s.cache_type_v)):
        if value not in CACHE_TYPES:
            problems.append(f"{var}={value!r} is not a KV cache type; use one of {', '.join(CACHE_TYPES)}")
    urls = (("KVB_OLLAMA_URL", s.ollama_url), ("KVB_CLOUD_BASE_URL", s.cloud_base_url),
            ("KVB_LLAMA_SERVER_URL", s.llama_server_url))
    for var, value in urls:
        message = url_problem(var, value) if value else None
        if message:
            problems.append(message)
    return problems


def _resolve_engine_key(name: str) -> tuple[str | None, list[str]]:
    """The registry key KVB_ENGINE names, or None and why not. Imported lazily: the registry imports config."""
    if not name.strip():
        return None, []  # reported by _value_problems
    from .errors import UnknownEngineError
    try:
        from .backends import resolve_engine  # registers every built-in engine
    except Exception as error:  # noqa: BLE001 - a broken adapter must not hide the other problems; reported here
        # Engines registered before the failing import still resolve.
        registry = sys.modules.get(f"{__package__}.backends.registry")
        try:
            return registry.resolve_engine(name).key, []
        except (AttributeError, UnknownEngineError):
            names = ", ".join(registry.known_engine_names()) if registry else ""
            return None, [f"KVB_ENGINE={name!r} is not available: the engine adapters did not all import "
                          f"({type(error).__name__}: {error}). Engines that did: {names or 'none'}"]
    try:
        return resolve_engine(name).key, []
    except UnknownEngineError as error:
        return None, [str(error)]


def _check_model_file(s: Settings, environ: Mapping[str, str], *, ollama_model_ok: bool = False) -> list[str]:
    if s.model_path:
        path = Path(s.model_path).expanduser()
        if path.is_file():
            return []
        what = "is a directory, not a model file" if path.is_dir() else "does not exist"
        return [f"KVB_MODEL_PATH={s.model_path} {what}; "
                "point it at a .gguf file or leave it empty for the embedded model"]
    if ollama_model_ok and s.ollama_model:
        return []  # the engine looks the model's GGUF up in KVB_OLLAMA_MODELS
    embedded = s.resolved_model_path()  # the embedded model's path, read from config at call time
    if not embedded.is_file():
        return [f"the embedded model {embedded} is missing; run ./scripts/setup.sh to fetch it, "
                "or set KVB_MODEL_PATH to a .gguf file"]
    return []


def _check_llamacpp(s: Settings, environ: Mapping[str, str]) -> list[str]:
    return _check_model_file(s, environ, ollama_model_ok=True)


def _check_llama_server(s: Settings, environ: Mapping[str, str]) -> list[str]:
    if s.llama_server_url:
        return []  # attaching to a running server: it has its own binary and model
    problems = _check_model_file(s, environ)
    binary = Path(s.llama_server_bin).expanduser() if s.llama_server_bin else None
    if binary is not None and not (binary.is_file() and os.access(binary, os.X_OK)):
        problems.append(f"KVB_LLAMA_SERVER_BIN={s.llama_server_bin} is not an executable file; "
                        "leave it empty to use the one ./scripts/build_llama_server.sh builds")
    return problems


def _check_ollama(s: Settings, environ: Mapping[str, str]) -> list[str]:
    problems = []
    if not s.ollama_url:
        problems.append("KVB_OLLAMA_URL is empty; Ollama listens on http://127.0.0.1:11434 by default")
    if not s.ollama_model:
        problems.append("KVB_OLLAMA_MODEL is empty; name a model you have pulled (see `ollama list`), e.g. llama3.2")
    if not _DURATION_RE.fullmatch(s.ollama_keep_alive.strip()):
        problems.append(f"KVB_OLLAMA_KEEP_ALIVE={s.ollama_keep_alive!r} is not a duration; use e.g. 5m, 1h, 0 or -1")
    return problems


def _check_cloud(s: Settings, environ: Mapping[str, str]) -> list[str]:
    problems = []
    known = ", ".join(CLOUD_PRESETS)
    preset = s.cloud_preset()
    if s.cloud_provider and preset is None:
        problems.append(f"KVB_CLOUD_PROVIDER={s.cloud_provider!r} is not a known provider; use one of {known}, "
                        "or leave it empty and set KVB_CLOUD_BASE_URL")
    elif not s.cloud_provider and not s.cloud_base_url:
        problems.append(f"the cloud engine needs KVB_CLOUD_PROVIDER (one of {known}) or KVB_CLOUD_BASE_URL "
                        "(any OpenAI-compatible server, e.g. http://127.0.0.1:8080/v1)")
    if not s.resolved_cloud_model():
        problems.append("KVB_CLOUD_MODEL is empty; name the model to call (a llama-server accepts any name)")
    problems += _key_variable_problems(s, environ, preset)
    problems += _extra_header_problems(s.cloud_extra_headers)
    return problems


def _key_variable_problems(s: Settings, environ: Mapping[str, str], preset: CloudPreset | None) -> list[str]:
    _, key_env = s.cloud_endpoint()
    if not key_env:
        return []
    if not is_variable_name(key_env) or looks_like_secret(key_env):
        # never echo it: it may be the key itself
        return ["KVB_CLOUD_API_KEY_ENV must be the NAME of an environment variable (like OPENAI_API_KEY), "
                "not the key itself"]
    if environ.get(key_env):
        return []
    where = "KVB_CLOUD_API_KEY_ENV names" if s.cloud_api_key_env else \
        f"the {preset.label if preset else 'cloud'} preset (KVB_CLOUD_PROVIDER) reads its key from"
    return [f"{where} {key_env} but that variable is not set; export it in your shell "
            "(KVBridge reads keys only from the environment, never from files)"]


def _extra_header_problems(text: str) -> list[str]:
    if not text.strip():
        return []
    try:
        headers = json.loads(text)
    except ValueError:
        headers = None
    if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        return ['KVB_CLOUD_EXTRA_HEADERS is not a JSON object of strings; use e.g. {"X-Title": "kvbridge"}']
    if looks_like_secret(text):
        return ["KVB_CLOUD_EXTRA_HEADERS seems to carry a key or token; keys go in the variable named by "
                "KVB_CLOUD_API_KEY_ENV"]
    return []


# Which checks each engine needs, by registry key. An engine not listed gets the general checks only.
ENGINE_CHECKS: dict[str, tuple[Callable[[Settings, Mapping[str, str]], list[str]], ...]] = {
    "llamacpp": (_check_llamacpp,),
    "llama-server": (_check_llama_server,),
    "ollama": (_check_ollama,),
    "cloud": (_check_cloud,),
}
