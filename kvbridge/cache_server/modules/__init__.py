"""The built-in server modules, each a DiscoverableModule found by walking this package.

lookup (which leading chunks are stored, and where), storage (retrieve / store / release through the
shared-memory pool, the pressure loop), management (ping, status, the liveness reaper) and metrics
(Prometheus). Files starting with "_" are helpers, not modules. Opt-in modules live in
kvbridge.cache_server.plugin_modules and are composed only when named with --server-module.
"""
