"""Reading ModelTraits from llama.cpp: from a loaded model, or from a GGUF file (mmapped, not read).

Both llama.cpp engines and the scheduler ask here, so the verdict of kvbridge.formats.architectures
is the same whichever engine runs the model.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

from kvbridge.errors import EngineUnavailable
from kvbridge.formats.architectures import CELL_EXT_BYTES, KV_SHARED_FROM, MROPE_ROPE_TYPES, ModelTraits


def traits_of_model(model) -> ModelTraits:
    """`model`: a llama_model pointer (llama_cpp.Llama().model)."""
    import llama_cpp

    architecture = _meta(model, "general.architecture")
    n_layer = int(llama_cpp.llama_model_n_layer(model))
    # later layers that reuse an earlier layer's KV (Gemma 3n) keep none of their own in a state
    shared = _meta(model, f"{architecture}.attention.shared_kv_layers")
    kv_layers = n_layer - int(shared) if shared.isdigit() and 0 < int(shared) < n_layer else 0
    if not kv_layers and 0 < KV_SHARED_FROM.get(architecture, 0) < n_layer:
        kv_layers = KV_SHARED_FROM[architecture]
    rope_type = int(llama_cpp.llama_model_rope_type(model))
    return ModelTraits(architecture=architecture, n_layer=n_layer,
                       n_swa=int(llama_cpp.llama_model_n_swa(model)),
                       recurrent=bool(llama_cpp.llama_model_is_recurrent(model)),
                       hybrid=bool(llama_cpp.llama_model_is_hybrid(model)),
                       cell_ext=CELL_EXT_BYTES if rope_type in MROPE_ROPE_TYPES else 0,
                       kv_layers=kv_layers)


def _meta(model, key: str) -> str:
    """A GGUF metadata value as llama.cpp read it, as text ("" when the model has no such key)."""
    import llama_cpp

    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n > 0 else ""


def traits_of_file(path: Path) -> ModelTraits:
    """Load the GGUF's hyperparameters with llama.cpp (weights mmapped and never touched: under a second)."""
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.use_mmap = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise EngineUnavailable(f"llama.cpp could not load {path} to read what kind of model it is (KVB_MODEL_PATH).")
    try:
        return traits_of_model(model)
    finally:
        llama_cpp.llama_model_free(model)
