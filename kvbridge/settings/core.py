"""Settings: one typed, frozen object built once from the environment and `.env`, passed in explicitly.

The start of every run: the CLI and the GUI call `Settings.from_env()` once and hand the object to
the engine, the store and the backends. Every variable is prefixed KVB_. Nothing deeper in
KVBridge reads os.environ, except an engine reading a key from the variable *named* by a `*_ENV`
setting. Reading never raises: a value that does not parse keeps its default and becomes one of
the problems `validate()` lists. This module holds the fields, the parsing of text into values
(sizes, yes/no, numbers) and back (`settings_to_env`); the general checks live in
kvbridge.settings.checks, each engine's own on its Backend class, the `.env` writer in
kvbridge.settings.envfile and the providers in kvbridge.settings.presets.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import get_type_hints

from dotenv import dotenv_values

from kvbridge.settings.checks import settings_problems
from kvbridge.settings.models import DEFAULT_MODEL, EMBEDDED_MODELS
from kvbridge.settings.paths import DEFAULT_ENV_FILE, WORK_DIR
from kvbridge.settings.presets import CLOUD_PRESETS, CloudPreset
from kvbridge.settings.redact import HIDDEN, hidden_values, may_show, scrub

EMBEDDED_MODEL_FILE = EMBEDDED_MODELS[DEFAULT_MODEL].file     # the default embedded model (SmolLM2)
EMBEDDED_MODEL_PATH = EMBEDDED_MODELS[DEFAULT_MODEL].path
ENV_FILE_VARIABLE = "KVB_ENV_FILE"   # names the settings file explicitly; else DEFAULT_ENV_FILE (kvbridge.settings.paths)

# (field name, message) pairs from parsing; kept out of ==, hash and repr.
Problems = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Settings:
    # engine choice (a key or alias from kvbridge.backends' registry)
    engine: str = "llamacpp"
    # llama.cpp (in-process and llama-server)
    model: str = "smollm2-135m"       # the embedded model (kvbridge.settings.models) when no model_path / Ollama model
    model_path: str = ""              # empty: the Ollama model's GGUF (ollama_model), else the embedded `model`
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
    l2_serde: str = "raw"             # how L2 stores KV: raw, zstd (lossless), int8 (lossy: part of the namespace)
    # L3: a Redis / Valkey server or Redis Cluster shared by hosts (empty: none)
    l3_url: str = ""                  # redis://, rediss://, unix://, valkey://, redis-cluster://h:p[,h:p...]
    l3_password_env: str = ""         # the NAME of the variable holding the password; never the password
    l3_prefix: str = "kvb"            # every key KVBridge writes starts with "<prefix>:"
    l3_timeout: float = 2.0           # seconds any one L3 call may take before it is a miss
    l3_ttl: float = 0.0               # seconds an L3 object lives; 0: until the server evicts it
    l3_serde: str = "raw"
    l3_write_queue: int = 64          # objects waiting to be written to L3 behind the request
    # S3: an object store shared by hosts (SeaweedFS, AWS S3, R2, MinIO...; kvbridge.store.s3_tier; empty: none)
    s3_url: str = ""                  # the endpoint, http(s)://host:port; never credentials in it
    s3_bucket: str = "kvbridge"
    s3_prefix: str = "kvb"            # every object KVBridge writes is under "<prefix>/"
    s3_region: str = "us-east-1"
    s3_bytes: int = 64 << 30          # the budget of everything under the prefix, shared by every host writing there
    s3_write_queue: int = 64          # objects waiting to be written to S3 behind the request
    s3_timeout: float = 5.0           # seconds any one S3 call may take before it is a miss
    s3_serde: str = "raw"
    s3_access_key_env: str = ""       # the NAME of the variable holding the access key id; never the key
    s3_secret_key_env: str = ""       # the NAME of the variable holding the secret access key; never the key
    s3_order: str = "after-l3"        # where S3 sits when L3 is set too: after-l3 or before-l3
    inflight_wait_ms: int = 250       # a lookup reads a write not landed yet: queued bytes at once, another writer's <= this; 0: off
    zstd_level: int = 3               # the zstd codec's level (1 fast .. 19 small)
    prefer_lmcache_hasher: bool = False
    # why a prompt was recomputed (kvbridge.engine.misses)
    explain_misses: bool = True       # name the cause of every miss (one store call on a miss, none on a hit)
    eviction_history: int = 4096      # evictions each store remembers (at least 4096), so a miss can name its eviction
    # blend mode (kvbridge.blend): retrieved passages reused wherever they stand in the prompt
    blend_separator: str = "[KVB_SEP]"   # cuts a prompt into instruction, passages, question (in every mode)
    blend_recompute_tokens: int = 4      # tokens of each reused passage after the first recomputed in context (Research §16)
    blend_recompute_at: str = "end"      # which ones: "end" (its last tokens), "start" (its first, as EPIC) or "deviation"
    blend_recompute_ratio: float = 0.05  # above 0: that share of the reused tokens instead (wins over the token count)
    blend_select_layers: int = 3         # deviation: layers the selection pass computes (compares at the last)
    blend_gate: float = 0.0              # deviation: above 0, a prompt whose kept tokens deviate more runs as prefix reuse
    # the scheduler (kvbridge.scheduler): many requests on one llama.cpp context
    sched_kv_cells: int = 8192        # the unified KV cache: the KV budget of every request together
    sched_max_running: int = 4        # sequences decoding at once
    sched_cached_prefixes: int = 4    # finished prompts kept resident for sharing (extra sequence ids)
    sched_block_tokens: int = 16      # cells per block in the accounting
    sched_soft: float = 0.25          # free fraction below which cold cached prefixes are evicted
    sched_hard: float = 0.10          # ... below which no new request is admitted
    sched_critical: float = 0.05      # ... below which the lowest-priority running request is preempted
    sched_max_waiting: int = 64       # requests waiting to be admitted; more are refused
    sched_max_salts: int = 256        # cache salts whose store spaces stay known; the least recently used is reclaimed
    sched_exact: bool = True          # every answer equals the same request run alone (kvbridge.scheduler.exact); off
                                      # by itself, said at start, with KVB_FLASH_ATTN=true or a recurrent model
    # serve (python -m kvbridge serve): an OpenAI-compatible endpoint
    serve_host: str = "127.0.0.1"
    serve_port: int = 8000
    serve_engine: str = "scheduler"   # scheduler (in-process, many requests at once) or llama-server (queued)
    serve_model_alias: str = ""       # the model's names in the API, comma-separated (-a); empty: the file's name
    serve_api_key_env: str = ""       # the NAME of the variable holding the bearer token; never the token
    serve_api_key_file: str = ""      # a file the user owns holding the bearer token (--api-key-file); read at start
    serve_admin_key_env: str = ""     # the NAME of the variable holding the operator key (all of /metrics, /health)
    serve_router_key_env: str = ""    # the NAME of the variable holding the router key (render, /tokenize, /get_load...)
    serve_max_tokens: int = 1024      # the most a request may ask for (max_tokens), and what it gets naming none
    serve_max_body_bytes: int = 8 << 20   # a larger request body is refused (413) before it is read
    serve_allowed_hosts: str = "localhost,127.0.0.1,::1"   # Host header names answered, plus the bound address; *: any
    serve_tenants_file: str = ""      # JSON of tenants: name, key_sha256 (never the key), cache_group; empty: one tenant
    serve_cors_origins: str = ""      # comma-separated origins browsers may call from; empty: CORS off
    serve_drain_timeout: float = 30.0 # SIGTERM: seconds running requests get to finish
    # a fleet: several serve instances behind a router (python -m kvbridge fleet; kvbridge.fleet)
    serve_instance_id: str = ""       # this instance's name in X-KVBridge-Instance and its KV events; empty: host-port
    serve_role: str = "both"          # both; prefill (compute, store every chunk, answer); decode (restore, decode)
    kv_events_url: str = ""           # tcp://127.0.0.1:PORT or ipc:///path: publish KV events there (ZMQ PUB); empty: off
    kv_events_check_s: float = 1.0    # published stored blocks are rechecked this often: the longest a gone one stays claimed
    fleet_workers: int = 3            # serve instances `fleet` starts
    fleet_policy: str = "kv_aware"    # the router's policy: round_robin, cache_aware or kv_aware
    fleet_port: int = 8000            # the router's port (the workers take free ports)
    # the cache server (python -m kvbridge cache-server); KVB_STORE_URL set: engines use it, not an embedded store
    store_url: str = ""               # tcp://127.0.0.1:5555 or ipc:///path; empty: the embedded store
    client_priority: int = 5          # 0-9, higher is more important under memory pressure
    cache_server_url: str = "tcp://127.0.0.1:5555"   # where `cache-server` binds (its --url)
    cache_server_token_env: str = ""  # the NAME of the variable holding the shared secret; never the secret
    cache_server_public_key: str = ""   # clients: the server's Z85 CURVE public key; empty: the owner's key file
    cache_server_secret_key_env: str = ""   # the NAME of the variable holding the server's Z85 secret key; never the key
    cache_server_shm: bool = True     # clients on the server's host copy through shared memory
    cache_server_checksum: bool = False   # a blake3 digest per shared-memory object, checked on every read
    cache_server_page_bytes: int = 256 << 10
    cache_server_modules: str = ""    # JSON list of {"module_path": ..., "config": {...}}
    cache_server_metrics_port: int = 0   # 0: no Prometheus endpoint
    cache_server_reap_timeout: float = 120.0     # seconds without a request before a client is dropped; 0: never
    cache_server_registration_grace: float = 3600.0  # a registered client that has sent nothing yet gets this long
    cache_server_lease_timeout: float = 30.0     # a lease not released by then is revoked (its pages quarantined)
    cache_server_timeout: float = 5.0            # client side: a request unanswered this long is a miss
    cache_server_soft_free: float = 0.20         # free-page fraction below which cold objects are evicted
    cache_server_hard_free: float = 0.10         # ... below which low-priority stores are refused
    cache_server_critical_free: float = 0.05     # ... below which low-priority write leases are revoked
    cache_server_target_free: float = 0.30       # eviction frees pages until this fraction is free
    cache_server_hard_min_priority: int = 5      # under HARD pressure, stores from clients below this are refused
    cache_server_write_queue: int = 256          # objects waiting for the background L2 writer
    cache_server_max_message_bytes: int = 256 << 20
    cache_server_handshake_s: float = 5.0        # a connection not authenticated within this is dropped
    cache_server_max_connections: int = 256      # connections the cache server holds at once; newer ones are closed
    # GUI
    host: str = "127.0.0.1"
    port: int = 7860
    input_dir: str = str(WORK_DIR / "input")
    output_dir: str = str(WORK_DIR / "output")
    # llama-server
    llama_server_bin: str = ""        # empty: the binary scripts/build_llama_server.sh built
    llama_server_url: str = ""        # set: attach to a running server instead of starting one
    llama_server_port: int = 0        # 0: a free port
    llama_server_slot_dir: str = ""   # attach mode: the server's --slot-save-path as seen from here (chunked KV)
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
    # unknown KVB_ names far from every setting: told once at start (warnings()), not blocking; not a setting
    _warnings: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, env_file: str | Path | None = None) -> "Settings":
        """Build from `.env` (python-dotenv) overlaid by the environment; the environment wins.

        env: the environment to read (default os.environ); env_file: the settings file, else the one
        KVB_ENV_FILE names, else DEFAULT_ENV_FILE (the checkout's `.env`; for an installed package the
        user's ~/.config/kvbridge/.env, never the current directory's). A file named explicitly that is
        missing is a problem validate() reports. Never raises for a bad value: it keeps the default
        and validate() reports it.
        """
        environ = os.environ if env is None else env
        path = settings_file(environ) if env_file is None else Path(env_file).expanduser()
        explicit = env_file is not None or bool(environ.get(ENV_FILE_VARIABLE, "").strip())
        problems: list[tuple[str, str]] = []
        file_values: dict[str, str] = {}
        if path.is_file():
            try:
                file_values = {k: v for k, v in dotenv_values(path).items() if v is not None}
            except (OSError, UnicodeDecodeError) as error:
                problems.append(("", f"cannot read the settings file {path}: {error}"))
        elif explicit:
            named = "" if env_file is not None else f" ({ENV_FILE_VARIABLE})"
            problems.append(("", f"the settings file {path}{named} {'is not a file' if path.exists() else 'does not exist'}"))
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
        misspelt, unknown = unknown_names(values)
        problems += [("", msg) for msg in misspelt]
        return cls(**kwargs, _problems=tuple(problems), _warnings=tuple(unknown))

    def replace(self, **changes) -> "Settings":
        """A copy with some fields changed; parse problems of the changed fields are dropped."""
        kept = tuple(p for p in self._problems if p[0] not in changes)
        return dataclasses.replace(self, **changes, _problems=kept)

    def validate(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """Problems written for a person; empty when the settings are usable. Never raises. No problem shows the
        value of a setting whose name says key, token, secret or password (kvbridge.settings.redact).

        environ: where the API key variable is looked for (default os.environ, as the cloud engine does).
        """
        environ = os.environ if environ is None else environ
        problems = [message for _, message in self._problems] + settings_problems(self, environ)
        hidden = hidden_values(self, environ)   # whatever a check wrote, no secret leaves
        return [scrub(message, hidden) for message in problems]

    def __repr__(self) -> str:
        """The dataclass's repr, with what redact.may_show() hides hidden: no secret in a traceback or a log line."""
        values = ((f.name, getattr(self, f.name)) for f in setting_fields())
        shown = (f"{name}={value!r}" if may_show(name, value) else f"{name}={HIDDEN}" for name, value in values)
        return f"Settings({', '.join(shown)})"

    def warnings(self) -> list[str]:
        """What is worth telling but blocks nothing: KVB_ names in the environment or `.env` that are no
        setting and look like none (the CLI prints them once at start, on stderr; the GUI can list them)."""
        return list(self._warnings)

    def resolved_threads(self) -> int:
        return self.threads or max(1, os.cpu_count() or 1)

    def resolved_model_path(self) -> Path:
        """KVB_MODEL_PATH, else the embedded model KVB_MODEL names (the llamacpp engine tries the Ollama model
        in between); an unknown KVB_MODEL falls back to the default here and validate() reports it."""
        if self.model_path:
            return Path(self.model_path).expanduser()
        return EMBEDDED_MODELS.get(self.model, EMBEDDED_MODELS[DEFAULT_MODEL]).path

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
PATH_FIELDS = ("model_path", "l2_dir", "input_dir", "output_dir", "llama_server_bin", "llama_server_slot_dir",
               "ollama_models", "serve_tenants_file", "serve_api_key_file")
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


def settings_file(environ: Mapping[str, str]) -> Path:
    """The `.env` file Settings.from_env reads: the one KVB_ENV_FILE names, else DEFAULT_ENV_FILE."""
    named = environ.get(ENV_FILE_VARIABLE, "").strip()
    return Path(named).expanduser() if named else DEFAULT_ENV_FILE


MISSPELT_CUTOFF = 0.85    # this close to a setting's name, an unknown name is a typo: validate() reports it
PLAUSIBLE_CUTOFF = 0.7    # this close, a far-off unknown name's warning still suggests the setting


def unknown_names(values: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(misspelt, unknown): the KVB_ names in `values` that are no setting, as messages for a person.

    A name close to a setting's is almost always a typo whose value would be silently ignored: it is a
    problem validate() reports, and the run stops. A name far from every setting (a test's own variable, a
    name another tool reads) is a warning: said once, blocking nothing. Never reported: the build scripts'
    variables (kvbridge.settings.reference.BUILD_TIME) and a variable some `*_ENV` setting names, which
    holds a secret (the API key variable that KVB_SERVE_API_KEY_ENV names is legitimate, whatever its name).
    """
    from kvbridge.settings.reference import BUILD_TIME   # here, not at import: reference imports this module

    known = [env_name(n) for n in SETTING_NAMES]
    named_by_env = {values.get(env_name(n), "").strip() for n in SETTING_NAMES if n.endswith("_env")}
    legitimate = {*known, ENV_FILE_VARIABLE, *(b.name for b in BUILD_TIME), *named_by_env}
    misspelt, unknown = [], []
    for name in sorted(n for n in values if n.startswith("KVB_") and n not in legitimate):
        close = difflib.get_close_matches(name, known, n=1, cutoff=MISSPELT_CUTOFF)
        if close:
            misspelt.append(f"{name} is not a KVBridge setting; did you mean {close[0]}?")
            continue
        plausible = difflib.get_close_matches(name, known, n=1, cutoff=PLAUSIBLE_CUTOFF)
        hint = (f"the closest one is {plausible[0]}" if plausible
                else "the settings are listed in .env.example and Docs/Settings.md")
        unknown.append(f"{name} is not a KVBridge setting and is ignored; {hint} (a variable holding a secret "
                       "is not reported once the *_ENV setting that reads it names it)")
    return misspelt, unknown


# ---------------------------------------------------------------------------------------------
# writing: typed value -> text, the inverse of the parsing above (kvbridge.settings.envfile puts it in .env)


def settings_to_env(settings: Settings, only_changed: bool = False) -> dict[str, str]:
    """Settings -> {KVB_ variable: text} as update_env_file() writes it (for the GUI's Save button)."""
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
