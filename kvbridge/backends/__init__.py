"""Engine adapters and their registry.

`base` holds the one Backend class and the types that cross the adapter boundary; `registry` is
the only list of engines and imports the built-in adapters (llamacpp, llama_server, ollama, cloud)
when it is first asked, so importing this package loads no adapter.
"""
from kvbridge.backends.base import Backend, EngineReport, Prompt, SeqState
from kvbridge.backends.registry import (EngineSpec, broken_adapters, engine_specs, known_engine_names, make_backend,
                                        register_engine, resolve_engine, unregister_engine)

__all__ = [
    "Backend", "EngineReport", "Prompt", "SeqState", "EngineSpec", "broken_adapters", "engine_specs",
    "known_engine_names", "make_backend", "register_engine", "resolve_engine", "unregister_engine",
]
