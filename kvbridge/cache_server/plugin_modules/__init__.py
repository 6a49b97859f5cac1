"""Opt-in server modules shipped with KVBridge, composed only when named.

They live outside kvbridge.cache_server.modules (the package the server walks for built-ins), so
installing KVBridge never turns them on: the operator names one exactly like an external plugin,

    python -m kvbridge cache-server \\
        --server-module '{"module_path": "kvbridge.cache_server.plugin_modules.kv_events"}'

Shipped: kv_events (KvEventsModule: every stored / evicted / removed object published on a ZMQ PUB
socket of its own, with the last few kept for `kv_events.recent`).
"""
