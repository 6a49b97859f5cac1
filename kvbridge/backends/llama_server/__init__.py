"""llama-server as a full-KV engine: the adapter (backend), its HTTP API (api) and the child process (process).

Importing this package registers the "llama-server" engine.
"""
from kvbridge.backends.llama_server.backend import LlamaServerBackend

__all__ = ["LlamaServerBackend"]
