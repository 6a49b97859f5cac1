"""A stand-in for kvbridge.cache_server.modules: storage <- lookup, storage <- management."""
