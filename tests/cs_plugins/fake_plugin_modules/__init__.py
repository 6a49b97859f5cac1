"""A stand-in for kvbridge.cache_server.plugin_modules: shipped, but composed only when named."""
