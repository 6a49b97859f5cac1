"""Engine adapters and their registry.

`base` holds the one Backend class and the types that cross the adapter boundary; `registry` is
the engine side of the only list of engines, whose table (kvbridge.settings.engines) imports the
built-in adapters (llamacpp, llama_server, ollama, cloud) when it is first asked, so importing this
package loads no adapter. The names KVB_ENGINE may take (`known_engine_names`) and the adapters that
did not import (`broken_adapters`) are read from that table.
"""
from kvbridge.backends.base import Backend, EngineReport, Prompt, SeqState
from kvbridge.backends.registry import (EngineSpec, engine_specs, make_backend, register_engine, resolve_engine,
                                        unregister_engine)

__all__ = [
    "Backend", "EngineReport", "Prompt", "SeqState", "EngineSpec", "engine_specs", "make_backend",
    "register_engine", "resolve_engine", "unregister_engine",
]
