"""Words for the settings the page shows: a label a person reads, with its KVB_ variable as the hint beneath.

Place in the flow: a Settings field -> **its label and hint here** -> every input that edits a setting (the
engine panel in kvbridge.gui.app, the lab's controls in kvbridge.gui.lab_tab). One table, so each label is
written once and every field names its variable the same way: Gradio's `info=`, the small text under the
label, reads "KVB_CTX_SIZE: at least 64 and KVB_CHUNK_SIZE". The meanings are `.env.example`'s, shortened.
"""
from __future__ import annotations

from typing import Any

from kvbridge.settings import env_name

SETTING_CLASS = "kvb-setting"   # on every settings input, so the browser tests find them all

# field -> (label, what the value means; "" when the label says it all)
FIELD_TEXT: dict[str, tuple[str, str]] = {
    # llama.cpp, in-process and llama-server
    "model": ("Embedded model", "used when no model file is set"),
    "model_path": ("Model file (GGUF)", "empty: the embedded model above"),
    "ctx_size": ("Context size (tokens)", "at least 64 and at least the chunk size"),
    "threads": ("CPU threads", "0: all cores"),
    "flash_attn": ("Flash attention", "changes the KV layout, so stored KV is not shared across it"),
    "cache_type_k": ("K cache type", "f16, q8_0, …; part of the namespace"),
    "cache_type_v": ("V cache type", "f16, q8_0, …; part of the namespace"),
    # store and generation
    "n_predict": ("Tokens to generate", "per request, unless a scenario says otherwise"),
    "chunk_size": ("Chunk size (tokens)", "each full chunk is one stored object"),
    "l1_bytes": ("L1 size (RAM)", "e.g. 1GiB; least recently used objects move to L2"),
    "l2_enabled": ("Use the L2 disk tier", ""),
    "l2_dir": ("L2 folder (disk)", "survives restarts"),
    "l2_bytes": ("L2 size (disk)", "e.g. 8GiB"),
    # llama-server
    "llama_server_bin": ("llama-server program", "empty: the one the build script made"),
    "llama_server_url": ("Attach to a running llama-server (URL)", "empty: start one"),
    "llama_server_slot_dir": ("Attached server's slot folder", "attach mode: its --slot-save-path, seen from here"),
    "llama_server_port": ("llama-server port", "0: a free port"),
    "llama_start_timeout": ("Start timeout (s)", "how long to wait for the server's /health"),
    # Ollama
    "ollama_url": ("Ollama address", ""),
    "ollama_model": ("Ollama model", "as in `ollama list`"),
    "ollama_keep_alive": ("Keep the model loaded for", "5m, 1h, 0, -1 = forever"),
    "ollama_models": ("Ollama's model folder", "where its GGUF is found for tokenizing"),
    # OpenAI-compatible API
    "cloud_provider": ("Provider", "openai, groq, openrouter, vllm, …"),
    "cloud_base_url": ("API base URL", "wins over the provider's"),
    "cloud_model": ("Model name", "empty: the provider's default"),
    "cloud_api_key_env": ("Variable holding the API key", "its NAME, never the key"),
    "cloud_extra_headers": ("Extra HTTP headers (JSON)", "no keys or tokens here"),
    "cloud_token_budget": ("Token budget", "requests are refused once used up; 0: none"),
    "cloud_timeout": ("Request timeout (s)", ""),
    "cloud_max_retries": ("Retries", "on 429 and 5xx, with backoff"),
    # the scheduler (the lab tab)
    "sched_kv_cells": ("KV budget (cells)", "every running request's KV together"),
    "sched_max_running": ("Running sequences", "decoding at once"),
    "sched_soft": ("Soft mark (free fraction)", "evict cold prefixes below"),
    "sched_hard": ("Hard mark", "stop admitting below"),
    "sched_critical": ("Critical mark", "preempt below"),
    "sched_exact": ("Exact answers", "each equals the request run alone; flash attention off"),
}


def field_label(name: str) -> str:
    """The words above a setting's input; a field without an entry gets its name in words (a test
    makes sure every field the GUI shows has one)."""
    return FIELD_TEXT[name][0] if name in FIELD_TEXT else name.replace("_", " ").capitalize()


def field_hint(name: str, note: str | None = None) -> str:
    """The line under the label: the KVB_ variable, then what its value means."""
    note = FIELD_TEXT.get(name, ("", ""))[1] if note is None else note
    return f"{env_name(name)}: {note}" if note else env_name(name)


def setting_input(name: str, note: str | None = None, label: str | None = None) -> dict[str, Any]:
    """Keyword arguments for the Gradio input of Settings field `name`: label, info (the hint) and the
    class the browser tests look for. `note` or `label` replace the table's where a place needs its own."""
    return {"label": label or field_label(name), "info": field_hint(name, note), "elem_classes": [SETTING_CLASS]}
