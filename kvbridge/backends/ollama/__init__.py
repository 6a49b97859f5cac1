"""Ollama as a shadow engine: the adapter (backend) and Ollama's on-disk model store (model_store).

Importing this package registers the "ollama" engine.
"""
from kvbridge.backends.ollama.backend import OllamaBackend

__all__ = ["OllamaBackend"]
