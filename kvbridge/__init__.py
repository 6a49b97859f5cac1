"""KVBridge: an LMCache-style KV-cache layer for llama.cpp, llama-server, Ollama and OpenAI-compatible engines.

The flow: prompt -> tokens -> chunk hashes -> lookup (L1 RAM, L2 disk) -> restore -> prefill only
the suffix -> generate -> store new chunks. Start with kvbridge.engine.CachedEngine.
"""
__version__ = "0.1.0"
