"""KVBridge: an LMCache-style KV-cache layer for llama.cpp, llama-server, Ollama and OpenAI-compatible engines.

The flow: prompt -> tokens -> chunk hashes -> lookup (L1 RAM, L2 disk, L3 on Redis/Valkey) -> restore
-> prefill only the suffix -> generate -> store new chunks. The packages follow it:

    errors, plugins  the exception hierarchy; the loader of plugin tables (how a layer finds code above it)
    settings/      Settings (frozen, from env and .env), checks, the tables of engines and codecs, presets
    formats/       llama.cpp's sequence state and its chunks, llama-server's slot files
    store/         tiers (L1 RAM, L2 disk, L3 on Redis or Valkey) in an ordered list under one LRU policy; open_store
    backends/      the Backend base, the engine registry, one adapter per engine, the shared llama.cpp parts
    engine/        CachedEngine, the modes registry, the layout decision, namespace, hashing, chunk and tail KV
    cache_server/  one daemon owning the cache for every engine process (ZMQ, shared-memory L1)
    blend/         retrieved passages reused wherever they stand in a prompt (approximate, opt-in)
    scheduler/     many requests on one llama.cpp context, in parts: shared prefixes, preemption with swap
    serve/         an OpenAI-compatible endpoint (`kvbridge serve`) over the scheduler or llama-server
    bench/         the benchmark registry and the user's benchmarks; common/ helpers; probes/ research probes
    gui/           the Gradio testbed and the KV cache lab;  cli/ one module per command (__main__ dispatches)

Each package imports only those above it in this list (Docs/Architecture.md, tests/test_architecture_house.py).

Public API: `from kvbridge import CachedEngine, Settings, make_backend`. The names are resolved
on first use, so `import kvbridge.store` does not load the engines.
"""
__version__ = "0.1.0"
__all__ = ["CachedEngine", "Settings", "make_backend"]

_PUBLIC = {
    "CachedEngine": "kvbridge.engine",
    "Settings": "kvbridge.settings",
    "make_backend": "kvbridge.backends",
}


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'kvbridge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
