"""Settings: one typed, frozen object built once from the environment and `.env`, passed in explicitly.

Every variable is prefixed KVB_. Nothing deeper in KVBridge reads os.environ, except the cloud
backend reading the API key from the variable *named* by KVB_CLOUD_API_KEY_ENV.

Reading never raises: a value that does not parse keeps its default and becomes one of the
problems `validate()` lists, written for a person and naming the variable. Engine-specific checks
are data (`ENGINE_CHECKS`, keyed by registry key), so nothing here branches on engine names.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import get_type_hints
from urllib.parse import urlsplit

from dotenv import dotenv_values

from .errors import BadSettings

PROJECT_ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_PATH = PROJECT_ROOT / "models" / EMBEDDED_MODEL_FILE
DEFAULT_ENV_FILE = PROJECT_ROOT / ".env"


@dataclass(frozen=True)
class CloudPreset:
    """An OpenAI-compatible provider: where it is and which variable usually holds its key."""

    key: str
    label: str
    base_url: str
    key_env: str         # default name of the variable holding the key; "" when none is needed
    default_model: str   # "" when the server decides (local servers)
    notes: str = ""


CLOUD_PRESETS: dict[str, CloudPreset] = {p.key: p for p in (
    CloudPreset("openai", "OpenAI", "https://api.openai.com/v1", "OPENAI_API_KEY", "gpt-4.1-mini",
                "cached_tokens from 1024-token prompts, in 128-token steps"),
    CloudPreset("groq", "Groq", "https://api.groq.com/openai/v1", "GROQ_API_KEY", "llama-3.1-8b-instant",
                "usage.prompt_tokens_details.cached_tokens"),
    CloudPreset("openrouter", "OpenRouter", "https://openrouter.ai/api/v1", "OPENROUTER_API_KEY",
                "openai/gpt-4.1-mini", "cached_tokens depends on the upstream provider"),
    CloudPreset("together", "Together AI", "https://api.together.xyz/v1", "TOGETHER_API_KEY",
                "meta-llama/Llama-3.3-70B-Instruct-Turbo", "may report no cached-token count"),
    CloudPreset("mistral", "Mistral", "https://api.mistral.ai/v1", "MISTRAL_API_KEY", "mistral-small-latest",
                "may report no cached-token count"),
    CloudPreset("deepseek", "DeepSeek", "https://api.deepseek.com/v1", "DEEPSEEK_API_KEY", "deepseek-chat",
                "usage.prompt_cache_hit_tokens"),
    CloudPreset("vllm", "vLLM (local)", "http://127.0.0.1:8000/v1", "", "",
                "set KVB_CLOUD_MODEL to the served model; prefix caching must be on"),
    CloudPreset("lmstudio", "LM Studio (local)", "http://127.0.0.1:1234/v1", "", "",
                "set KVB_CLOUD_MODEL to the loaded model"),
    CloudPreset("ollama-local-openai", "Ollama, OpenAI API (local)", "http://127.0.0.1:11434/v1", "", "",
                "set KVB_CLOUD_MODEL to a pulled model; reports no cached-token count"),
)}

# (field name, message) pairs from parsing; kept out of ==, hash and repr.
Problems = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Settings:
    # engine choice (a key or alias from kvbridge.backends' registry)
    engine: str = "llamacpp"
    # llama.cpp (in-process and llama-server)
    model_path: str = ""              # empty: the embedded SmolLM2 (or the Ollama model's GGUF, see ollama_model)
    ctx_size: int = 4096
    threads: int = 0                  # 0: os.cpu_count()
    flash_attn: bool = False          # changes the V layout (not transposed) and so the namespace
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    n_predict: int = 32
    # chunking and the store
    chunk_size: int = 256
    l1_bytes: int = 1 << 30
    l2_dir: str = str(Path("~/.cache/kvbridge/l2").expanduser())
    l2_bytes: int = 8 << 30
    l2_enabled: bool = True
    prefer_lmcache_hasher: bool = False
    # GUI
    host: str = "127.0.0.1"
    port: int = 7860
    input_dir: str = str(PROJECT_ROOT / "input")
    output_dir: str = str(PROJECT_ROOT / "output")
    # llama-server
    llama_server_bin: str = ""        # empty: the binary scripts/build_llama_server.sh built
    llama_server_url: str = ""        # set: attach to a running server instead of starting one
    llama_server_port: int = 0        # 0: a free port
    llama_start_timeout: float = 60.0
    # Ollama
    ollama_url: str = "http://127.0.0.1:11434"
    ollama_model: str = ""
    ollama_keep_alive: str = "5m"
    ollama_models: str = str(Path("~/.ollama/models").expanduser())
    # OpenAI-compatible cloud
    cloud_provider: str = ""
    cloud_base_url: str = ""
    cloud_model: str = ""
    cloud_api_key_env: str = ""       # the NAME of the variable holding the key; never the key
    cloud_extra_headers: str = ""     # JSON object
    cloud_token_budget: int = 0       # 0: no budget
    cloud_timeout: float = 60.0
    cloud_max_retries: int = 3
    # parse problems, reported by validate(); not a setting
    _problems: Problems = field(default=(), compare=False, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, env_file: str | Path | None = None) -> "Settings":
        """Build from `.env` (python-dotenv) overlaid by the environment; the environment wins.

        env: the environment to read (default os.environ); env_file: default PROJECT_ROOT/.env.
        Never raises for a bad value: it keeps the default and validate() reports it.
        """
        environ = os.environ if env is None else env
        path = DEFAULT_ENV_FILE if env_file is None else Path(env_file).expanduser()
        problems: list[tuple[str, str]] = []
        file_values: dict[str, str] = {}
        if path.is_file():
            try:
                file_values = {k: v for k, v in dotenv_values(path).items() if v is not None}
            except (OSError, UnicodeDecodeError) as error:
                problems.append(("", f"cannot read the settings file {path}: {error}"))
        elif env_file is not None:
            problems.append(("", f"the settings file {path} {'is not a file' if path.exists() else 'does not exist'}"))
        values = {**file_values, **{k: v for k, v in environ.items() if k.startswith("KVB_")}}

        kwargs = {}
        for f in setting_fields():
            raw = values.get(env_name(f.name))
            if raw is None:
                continue
            try:
                parsed = _parse_value(f.name, raw)
            except ValueError as error:
                problems.append((f.name, str(error)))
                continue
            if parsed is not None:
                kwargs[f.name] = parsed
        problems += [("", msg) for msg in _misspelt_names(values)]
        return cls(**kwargs, _problems=tuple(problems))

    def replace(self, **changes) -> "Settings":
        """A copy with some fields changed; parse problems of the changed fields are dropped."""
        kept = tuple(p for p in self._problems if p[0] not in changes)
        return dataclasses.replace(self, **changes, _problems=kept)

    def validate(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """Problems written for a person; empty when the settings are usable. Never raises.

        environ: where the API key variable is looked for (default os.environ, as the cloud engine does).
        """
        environ = os.environ if environ is None else environ
        problems = [message for _, message in self._problems]
        problems += _value_problems(self)
        engine_key, engine_problems = _resolve_engine_key(self.engine)
        problems += engine_problems
        for check in ENGINE_CHECKS.get(engine_key, ()):
            problems += check(self, environ)
        return problems

    def resolved_threads(self) -> int:
        return self.threads or max(1, os.cpu_count() or 1)

    def resolved_model_path(self) -> Path:
        """KVB_MODEL_PATH, else the embedded SmolLM2 (the llamacpp engine may also try the Ollama model)."""
        return Path(self.model_path).expanduser() if self.model_path else EMBEDDED_MODEL_PATH

    def cloud_preset(self) -> CloudPreset | None:
        return CLOUD_PRESETS.get(self.cloud_provider.strip().lower())

    def cloud_endpoint(self) -> tuple[str, str]:
        """(base URL, name of the key variable): explicit KVB_CLOUD_BASE_URL / _API_KEY_ENV win over the preset."""
        preset = self.cloud_preset()
        base_url = self.cloud_base_url or (preset.base_url if preset else "")
        key_env = self.cloud_api_key_env or (preset.key_env if preset else "")
        return base_url.rstrip("/"), key_env

    def resolved_cloud_model(self) -> str:
        preset = self.cloud_preset()
        return self.cloud_model or (preset.default_model if preset else "")


def env_name(field_name: str) -> str:
    """Settings field -> its KVB_ variable."""
    return "KVB_" + field_name.upper()


def setting_fields() -> list[dataclasses.Field]:
    """The public Settings fields (one KVB_ variable each)."""
    return [f for f in fields(Settings) if not f.name.startswith("_")]


SETTING_NAMES = [f.name for f in setting_fields()]
SIZE_FIELDS = tuple(n for n in SETTING_NAMES if n.endswith("_bytes"))
PATH_FIELDS = ("model_path", "l2_dir", "input_dir", "output_dir", "llama_server_bin", "ollama_models")
URL_FIELDS = ("ollama_url", "cloud_base_url", "llama_server_url")
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
_FIELD_TYPES = get_type_hints(Settings)

# ---------------------------------------------------------------------------------------------
# parsing: text -> typed value, or ValueError with the message validate() will show


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_SIZE_RE = re.compile(r"(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]*)", re.IGNORECASE)
# A bare letter (k, m, g, t) is binary, as in docker and java -Xmx; kB/MB/GB/TB are decimal.
_SIZE_UNITS = {"": 1, "b": 1, **{
    spelling: factor
    for power, letter in enumerate("kmgt", start=1)
    for spelling, factor in (
        (letter, 1024**power), (letter + "i", 1024**power), (letter + "ib", 1024**power), (letter + "b", 1000**power),
    )
}}


def parse_size(text: str) -> int:
    """'512MiB', '2GiB', '1.5GB', '64k', '1000000' -> bytes. ValueError when it is not a size."""
    match = _SIZE_RE.fullmatch(text.strip().replace("_", ""))
    unit = match and _SIZE_UNITS.get(match["unit"].lower())
    if not unit:
        raise ValueError(text)
    try:
        return int(Decimal(match["number"]) * unit)
    except InvalidOperation as error:
        raise ValueError(text) from error


def format_size(n_bytes: int) -> str:
    """Bytes -> the shortest exact binary spelling parse_size() reads back ('1GiB', '512MiB', '1000')."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n_bytes and n_bytes % factor == 0:
            return f"{n_bytes // factor}{unit}"
    return str(n_bytes)


def _parse_value(name: str, raw: str) -> object:
    """One KVB_ value -> the field's type; None (for an empty value) keeps the default."""
    text = raw.strip()
    kind = _FIELD_TYPES[name]
    var = env_name(name)
    if not text:
        return None
    if kind is str:
        return os.path.expanduser(text) if name in PATH_FIELDS else text
    if name in SIZE_FIELDS:
        try:
            return parse_size(text)
        except ValueError:
            raise ValueError(
                f"{var}={raw!r} is not a size; use a number of bytes or a value like 512MiB or 2GiB") from None
    if kind is bool:
        if text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"{var}={raw!r} is not a yes/no value; use true/false, yes/no, on/off or 1/0")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{var}={raw!r} is not a whole number") from None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"{var}={raw!r} is not a number; use seconds like 60 or 2.5")
    return value


def _misspelt_names(values: Mapping[str, str]) -> list[str]:
    """KVB_ variables that are no setting but look like one: almost always a typo."""
    known = [env_name(n) for n in SETTING_NAMES]
    problems = []
    for name in sorted(n for n in values if n.startswith("KVB_") and n not in known):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
        if close:
            problems.append(f"{name} is not a KVBridge setting; did you mean {close[0]}?")
    return problems


# ---------------------------------------------------------------------------------------------
# validation: every check returns a list of messages and never raises

_KEY_VAR_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DURATION_RE = re.compile(r"-?(?:\d+(?:\.\d+)?(?:ns|us|ms|s|m|h)?)+")


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
    for name in ("cache_type_k", "cache_type_v"):
        if getattr(s, name) not in CACHE_TYPES:
            problems.append(f"{env_name(name)}={getattr(s, name)!r} is not a KV cache type; "
                            f"use one of {', '.join(CACHE_TYPES)}")
    for name in URL_FIELDS:
        value = getattr(s, name)
        message = url_problem(env_name(name), value) if value else None
        if message:
            problems.append(message)
    return problems


def _resolve_engine_key(name: str) -> tuple[str | None, list[str]]:
    """The registry key KVB_ENGINE names, or None and why not. Imported here: the registry imports us."""
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
    if not EMBEDDED_MODEL_PATH.is_file():
        return [f"the embedded model {EMBEDDED_MODEL_PATH} is missing; run ./scripts/setup.sh to fetch it, "
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
    if not _KEY_VAR_RE.fullmatch(key_env) or looks_like_secret(key_env):
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

# ---------------------------------------------------------------------------------------------
# writing .env: only KVB_ settings, never a secret

_SECRET_NAME_SUFFIXES = ("_API_KEY", "_KEY", "_TOKEN", "_SECRET", "_PASSWORD")
_NOT_SECRET_NAMES = frozenset({"KVB_CLOUD_API_KEY_ENV", "KVB_CLOUD_TOKEN_BUDGET"})
_SECRET_VALUE_RE = re.compile(
    r"\bsk-[A-Za-z0-9_-]{8,}|\bsk_(?:live|test)_\w{8,}|\bgsk_\w{8,}|(?i:\bbearer\s+\S)|\bhf_[A-Za-z0-9]{16,}"
    r"|\bxai-[A-Za-z0-9]{16,}|\bgh[pousr]_[A-Za-z0-9]{16,}|\bgithub_pat_\w{16,}|\bAKIA[0-9A-Z]{16}\b|\bAIza[\w-]{30,}"
)
_ENV_NAME_RE = re.compile(r"KVB_[A-Z0-9_]+")
_ASSIGNMENT_RE = re.compile(
    r"(?P<lead>[ \t]*(?:export[ \t]+)?)(?P<key>[A-Za-z_][A-Za-z0-9_.]*)[ \t]*=[ \t]*"
    r"""(?P<value>'(?:\\.|[^'\\])*'|"(?:\\.|[^"\\])*"|[^\r\n]*?)(?P<comment>[ \t]+#[^\r\n]*)?[ \t]*(?P<eol>\r?\n)?"""
)
_BARE_VALUE_RE = re.compile(r"[\w./:@,+~%-]*")


def looks_like_secret(value: str) -> bool:
    """True for text shaped like an API key or a bearer token (sk-..., gsk_..., 'Bearer ...')."""
    return bool(_SECRET_VALUE_RE.search(value))


def update_env_file(path: str | Path, changes: Mapping[str, str]) -> None:
    """Set the given KVB_ keys in a .env file, keeping comments, blank lines, order and other keys.

    Keys not present are appended; the file is created if missing and replaced atomically.
    Raises BadSettings for anything that is not a KVB_ setting or looks like an API key.
    """
    for key, value in changes.items():
        _refuse_unsafe(key, value)
    path = Path(os.path.realpath(Path(path).expanduser()))  # write through a symlinked .env
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.exists() else []
    except (OSError, UnicodeDecodeError) as error:
        raise BadSettings(f"cannot read {path}: {error}") from error
    pending = dict(changes)
    out = []
    for line in lines:
        match = _ASSIGNMENT_RE.fullmatch(line)
        if match and match["key"] in changes:
            key = match["key"]
            out.append(f"{match['lead']}{key}={_quote(changes[key])}{match['comment'] or ''}{match['eol'] or ''}")
            pending.pop(key, None)
        else:
            out.append(line)
    if out and not out[-1].endswith("\n"):
        out[-1] += "\n"
    out += [f"{key}={_quote(value)}\n" for key, value in pending.items()]
    _atomic_write(path, "".join(out))


def settings_to_env(settings: Settings, only_changed: bool = False) -> dict[str, str]:
    """Settings -> {KVB_NAME: text} as update_env_file() writes it (for the GUI's Save button)."""
    defaults = Settings()
    env = {}
    for f in setting_fields():
        value = getattr(settings, f.name)
        if only_changed and value == getattr(defaults, f.name):
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif f.name in SIZE_FIELDS:
            text = format_size(value)
        elif isinstance(value, float):
            text = repr(value)
        else:
            text = str(value)
        env[env_name(f.name)] = text
    return env


def _refuse_unsafe(key: str, value: str) -> None:
    if not isinstance(key, str) or not _ENV_NAME_RE.fullmatch(key):
        raise BadSettings(f"refusing to write {key!r} to .env: only KVB_ settings are written there")
    if key not in _NOT_SECRET_NAMES and key.endswith(_SECRET_NAME_SUFFIXES):
        raise BadSettings(f"refusing to write {key} to .env: API keys stay in your shell; set "
                          "KVB_CLOUD_API_KEY_ENV to the NAME of the variable that holds the key")
    if not isinstance(value, str):
        raise BadSettings(f"{key}: the value must be text, got {type(value).__name__}")
    if looks_like_secret(value) or (key == "KVB_CLOUD_API_KEY_ENV" and value and not _KEY_VAR_RE.fullmatch(value)):
        raise BadSettings(f"refusing to write {key}: the value looks like an API key or token; keys stay in your "
                          "shell and KVB_CLOUD_API_KEY_ENV holds only the variable's NAME")
    if "\n" in value or "\r" in value:
        raise BadSettings(f"{key}: the value must be a single line")


def _quote(value: str) -> str:
    """Bare when safe, else single quotes (python-dotenv unescapes \\\\ and \\' inside them)."""
    if _BARE_VALUE_RE.fullmatch(value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _atomic_write(path: Path, text: str) -> None:
    """Temp file in the same folder, fsync, rename: a reader sees the old file or the new one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o600
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise BadSettings(f"cannot write {path}: {error.strerror or error}") from error
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as error:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise BadSettings(f"cannot write {path}: {error.strerror or error}") from error
