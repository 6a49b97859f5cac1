"""Opening the store an engine uses: the embedded TieredStore, or a remote one when KVB_STORE_URL is set.

Place in the flow: CachedEngine / Scheduler start -> **open_store** -> the store every chunk lookup,
restore and store goes through (tiers here, or a cache server's tiers behind its client).

The store package sits below the cache server (which builds its tiers from this package), so it
cannot import the cache server's client: remote stores are found in a registry instead. Each kind
registers itself with register_remote_store() when its module is imported; the built-in modules are
imported on the first open of a remote store, never for the embedded one (an engine without
KVB_STORE_URL loads no ZeroMQ). A module that fails to import is remembered with its error.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvbridge.errors import BadSettings
from kvbridge.plugins import PluginModules
from kvbridge.settings import Settings
from kvbridge.store.tiered import TieredStore

# Each module registers its remote store kind(s) with register_remote_store() when imported.
BUILTIN_REMOTE_STORES = ("kvbridge.cache_server.remote_store",)
# KVB_STORE_URL is a ZeroMQ address (Settings.validate checks it), and the cache server is what listens there.
STORE_URL_KIND = "cache-server"


@dataclass(frozen=True)
class RemoteStoreKind:
    name: str
    open: Callable[[Settings], object]   # settings -> a store with the TieredStore interface
    blurb: str = ""


_KINDS: dict[str, RemoteStoreKind] = {}
_BUILTINS = PluginModules(BUILTIN_REMOTE_STORES)   # a broken module is named by remote_store_kind


def register_remote_store(kind: RemoteStoreKind) -> RemoteStoreKind:
    _KINDS[kind.name] = kind
    return kind


def remote_store_kind(name: str) -> RemoteStoreKind:
    _BUILTINS.load()
    if name in _KINDS:
        return _KINDS[name]
    broken = _BUILTINS.broken_summary()
    raise BadSettings(f"No remote store of kind {name!r} is available"
                      + (f": its module did not import: {broken}" if broken else "") + ".")


def open_store(settings: Settings):
    """The embedded TieredStore, or, with KVB_STORE_URL set, the cache server there (its tiers, not ours)."""
    if settings.store_url:
        return remote_store_kind(STORE_URL_KIND).open(settings)
    return TieredStore.from_settings(settings)
