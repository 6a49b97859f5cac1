"""The KVBridge cache server: one daemon that owns the KV cache for every engine process.

    python -m kvbridge cache-server                 # tcp://127.0.0.1:5555
    KVB_STORE_URL=tcp://127.0.0.1:5555 ./scripts/start.sh   # engines use it instead of an embedded store

Modules, in reading order: protocol (every wire message), calls (what a handler gets and returns),
module + compose (DiscoverableModule, the plugin contract, composition by dependency graph),
shm + pages + pool (the shared-memory segment; page states and watermarks; the paged L1 with leases),
server_store (L1 in front of the ordinary L2 tiers, the background disk writer), server (the
ROUTER loop), clients (who said hello, when each was last heard), modules/ (the built-ins: lookup,
storage, management, metrics), plugin_modules/ (opt-in: kv_events), connection (the client's socket
thread), session (the keys a client trusts, its hello, back-off and refusals), client (CacheClient),
remote_store (the store interface CachedEngine uses), auth (the shared secret, its files and the bind
rule), curve (CURVE key pairs, the key file, the ZAP handler), door (the handshake interval and the
connection cap), leftovers (what a killed server left, found from its address), liveness (when each
client was last seen), cli (the command).
"""
