"""Engine adapters and their registry. Importing this package registers every built-in engine."""
from .base import Backend, EngineReport, Prompt, SeqState
from .registry import EngineSpec, engine_specs, known_engine_names, make_backend, register_engine, resolve_engine
from . import llamacpp  # noqa: F401  (registers "llamacpp")
from . import llama_server  # noqa: F401  (registers "llama-server")
from . import ollama, cloud  # noqa: F401  (register "ollama" and "cloud")

__all__ = [
    "Backend", "EngineReport", "Prompt", "SeqState", "EngineSpec", "engine_specs",
    "known_engine_names", "make_backend", "register_engine", "resolve_engine",
]
