"""ServerContext: what every server module shares (settings, store, metrics, clients), built by the server."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbridge.settings import Settings

if TYPE_CHECKING:
    from kvbridge.cache_server.metrics import ServerMetrics
    from kvbridge.cache_server.server import ClientTable
    from kvbridge.cache_server.server_store import ServerStore


@dataclass
class ServerContext:
    settings: Settings
    store: "ServerStore"
    metrics: "ServerMetrics"
    clients: "ClientTable"
    server_id: str
    url: str
    metrics_port: int = 0
    modules: Any = None          # the ComposedModules, set once composition finished
    extra: dict = field(default_factory=dict)   # for plugins that share state with each other
