"""Reading ModelTraits from llama.cpp: from a loaded model, or from a GGUF file (mmapped, not read).

Both llama.cpp engines and the scheduler ask here, so the verdict of kvbridge.formats.architectures
is the same whichever engine runs the model.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

from kvbridge.errors import EngineUnavailable
from kvbridge.formats.architectures import ModelTraits


def traits_of_model(model) -> ModelTraits:
    """`model`: a llama_model pointer (llama_cpp.Llama().model)."""
    import llama_cpp

    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf))
    return ModelTraits(architecture=buf.value.decode("utf-8", "replace") if n > 0 else "",
                       n_layer=int(llama_cpp.llama_model_n_layer(model)),
                       n_swa=int(llama_cpp.llama_model_n_swa(model)),
                       recurrent=bool(llama_cpp.llama_model_is_recurrent(model)),
                       hybrid=bool(llama_cpp.llama_model_is_hybrid(model)))


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
