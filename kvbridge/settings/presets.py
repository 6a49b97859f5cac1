"""Cloud presets: the OpenAI-compatible providers KVB_CLOUD_PROVIDER can name, as data.

A leaf of the settings layer: `Settings.cloud_endpoint()` (kvbridge.settings.core) fills the base URL,
the key variable's name and the model from a preset unless KVB_CLOUD_* set them, the cloud checks
(on CloudBackend.settings_problems) list the known keys, and the cloud engine shows the label. Adding a
provider is one more line here; nothing else branches on provider names.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CloudPreset:
    """An OpenAI-compatible provider: where it is and which variable usually holds its key."""

    key: str
    label: str
    base_url: str
    key_env: str         # default name of the variable holding the key; "" when none is needed
    default_model: str   # "" when the server decides (local servers)
    notes: str = ""


CLOUD_PRESETS: dict[str, CloudPreset] = {p.key: p for p in (
    CloudPreset("openai", "OpenAI", "https://api.openai.com/v1", "OPENAI_API_KEY", "gpt-4.1-mini",
                "cached_tokens from 1024-token prompts, in 128-token steps"),
    CloudPreset("groq", "Groq", "https://api.groq.com/openai/v1", "GROQ_API_KEY", "llama-3.1-8b-instant",
                "usage.prompt_tokens_details.cached_tokens"),
    CloudPreset("openrouter", "OpenRouter", "https://openrouter.ai/api/v1", "OPENROUTER_API_KEY",
                "openai/gpt-4.1-mini", "cached_tokens depends on the upstream provider"),
    CloudPreset("together", "Together AI", "https://api.together.xyz/v1", "TOGETHER_API_KEY",
                "meta-llama/Llama-3.3-70B-Instruct-Turbo", "may report no cached-token count"),
    CloudPreset("mistral", "Mistral", "https://api.mistral.ai/v1", "MISTRAL_API_KEY", "mistral-small-latest",
                "may report no cached-token count"),
    CloudPreset("deepseek", "DeepSeek", "https://api.deepseek.com/v1", "DEEPSEEK_API_KEY", "deepseek-chat",
                "usage.prompt_cache_hit_tokens"),
    CloudPreset("vllm", "vLLM (local)", "http://127.0.0.1:8000/v1", "", "",
                "set KVB_CLOUD_MODEL to the served model; prefix caching must be on"),
    CloudPreset("lmstudio", "LM Studio (local)", "http://127.0.0.1:1234/v1", "", "",
                "set KVB_CLOUD_MODEL to the loaded model"),
    CloudPreset("ollama-local-openai", "Ollama, OpenAI API (local)", "http://127.0.0.1:11434/v1", "", "",
                "set KVB_CLOUD_MODEL to a pulled model; reports no cached-token count"),
)}
