"""Tenants of `serve`: which API key is whose, and whose cached KV a request may reuse.

Place in the flow: HTTP request -> **TenantAuth (key -> tenant)** -> parse -> the request's cache salt
(tenant's cache group + the request's own `cache_salt`) -> Scheduler.submit(cache_salt=...), which
shares cells and stored KV only with requests of the same salt.

The file KVB_SERVE_TENANTS_FILE names holds key *digests*, never keys:

    {"tenants": [
        {"name": "alice", "key_sha256": "<sha256 hex of alice's key>", "max_priority": 7},
        {"name": "bob",   "key_sha256": "<...>", "cache_group": "team"},
        {"name": "carol", "key_sha256": "<...>", "cache_group": "team"}
    ]}

Tenants of one `cache_group` (default: their own name) reuse each other's KV on purpose (a shared
system prompt); all others never do: another tenant's document is a cold prefill, so TTFT tells no
one what another asked (vLLM's CVE-2025-46570). The single key (KVB_SERVE_API_KEY_FILE or
KVB_SERVE_API_KEY_ENV), or no key at all, is the tenant `default`, whose salt is empty: its cache is the
one serve always had.
Make a digest with `python -m kvbridge.serve.tenants digest` (reads the key from standard input).
The group name `default` is refused: no tenant of the file can name its way into that unsalted cache.

Priority is granted, not claimed: `max_priority` (0-9, default 0) is the most a tenant's
X-KVBridge-Priority header may ask for; 0 ignores the header (every request of the tenant runs at the
default priority, 5), so no tenant can preempt another's running requests unless the file says so. The
single key's `default` tenant (one local user, the GUI's and the CLI's cache) keeps the whole range, as
serve always had it.

The operator (the key in the variable KVB_SERVE_ADMIN_KEY_ENV names) is no tenant: it runs no
completions and sees everything /metrics and /health know; a tenant sees only itself there. The router
(the key in the variable KVB_SERVE_ROUTER_KEY_ENV names: the one vllm-router sends in a fleet) is no
tenant either: it reads what a router needs (render, /tokenize, /get_load, /get_server_info,
/kv_event_sources) and runs no completions. Who may call which route: kvbridge.serve.guards.ROUTE_CALLERS.
With no key configured at all (no tenants, no single key, no operator or router key) every caller is the
operator, as one local user always was.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from kvbridge.errors import BadSettings
from kvbridge.serve.protocol import DEFAULT_PRIORITY

DEFAULT_TENANT = "default"
MAX_PRIORITY = 9             # the header's range is 0-9 (kvbridge.serve.protocol.parse_priority)
MAX_CACHE_SALT_CHARS = 256   # what Scheduler.submit accepts; a composed salt never exceeds it
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Tenant:
    name: str
    cache_group: str
    unsalted: bool = False      # only `default`: the cache the GUI and the CLI share
    operator: bool = False      # only OPERATOR: reads everything, runs nothing
    router: bool = False        # only ROUTER: reads what a router needs, runs nothing
    max_priority: int = 0       # the most X-KVBridge-Priority may ask for; 0: the header is ignored

    @property
    def role(self) -> str:
        """Who calls, as kvbridge.serve.guards.ROUTE_CALLERS names callers: operator, router or tenant."""
        return "operator" if self.operator else "router" if self.router else "tenant"

    def priority(self, asked: int | None) -> int:
        """The priority a request runs at: what the header asked (None: not sent), up to the grant; the
        default when the tenant has no grant."""
        if asked is None or self.max_priority < 1:
            return DEFAULT_PRIORITY
        return min(asked, self.max_priority)

    def cache_salt(self, request_salt: str = "") -> str:
        """The salt for Scheduler.submit: the cache group's (none for `default`), then the request's own.
        A request salt that would carry the whole past MAX_CACHE_SALT_CHARS joins as its SHA-256: a salt
        is only ever compared, so its digest keeps requests apart as well as the salt itself would."""
        base = "" if self.unsalted else f"group:{self.cache_group}"
        if not request_salt:
            return base
        composed = f"{base}|request:{request_salt}"
        if len(composed) <= MAX_CACHE_SALT_CHARS:
            return composed
        return f"{base}|request-sha256:{hashlib.sha256(request_salt.encode()).hexdigest()}"


DEFAULT = Tenant(DEFAULT_TENANT, DEFAULT_TENANT, unsalted=True, max_priority=MAX_PRIORITY)
OPERATOR = Tenant("operator", "", operator=True)
ROUTER = Tenant("router", "", router=True)


def group_of(cache_salt: str) -> str:
    """The cache group's part of a composed salt ('' for `default`'s): what /metrics sums bytes held by."""
    return cache_salt.partition("|")[0]


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class TenantTable:
    """Key digest -> tenant (or the operator); `resolve` compares every digest in constant time.
    `required`: a request needs a key (False: no key configured, every caller is `default`)."""

    def __init__(self, tenants: list[tuple[str, Tenant]], required: bool = True) -> None:
        self._by_digest = [(bytes.fromhex(d), t) for d, t in tenants]
        self.required = required

    @property
    def names(self) -> list[str]:
        return [t.name for _, t in self._by_digest if not t.operator]

    @property
    def has_operator(self) -> bool:
        return any(t.operator for _, t in self._by_digest)

    @property
    def no_keys(self) -> bool:
        """No key configured at all (no tenant, single, operator or router key): one local user, who sees all."""
        return not self.required and not self._by_digest

    def sees_everything(self, caller: Tenant) -> bool:
        """The operator's view of /metrics and /health: the operator key, or anyone when no key is configured."""
        return caller.operator or (not self.required and not self.has_operator)

    def with_operator(self, admin_key: str) -> "TenantTable":
        """This table plus the operator's key (KVB_SERVE_ADMIN_KEY_ENV's); BadSettings when another has it too."""
        return self._with(admin_key, OPERATOR, "KVB_SERVE_ADMIN_KEY_ENV", "the operator")

    def with_router(self, router_key: str) -> "TenantTable":
        """This table plus the router's key (KVB_SERVE_ROUTER_KEY_ENV's); BadSettings when another has it too."""
        return self._with(router_key, ROUTER, "KVB_SERVE_ROUTER_KEY_ENV", "the router")

    def _with(self, key: str, who: Tenant, setting: str, whose: str) -> "TenantTable":
        if not key:
            return self
        digest = hashlib.sha256(key.encode()).digest()
        for known, holder in self._by_digest:
            if hmac.compare_digest(known, digest):
                other = ("the operator's (KVB_SERVE_ADMIN_KEY_ENV)" if holder.operator else
                         "the router's (KVB_SERVE_ROUTER_KEY_ENV)" if holder.router else
                         "a tenant's key (KVB_SERVE_TENANTS_FILE, KVB_SERVE_API_KEY_FILE or KVB_SERVE_API_KEY_ENV)")
                raise BadSettings(f"the key in {setting}'s variable is also {other}; give {whose} a key of its own")
        table = TenantTable([], self.required)
        table._by_digest = [*self._by_digest, (digest, who)]
        return table

    def resolve(self, key: bytes) -> Tenant | None:
        digest = hashlib.sha256(key).digest()
        found = None
        for known, tenant in self._by_digest:
            if hmac.compare_digest(known, digest):
                found = tenant
        return found

    @classmethod
    def load(cls, path: str | Path, single_key: str = "") -> "TenantTable":
        """The file's tenants, plus `single_key` (serve's one key: KVB_SERVE_API_KEY_FILE's or KVB_SERVE_API_KEY_ENV's)
        as `default`; BadSettings naming the file and the entry for anything wrong."""
        where = f"KVB_SERVE_TENANTS_FILE={path}"
        try:
            data = json.loads(Path(path).expanduser().read_text())
        except OSError as exc:
            raise BadSettings(f"{where} cannot be read: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise BadSettings(f"{where} is not JSON: {exc}") from None
        entries = data.get("tenants") if isinstance(data, dict) else None
        if not isinstance(entries, list) or not entries:
            raise BadSettings(f'{where} must be an object with a non-empty list "tenants"')
        tenants, seen_names, seen_digests = [], set(), set()
        for i, entry in enumerate(entries):
            at = f"{where}, tenants[{i}]"
            if not isinstance(entry, dict):
                raise BadSettings(f"{at} must be an object with name and key_sha256")
            name, digest = entry.get("name"), str(entry.get("key_sha256", "")).lower()
            group = entry.get("cache_group", name)
            if not isinstance(name, str) or not _NAME.match(name) or name == DEFAULT_TENANT:
                raise BadSettings(f"{at}: name must be 1-64 letters, digits, '_', '.', '-' (and not 'default')")
            if not _HEX64.match(digest):
                raise BadSettings(f"{at} ({name}): key_sha256 must be the sha256 hex digest of the key, never the "
                                  "key itself (python -m kvbridge.serve.tenants digest)")
            if not isinstance(group, str) or not _NAME.match(group):
                raise BadSettings(f"{at} ({name}): cache_group must be 1-64 letters, digits, '_', '.', '-'")
            if group == DEFAULT_TENANT:
                raise BadSettings(f"{at} ({name}): cache_group 'default' is the unsalted cache of the single key "
                                  "(KVB_SERVE_API_KEY_FILE or _ENV), the GUI and the CLI; a tenant cannot join it: "
                                  "name another group")
            if name in seen_names or digest in seen_digests:
                raise BadSettings(f"{at} ({name}): the name or the key appears twice")
            grant = entry.get("max_priority", 0)
            if isinstance(grant, bool) or not isinstance(grant, int) or not 0 <= grant <= MAX_PRIORITY:
                raise BadSettings(f"{at} ({name}): max_priority must be a whole number 0 to {MAX_PRIORITY}, the most its "
                                  "X-KVBridge-Priority header may ask for (0, the default: the header is ignored), "
                                  f"got {grant!r}")
            seen_names.add(name)
            seen_digests.add(digest)
            tenants.append((digest, Tenant(name, group, max_priority=grant)))
        if single_key:
            digest = key_digest(single_key)
            if digest in seen_digests:
                raise BadSettings(f"serve's single key (KVB_SERVE_API_KEY_FILE or KVB_SERVE_API_KEY_ENV) is also a "
                                  f"tenant's key in {where}")
            tenants.append((digest, DEFAULT))
        return cls(tenants)

    @classmethod
    def single(cls, key: str) -> "TenantTable":
        return cls([(key_digest(key), DEFAULT)])

    @classmethod
    def open(cls) -> "TenantTable":
        """No key configured: every caller is `default` (the operator key, if any, still resolves)."""
        return cls([], required=False)


def main(argv: list[str]) -> int:
    """`python -m kvbridge.serve.tenants digest`: the sha256 of a key read from standard input."""
    if argv[1:] == ["digest"]:
        key = sys.stdin.readline().rstrip("\n")
        if not key:
            print("no key on standard input", file=sys.stderr)
            return 2
        print(key_digest(key))
        return 0
    print("usage: echo KEY | python -m kvbridge.serve.tenants digest", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
