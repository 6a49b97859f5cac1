"""What both llama.cpp engines share about a model and its KV: the model file, the cache types, the namespace keys.

Place in the flow: Settings -> **the model file to load and the KV cache types llama.cpp takes** -> an
engine (llama.cpp in-process, its scheduler context, or our own llama-server) -> **the fingerprint its
namespace is built from**. The in-process adapter, the shared LlamaContext and the llama-server adapter
read these facts here, so none of them imports another's module for them.
"""
from __future__ import annotations

import os
from pathlib import Path

from kvbridge.settings import Settings, setup_command
from kvbridge.settings.models import EMBEDDED_MODELS
from kvbridge.errors import BadSettings, EngineUnavailable
from kvbridge.formats.llama_state import KV_CACHE_TYPES, UNQUANTISED_KV_TYPES


def ggml_type_id(name: str, variable: str) -> int:
    """A KV cache type name -> its ggml type id; BadSettings (naming `variable`) when llama.cpp has no such type."""
    try:
        return KV_CACHE_TYPES[name.lower()]
    except KeyError:
        raise BadSettings(cache_type_problem(variable, name)) from None


def cache_type_problem(variable: str, name: str) -> str:
    return f"{variable}={name!r} is not a KV cache type; use one of {', '.join(KV_CACHE_TYPES)}"


def cache_type_problems(s: Settings) -> list[str]:
    """KVB_CACHE_TYPE_K/V checked against the one list both llama.cpp engines start with."""
    problems = [cache_type_problem(var, value)
                for var, value in (("KVB_CACHE_TYPE_K", s.cache_type_k), ("KVB_CACHE_TYPE_V", s.cache_type_v))
                if value.lower() not in KV_CACHE_TYPES]
    if not problems and s.cache_type_v.lower() not in UNQUANTISED_KV_TYPES and not s.flash_attn:
        problems.append(f"KVB_CACHE_TYPE_V={s.cache_type_v!r} is a quantised type, which llama.cpp only supports "
                        "with flash attention: set KVB_FLASH_ATTN=true or use f16")
    return problems


def model_file_problems(s: Settings, *, ollama_model_ok: bool = False) -> list[str]:
    """KVB_MODEL_PATH (or the embedded model) checked before an engine tries to load it."""
    if s.model_path:
        path = Path(s.model_path).expanduser()
        if path.is_file():
            return []
        what = "is a directory, not a model file" if path.is_dir() else "does not exist"
        return [f"KVB_MODEL_PATH={s.model_path} {what}; "
                "point it at a .gguf file or leave it empty for the embedded model"]
    if ollama_model_ok and s.ollama_model:
        return []  # the engine looks the model's GGUF up in KVB_OLLAMA_MODELS
    embedded = s.resolved_model_path()
    if not embedded.is_file() and s.model in EMBEDDED_MODELS:
        return [f"the embedded model {s.model} (KVB_MODEL) is missing at {embedded}; run "
                f"{setup_command('--model', s.model)} to fetch it, or set KVB_MODEL_PATH to a .gguf file"]
    return []


def model_path_for(settings: Settings) -> Path:
    """KVB_MODEL_PATH, else an Ollama model's GGUF (KVB_OLLAMA_MODEL), else the embedded model KVB_MODEL names."""
    if settings.model_path:
        return Path(settings.model_path).expanduser()
    if settings.ollama_model:
        try:
            from kvbridge.backends.ollama.model_store import find_ollama_gguf
        except ImportError:  # the Ollama adapter is optional
            find_ollama_gguf = None
        if find_ollama_gguf is not None:
            found = find_ollama_gguf(settings.ollama_models, settings.ollama_model)
            if found is None:
                raise EngineUnavailable(
                    f"KVB_OLLAMA_MODEL={settings.ollama_model!r} was not found in Ollama's model store "
                    f"{settings.ollama_models} (KVB_OLLAMA_MODELS); pull it with `ollama pull` or set KVB_MODEL_PATH")
            return found
    return settings.resolved_model_path()


def check_model_file(path: Path) -> None:
    """A clear error for a missing or unreadable GGUF, naming the file and the setting."""
    if not path.is_file():
        embedded = next((m for m in EMBEDDED_MODELS.values() if m.path == path), None)
        if embedded is not None:
            raise EngineUnavailable(f"The embedded model {embedded.name} ({path}) is not fetched yet (KVB_MODEL): "
                                    f"run {setup_command('--model', embedded.name)}")
        raise EngineUnavailable(f"Model file {path} does not exist (KVB_MODEL_PATH).")
    if not os.access(path, os.R_OK):
        raise EngineUnavailable(f"Model file {path} is not readable (KVB_MODEL_PATH).")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise EngineUnavailable(f"Model file {path} is not a GGUF file (KVB_MODEL_PATH).")


def llama_cpp_fingerprint(settings: Settings, traits) -> dict[str, str]:
    """The in-process engine's namespace keys; the scheduler's own context uses the same."""
    import llama_cpp

    return {
        "engine_family": "llama.cpp",
        "llama_cpp_python": llama_cpp.__version__,
        "cache_type_k": settings.cache_type_k.lower(),
        "cache_type_v": settings.cache_type_v.lower(),
        "v_trans": "0" if settings.flash_attn else "1",
        **swa_fingerprint(traits),
    }


def swa_fingerprint(traits) -> dict[str, str]:
    """The sliding-window cache mode, for the namespace: both llama.cpp engines run sliding-window models
    with the full-size cache (swa_full), and say so identically so they keep sharing chunks. A plain
    model adds nothing (its namespace stays what it was)."""
    return {"swa": "full"} if traits is not None and traits.n_swa else {}
