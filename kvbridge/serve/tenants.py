"""Tenants of `serve`: which API key is whose, and whose cached KV a request may reuse.

Place in the flow: HTTP request -> **TenantAuth (key -> tenant)** -> parse -> the request's cache salt
(tenant's cache group + the request's own `cache_salt`) -> Scheduler.submit(cache_salt=...), which
shares cells and stored KV only with requests of the same salt.

The file KVB_SERVE_TENANTS_FILE names holds key *digests*, never keys:

    {"tenants": [
        {"name": "alice", "key_sha256": "<sha256 hex of alice's key>"},
        {"name": "bob",   "key_sha256": "<...>", "cache_group": "team"},
        {"name": "carol", "key_sha256": "<...>", "cache_group": "team"}
    ]}

Tenants of one `cache_group` (default: their own name) reuse each other's KV on purpose (a shared
system prompt); all others never do: another tenant's document is a cold prefill, so TTFT tells no
one what another asked (vLLM's CVE-2025-46570). The single key of KVB_SERVE_API_KEY_ENV, or no key
at all, is the tenant `default`, whose salt is empty: its cache is the one serve always had.
Make a digest with `python -m kvbridge.serve.tenants digest` (reads the key from standard input).
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

DEFAULT_TENANT = "default"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Tenant:
    name: str
    cache_group: str

    def cache_salt(self, request_salt: str = "") -> str:
        """The salt for Scheduler.submit: the cache group's (none for `default`), then the request's own."""
        base = "" if self.cache_group == DEFAULT_TENANT else f"group:{self.cache_group}"
        return f"{base}|request:{request_salt}" if request_salt else base


DEFAULT = Tenant(DEFAULT_TENANT, DEFAULT_TENANT)


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class TenantTable:
    """Key digest -> tenant; `resolve` compares every digest in constant time."""

    def __init__(self, tenants: list[tuple[str, Tenant]]) -> None:
        self._by_digest = [(bytes.fromhex(d), t) for d, t in tenants]

    @property
    def names(self) -> list[str]:
        return [t.name for _, t in self._by_digest]

    def resolve(self, key: bytes) -> Tenant | None:
        digest = hashlib.sha256(key).digest()
        found = None
        for known, tenant in self._by_digest:
            if hmac.compare_digest(known, digest):
                found = tenant
        return found

    @classmethod
    def load(cls, path: str | Path, single_key: str = "") -> "TenantTable":
        """The file's tenants, plus `single_key` (KVB_SERVE_API_KEY_ENV's) as `default`; BadSettings naming
        the file and the entry for anything wrong."""
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
            if name in seen_names or digest in seen_digests:
                raise BadSettings(f"{at} ({name}): the name or the key appears twice")
            seen_names.add(name)
            seen_digests.add(digest)
            tenants.append((digest, Tenant(name, group)))
        if single_key:
            digest = key_digest(single_key)
            if digest in seen_digests:
                raise BadSettings(f"the key in KVB_SERVE_API_KEY_ENV's variable is also a tenant's key in {where}")
            tenants.append((digest, DEFAULT))
        return cls(tenants)

    @classmethod
    def single(cls, key: str) -> "TenantTable":
        return cls([(key_digest(key), DEFAULT)])


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
