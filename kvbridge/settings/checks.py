"""General settings checks: what `Settings.validate()` runs before it asks the engine's own checks.

The middle of the settings flow (`.env` + environment -> Settings -> checks -> messages in the CLI
and GUI). The checks here hold for every engine (ranges, ports, URLs). What only one engine needs
(a model file, cache types, an API key variable) lives on that engine's `Backend.settings_problems`,
and `settings_problems()` reaches it through the table of engines in kvbridge.settings.engines; the
codec names come from the table in kvbridge.settings.codecs. So the settings layer imports nothing of
the engines, the store or the adapters (those tables are filled by the layers above). Every check
returns messages written for a person, naming the KVB_ variable to change, and never raises.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING
from pathlib import Path
from urllib.parse import urlsplit

from kvbridge.errors import UnknownEngineError
from kvbridge.settings.codecs import UnknownCodecError, codec_class
from kvbridge.settings.engines import EngineEntry, find_engine
from kvbridge.settings.models import model_name_problem
from kvbridge.settings.secrets import key_file_problem

if TYPE_CHECKING:
    from kvbridge.settings.core import Settings


def settings_problems(s: Settings, environ: Mapping[str, str]) -> list[str]:
    """Every check for `s`: the general ones, then those of the engine KVB_ENGINE resolves to."""
    problems = _value_problems(s)
    engine, engine_problems = _resolve_engine(s.engine)
    problems += engine_problems
    if engine is not None:
        problems += engine.settings_problems(s, environ)
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
    model_problem = model_name_problem(s.model)
    if model_problem:
        problems.append(model_problem)
    rules = (
        (s.chunk_size < 1, f"KVB_CHUNK_SIZE={s.chunk_size} must be at least 1 (LMCache uses 256)"),
        (not s.blend_separator.strip(),
         "KVB_BLEND_SEPARATOR is empty; blend mode cuts prompts at it (default [KVB_SEP])"),
        (s.blend_recompute_at not in ("end", "start", "deviation"),
         f"KVB_BLEND_RECOMPUTE_AT={s.blend_recompute_at!r} must be end (each reused passage's last tokens) "
         "or start (its first tokens) or deviation (the prompt's most deviant reused tokens)"),
        (s.blend_recompute_tokens < 0,
         f"KVB_BLEND_RECOMPUTE_TOKENS={s.blend_recompute_tokens} cannot be negative (0: only shift stored passages)"),
        (not 0.0 <= s.blend_recompute_ratio <= 1.0,
         f"KVB_BLEND_RECOMPUTE_RATIO={s.blend_recompute_ratio} must be a share from 0 to 1 of the reused tokens "
         "(0: use KVB_BLEND_RECOMPUTE_TOKENS)"),
        (s.blend_select_layers < 1,
         f"KVB_BLEND_SELECT_LAYERS={s.blend_select_layers} must be at least 1 (the layers the deviation rule's "
         "selection pass computes)"),
        (s.blend_gate < 0,
         f"KVB_BLEND_GATE={s.blend_gate} cannot be negative (0: no gate; above 0, the deviation a prompt may keep)"),
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
    problems += _cache_server_problems(s)
    problems += _l3_problems(s)
    problems += _s3_problems(s)
    problems += _scheduler_problems(s)
    problems += _serve_problems(s)
    urls = (("KVB_OLLAMA_URL", s.ollama_url), ("KVB_CLOUD_BASE_URL", s.cloud_base_url),
            ("KVB_LLAMA_SERVER_URL", s.llama_server_url))
    for var, value in urls:
        message = url_problem(var, value) if value else None
        if message:
            problems.append(message)
    return problems


def zmq_url_problem(var: str, url: str) -> str | None:
    """A message when `url` is not tcp://host:port or ipc:///path (the cache server's transports), else None."""
    scheme, sep, rest = url.partition("://")
    if scheme == "ipc" and sep and rest:
        return None
    if scheme == "tcp" and sep:
        host, colon, port = rest.rpartition(":")
        if colon and host and port.isdigit() and 1 <= int(port) <= 65535:
            return None
    return f"{var}={url!r} is not a cache server address; use tcp://127.0.0.1:5555 or ipc:///path/to/socket"


def _cache_server_problems(s: Settings) -> list[str]:
    """The cache server's numbers and addresses (the server's own settings and its clients')."""
    marks = (s.cache_server_critical_free, s.cache_server_hard_free, s.cache_server_soft_free, s.cache_server_target_free)
    rules = (
        (not 0 <= s.client_priority <= 9, f"KVB_CLIENT_PRIORITY={s.client_priority} must be 0 to 9 (higher is more important)"),
        (s.cache_server_page_bytes < 4096,
         f"KVB_CACHE_SERVER_PAGE_BYTES={s.cache_server_page_bytes} is too small; use at least 4KiB (default 256KiB)"),
        (not 0 <= s.cache_server_metrics_port <= 65535,
         f"KVB_CACHE_SERVER_METRICS_PORT={s.cache_server_metrics_port} is not a port; use 1 to 65535, or 0 for none"),
        (s.cache_server_reap_timeout != 0 and s.cache_server_reap_timeout < 1,
         f"KVB_CACHE_SERVER_REAP_TIMEOUT={s.cache_server_reap_timeout} must be 0 (never reap) or at least 1 second"),
        (s.cache_server_registration_grace < 0,
         f"KVB_CACHE_SERVER_REGISTRATION_GRACE={s.cache_server_registration_grace} cannot be negative"),
        (s.cache_server_lease_timeout <= 0,
         f"KVB_CACHE_SERVER_LEASE_TIMEOUT={s.cache_server_lease_timeout} must be more than 0 seconds"),
        (s.cache_server_timeout <= 0, f"KVB_CACHE_SERVER_TIMEOUT={s.cache_server_timeout} must be more than 0 seconds"),
        (not all(0 <= m <= 1 for m in marks) or list(marks) != sorted(marks),
         "the watermarks must be fractions from 0 to 1 with KVB_CACHE_SERVER_CRITICAL_FREE <= _HARD_FREE <= "
         f"_SOFT_FREE <= _TARGET_FREE; got {', '.join(str(m) for m in marks)}"),
        (not 0 <= s.cache_server_hard_min_priority <= 10,
         f"KVB_CACHE_SERVER_HARD_MIN_PRIORITY={s.cache_server_hard_min_priority} must be 0 to 10"),
        (s.cache_server_write_queue < 1, f"KVB_CACHE_SERVER_WRITE_QUEUE={s.cache_server_write_queue} must be at least 1"),
        (s.cache_server_max_message_bytes < 1 << 20,
         f"KVB_CACHE_SERVER_MAX_MESSAGE_BYTES={s.cache_server_max_message_bytes} is too small; use at least 1MiB"),
    )
    problems = [message for failed, message in rules if failed]
    for var, value in (("KVB_STORE_URL", s.store_url), ("KVB_CACHE_SERVER_URL", s.cache_server_url)):
        message = zmq_url_problem(var, value) if value else None
        if message:
            problems.append(message)
    if s.cache_server_token_env and not s.cache_server_token_env.replace("_", "").isalnum():
        problems.append("KVB_CACHE_SERVER_TOKEN_ENV must be the NAME of an environment variable (like "
                        "CACHE_SERVER_SECRET), not the secret itself (its value is not shown)")
    if s.cache_server_secret_key_env and not s.cache_server_secret_key_env.replace("_", "").isalnum():
        problems.append("KVB_CACHE_SERVER_SECRET_KEY_ENV must be the NAME of an environment variable (like "
                        "CACHE_SERVER_SECRET_KEY), not the key itself (its value is not shown)")
    if s.cache_server_public_key and not is_z85_key(s.cache_server_public_key):
        problems.append("KVB_CACHE_SERVER_PUBLIC_KEY is not a Z85 CURVE key (40 "
                        "characters); copy the public key the cache server logs at start, or leave it empty to use "
                        "the owner's key file")
    return problems


L3_SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys", "redis-cluster")


def l3_url_problem(url: str) -> str | None:
    """A message when KVB_L3_URL is not an address redis-py can use, else None."""
    scheme, sep, rest = url.partition("://")
    example = "redis://127.0.0.1:6379/0 (or rediss://, unix:///path, valkey://, redis-cluster://h:p,h:p)"
    if not sep or scheme not in L3_SCHEMES:
        return f"KVB_L3_URL={url!r} is not a Redis address; use {example}"
    if scheme == "unix":
        return None if rest.startswith("/") else f"KVB_L3_URL={url!r}: a unix socket needs an absolute path (unix:///run/redis.sock)"
    hosts = rest.split("/", 1)[0].rpartition("@")[2].split(",")
    for host in hosts:
        name, colon, port = host.rpartition(":")
        if colon and not (name and port.isdigit() and 1 <= int(port) <= 65535):
            return f"KVB_L3_URL={url!r}: {host!r} is not host:port; use {example}"
        if not colon and not host:
            return f"KVB_L3_URL={url!r} names no host; use {example}"
    if "@" in rest.split("/", 1)[0] and ":" in rest.split("@", 1)[0]:
        return ("KVB_L3_URL carries a password; put the password in a variable and name it in "
                "KVB_L3_PASSWORD_ENV instead (it is never written to .env, logs or exports)")
    return None


def _l3_problems(s: Settings) -> list[str]:
    """The remote tier and the codecs of the persistent tiers."""
    problems = []
    for var, name in (("KVB_L2_SERDE", s.l2_serde), ("KVB_L3_SERDE", s.l3_serde)):
        try:
            codec_class(name, setting=var)
        except UnknownCodecError as error:
            problems.append(str(error))
    rules = (
        (not -7 <= s.zstd_level <= 22, f"KVB_ZSTD_LEVEL={s.zstd_level} must be -7 to 22 (3 is zstd's default)"),
        (s.l3_timeout <= 0, f"KVB_L3_TIMEOUT={s.l3_timeout} must be more than 0 seconds"),
        (s.l3_ttl < 0, f"KVB_L3_TTL={s.l3_ttl} cannot be negative (0: objects live until the server evicts them)"),
        (s.l3_write_queue < 1, f"KVB_L3_WRITE_QUEUE={s.l3_write_queue} must be at least 1"),
        (not 0 <= s.inflight_wait_ms <= 60_000,
         f"KVB_INFLIGHT_WAIT_MS={s.inflight_wait_ms} must be 0 (off) to 60000 milliseconds (default 250)"),
        (not s.l3_prefix or not all(c.isalnum() or c in "-_.:" for c in s.l3_prefix),
         f"KVB_L3_PREFIX={s.l3_prefix!r} must be letters, digits and - _ . : only (default kvb)"),
    )
    problems += [message for failed, message in rules if failed]
    if s.l3_url:
        message = l3_url_problem(s.l3_url)
        if message:
            problems.append(message)
    if s.l3_password_env and not s.l3_password_env.replace("_", "").isalnum():
        problems.append("KVB_L3_PASSWORD_ENV must be the NAME of an environment variable (like REDIS_PASSWORD), "
                        "not the password itself (its value is not shown)")
    return problems


S3_ORDERS = ("after-l3", "before-l3")


def s3_url_problem(url: str) -> str | None:
    """A message when KVB_S3_URL is not an S3 endpoint (http(s)://host[:port]) without credentials, else None."""
    example = "http://127.0.0.1:8333 (SeaweedFS) or https://s3.us-east-1.amazonaws.com"
    scheme, sep, rest = url.partition("://")
    netloc, _, path = rest.partition("/")
    if not sep or scheme not in ("http", "https"):
        return f"KVB_S3_URL={url!r} is not an S3 endpoint; use {example}"
    if "@" in netloc:
        return ("KVB_S3_URL carries credentials; put the keys in variables and name them in KVB_S3_ACCESS_KEY_ENV "
                "and KVB_S3_SECRET_KEY_ENV instead (they are never written to .env, logs or exports)")
    name, colon, port = netloc.rpartition(":") if not netloc.endswith("]") else (netloc, "", "")
    if not netloc or (colon and not (name and port.isdigit() and 1 <= int(port) <= 65535)):
        return f"KVB_S3_URL={url!r} names no host:port; use {example}"
    if path.strip("/"):
        return f"KVB_S3_URL={url!r} has a path; name only the endpoint and put the bucket in KVB_S3_BUCKET"
    return None


def _s3_problems(s: Settings) -> list[str]:
    """The S3 tier (checked whether or not KVB_S3_URL is set, so a typo shows before it is used)."""
    problems = []
    try:
        codec_class(s.s3_serde, setting="KVB_S3_SERDE")
    except UnknownCodecError as error:
        problems.append(str(error))
    bucket_ok = 3 <= len(s.s3_bucket) <= 63 and all(c.islower() or c.isdigit() or c in "-." for c in s.s3_bucket)
    rules = (
        (not bucket_ok, f"KVB_S3_BUCKET={s.s3_bucket!r} is not a bucket name: 3 to 63 lower-case letters, digits, - and ."),
        (not s.s3_prefix or s.s3_prefix.startswith("/") or s.s3_prefix.endswith("/")
         or not all(c.isalnum() or c in "-_./" for c in s.s3_prefix),
         f"KVB_S3_PREFIX={s.s3_prefix!r} must be letters, digits and - _ . / only, not starting or ending in / (default kvb)"),
        (not s.s3_region.strip(), "KVB_S3_REGION is empty; use us-east-1 (the default; SeaweedFS and MinIO ignore it), "
                                  "auto for Cloudflare R2, or your bucket's region"),
        (s.s3_bytes <= 0, f"KVB_S3_BYTES={s.s3_bytes} must be more than 0 (the budget of everything under KVB_S3_PREFIX)"),
        (s.s3_write_queue < 1, f"KVB_S3_WRITE_QUEUE={s.s3_write_queue} must be at least 1"),
        (s.s3_timeout <= 0, f"KVB_S3_TIMEOUT={s.s3_timeout} must be more than 0 seconds"),
        (s.s3_order not in S3_ORDERS, f"KVB_S3_ORDER={s.s3_order!r} must be one of {', '.join(S3_ORDERS)}"),
    )
    problems += [message for failed, message in rules if failed]
    for var, value in (("KVB_S3_ACCESS_KEY_ENV", s.s3_access_key_env), ("KVB_S3_SECRET_KEY_ENV", s.s3_secret_key_env)):
        if value and not value.replace("_", "").isalnum():
            problems.append(f"{var} must be the NAME of an environment variable (like AWS_ACCESS_KEY_ID), "
                            "not the key itself (its value is not shown)")
        elif s.s3_url and not value:
            problems.append(f"KVB_S3_URL is set but {var} is empty: name the variable holding the key "
                            "(KVBridge never falls back to a default credential chain)")
    if s.s3_url:
        message = s3_url_problem(s.s3_url)
        if message:
            problems.append(message)
    return problems


def _scheduler_problems(s: Settings) -> list[str]:
    marks = (s.sched_critical, s.sched_hard, s.sched_soft)
    rules = (
        (s.sched_block_tokens < 1, f"KVB_SCHED_BLOCK_TOKENS={s.sched_block_tokens} must be at least 1"),
        (s.sched_kv_cells < 16 * s.sched_block_tokens,
         f"KVB_SCHED_KV_CELLS={s.sched_kv_cells} is too small; use at least 16 blocks of KVB_SCHED_BLOCK_TOKENS"),
        (not 1 <= s.sched_max_running <= 64, f"KVB_SCHED_MAX_RUNNING={s.sched_max_running} must be 1 to 64"),
        (not 0 <= s.sched_cached_prefixes <= 64, f"KVB_SCHED_CACHED_PREFIXES={s.sched_cached_prefixes} must be 0 to 64"),
        (not 16 <= s.sched_max_salts <= 1_000_000,
         f"KVB_SCHED_MAX_SALTS={s.sched_max_salts} must be 16 to 1000000 (cache salts kept known at once)"),
        (s.sched_max_waiting < 1, f"KVB_SCHED_MAX_WAITING={s.sched_max_waiting} must be at least 1"),
        (not 4096 <= s.eviction_history <= 10_000_000,
         f"KVB_EVICTION_HISTORY={s.eviction_history} must be 4096 to 10000000 (evictions each store remembers)"),
        (not all(0 <= m < 1 for m in marks) or list(marks) != sorted(marks),
         "the scheduler's watermarks must be fractions with KVB_SCHED_CRITICAL <= KVB_SCHED_HARD <= KVB_SCHED_SOFT "
         f"< 1; got {', '.join(str(m) for m in marks)}"),
    )
    return [message for failed, message in rules if failed]


def _resolve_engine(name: str) -> tuple[EngineEntry | None, list[str]]:
    """The registered engine KVB_ENGINE names, or None and why not."""
    if not name.strip():
        return None, []  # reported by _value_problems
    try:
        return find_engine(name), []
    except UnknownEngineError as error:
        return None, [str(error)]


SERVE_ENGINES = ("scheduler", "llama-server")
_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?\.?", re.IGNORECASE)


Z85_ALPHABET = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


def is_z85_key(text: str) -> bool:
    """True for a Z85-encoded CURVE key: 40 characters of the Z85 alphabet (32 bytes)."""
    return len(text) == 40 and set(text) <= Z85_ALPHABET


def is_loopback_host(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1): only this machine can connect."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def open_serve_problem(host: str, key_env: str, tenants_file: str = "", key_file: str = "") -> str | None:
    """A message when serve would listen beyond this machine with no key (anyone reaching the port could use it).
    A key is configured by KVB_SERVE_API_KEY_ENV, the key file (--api-key-file) or the tenants file alike."""
    if not host.strip() or is_loopback_host(host) or key_env or key_file or tenants_file:
        return None
    return (f"serve would listen on {host} (KVB_SERVE_HOST / --host), beyond this machine, with no key "
            "(KVB_SERVE_API_KEY_ENV and KVB_SERVE_API_KEY_FILE are empty): anyone who can reach that address could "
            "use the model. Give it a token clients must send: --api-key-file PATH (a file of yours, chmod 600) "
            "or KVB_SERVE_API_KEY_ENV naming a variable that holds it; or listen on this machine only (127.0.0.1)")


def host_list(text: str) -> list[str]:
    """KVB_SERVE_ALLOWED_HOSTS -> its names, lower case, IPv6 addresses without brackets."""
    return [h.strip().lower().strip("[]") for h in text.split(",") if h.strip()]


def _is_host_entry(entry: str) -> bool:
    if entry == "*" or _HOST_NAME.fullmatch(entry):
        return True
    try:
        ipaddress.ip_address(entry)
        return True
    except ValueError:
        return False


def _serve_problems(s: Settings) -> list[str]:
    origins = [o.strip() for o in s.serve_cors_origins.split(",") if o.strip()]
    rules = (
        (not s.serve_host.strip(), "KVB_SERVE_HOST is empty; use 127.0.0.1 (this machine only) or 0.0.0.0"),
        (not 1 <= s.serve_port <= 65535, f"KVB_SERVE_PORT={s.serve_port} is not a port; use 1 to 65535 (default 8000)"),
        (s.serve_engine not in SERVE_ENGINES,
         f"KVB_SERVE_ENGINE={s.serve_engine!r} is not one serve can run; use {' or '.join(SERVE_ENGINES)}"),
        (s.serve_max_tokens < 1, f"KVB_SERVE_MAX_TOKENS={s.serve_max_tokens} must be at least 1"),
        (s.serve_max_body_bytes < 1024,
         f"KVB_SERVE_MAX_BODY_BYTES={s.serve_max_body_bytes} is too small; use at least 1KiB (default 8MiB)"),
        (not all(_is_host_entry(h) for h in host_list(s.serve_allowed_hosts)),
         f"KVB_SERVE_ALLOWED_HOSTS={s.serve_allowed_hosts!r}: list host names or addresses without scheme or port, "
         "comma-separated (like localhost,127.0.0.1,::1), or * for any"),
        (s.serve_drain_timeout < 0, f"KVB_SERVE_DRAIN_TIMEOUT={s.serve_drain_timeout} cannot be negative"),
        (any(not name.strip() or any(c.isspace() or not c.isprintable() for c in name.strip())
             for name in s.serve_model_alias.split(",")) if s.serve_model_alias else False,
         f"KVB_SERVE_MODEL_ALIAS={s.serve_model_alias!r}: give the model's names comma-separated, each without spaces "
         "(like my-model,gpt-4o-mini), or leave it empty for the model file's name"),
        (bool(s.serve_api_key_env) and not s.serve_api_key_env.replace("_", "").isalnum(),
         "KVB_SERVE_API_KEY_ENV must be the NAME of an environment variable (like SERVE_API_KEY), not the key "
         "itself (its value is not shown)"),
        (bool(s.serve_admin_key_env) and not s.serve_admin_key_env.replace("_", "").isalnum(),
         "KVB_SERVE_ADMIN_KEY_ENV must be the NAME of an environment variable (like SERVE_ADMIN_KEY), not the "
         "key itself (its value is not shown)"),
        (bool(s.serve_router_key_env) and not s.serve_router_key_env.replace("_", "").isalnum(),
         "KVB_SERVE_ROUTER_KEY_ENV must be the NAME of an environment variable (like SERVE_ROUTER_KEY), not the "
         "key itself (its value is not shown)"),
        (any(not o.startswith(("http://", "https://")) and o != "*" for o in origins),
         f"KVB_SERVE_CORS_ORIGINS={s.serve_cors_origins!r}: list origins like http://localhost:3000, comma-separated"),
    )
    if s.serve_api_key_file and s.serve_api_key_env:
        rules += ((True, "KVB_SERVE_API_KEY_FILE (--api-key-file) and KVB_SERVE_API_KEY_ENV both name serve's key; "
                         "keep one of them"),)
    elif s.serve_api_key_file:
        key_problem = key_file_problem("KVB_SERVE_API_KEY_FILE", s.serve_api_key_file)
        rules += ((bool(key_problem), key_problem or ""),)
    open_problem = open_serve_problem(s.serve_host, s.serve_api_key_env, s.serve_tenants_file, s.serve_api_key_file)
    if s.serve_tenants_file and not Path(s.serve_tenants_file).expanduser().is_file():
        rules += ((True, f"KVB_SERVE_TENANTS_FILE={s.serve_tenants_file} is not a file; point it at the tenants' "
                         "JSON (see Docs/Serve.md) or leave it empty for one tenant"),)
    if s.serve_tenants_file and s.serve_engine != "scheduler":
        rules += ((True, f"KVB_SERVE_TENANTS_FILE needs KVB_SERVE_ENGINE=scheduler (the {s.serve_engine} engine "
                         "cannot keep tenants' caches apart)"),)
    return [message for failed, message in rules if failed] + ([open_problem] if open_problem else []) \
        + _fleet_problems(s)


SERVE_ROLES = ("both", "prefill", "decode")
FLEET_POLICIES = ("round_robin", "cache_aware", "kv_aware")


def _fleet_problems(s: Settings) -> list[str]:
    url = s.kv_events_url.strip()
    rules = (
        (s.serve_role not in SERVE_ROLES,
         f"KVB_SERVE_ROLE={s.serve_role!r} is not a role; use both (the default), prefill or decode"),
        (bool(s.serve_instance_id) and not re.fullmatch(r"[A-Za-z0-9._:-]{1,64}", s.serve_instance_id),
         f"KVB_SERVE_INSTANCE_ID={s.serve_instance_id!r}: use 1 to 64 letters, digits, '.', '_', ':' or '-' "
         "(it is sent in a response header), or leave it empty for host-port"),
        (bool(url) and not (url.startswith("ipc://") or re.fullmatch(r"tcp://(127\.0\.0\.1|localhost|\[::1\]):\d{1,5}", url)),
         f"KVB_KV_EVENTS_URL={s.kv_events_url!r}: use tcp://127.0.0.1:PORT (this machine only) or ipc:///path "
         "(a socket file of mode 0600); events name the prompts this instance holds, so they stay on this host"),
        (not 0.05 <= s.kv_events_check_s <= 60,
         f"KVB_KV_EVENTS_CHECK_S={s.kv_events_check_s} must be from 0.05 to 60 seconds (default 1)"),
        (not 1 <= s.fleet_workers <= 64, f"KVB_FLEET_WORKERS={s.fleet_workers} must be from 1 to 64 (default 3)"),
        (s.fleet_policy not in FLEET_POLICIES,
         f"KVB_FLEET_POLICY={s.fleet_policy!r} is not a policy; use {', '.join(FLEET_POLICIES)}"),
        (not 1 <= s.fleet_port <= 65535, f"KVB_FLEET_PORT={s.fleet_port} is not a port; use 1 to 65535 (default 8000)"),
    )
    return [message for failed, message in rules if failed]
