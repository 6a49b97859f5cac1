"""Which KV layouts KVBridge restores, decided from what llama.cpp says about the model.

Place in the flow: engine start -> **model traits -> KVSupport** -> probe the layout -> namespace.
The decision rests on the model (`general.architecture`, `llama_model_n_swa`,
`llama_model_is_recurrent`, `llama_model_is_hybrid`), never on whether some bytes happen to parse:
- a plain KV cache (n_swa = 0, not recurrent, not hybrid: llama, qwen2, mistral and the like) is
  accepted, as it always was;
- a sliding-window model is accepted only for architectures whose layout was proven token for token
  against cold prefills (SLIDING_WINDOW_PROVEN: Gemma 3's standard window over two caches);
- recurrent and hybrid models (Mamba 2, RWKV 7, LFM2, Granite 4 hybrid, Qwen3.5, ...) keep state that is
  not per-position KV: it cannot be cut by position, but it can be captured where a chunk ends. They
  are accepted as "recurrent" (the engine prefills in chunk-aligned steps and keeps the recurrent state
  at each boundary with that chunk) for the architectures proven against cold prefills on the model
  zoo (RECURRENT_PROVEN), and only where the engine can capture (Backend.captures_recurrent);
- anything else is refused with the reason. A refused model runs uncached: nothing is stored or restored.
"""
from __future__ import annotations

from dataclasses import dataclass

# Sliding-window architectures whose state layout (a global cache, then a standard sliding-window
# cache) is tested end to end: restored answers equal cold ones (tests/test_model_matrix.py).
SLIDING_WINDOW_PROVEN = frozenset({"gemma3", "gemma2", "gpt-oss", "cohere2", "llama4", "gemma3n"})
# Recurrent and hybrid architectures whose state (attention KV as a plain cache, then one recurrent
# section per sequence) restores from chunks exactly as a cold prefill (tests/test_zoo_recurrent.py).
RECURRENT_PROVEN = frozenset({"mamba2", "rwkv7", "lfm2", "granitehybrid", "qwen35", "qwen3next", "falcon-h1"})
# llama.cpp's rope types whose KV cells carry extra per-cell data (llama_kv_cell_ext: the M-RoPE 2D
# position and the token id, 12 bytes) in a sequence state
MROPE_ROPE_TYPES = frozenset({8, 40})   # LLAMA_ROPE_TYPE_MROPE, LLAMA_ROPE_TYPE_IMROPE
CELL_EXT_BYTES = 12
# Architectures whose later layers reuse an earlier layer's KV from a layer llama.cpp fixes in code rather
# than reading `{arch}.attention.shared_kv_layers` (src/models/gemma3n.cpp: n_layer_kv_from_start = 20)
KV_SHARED_FROM = {"gemma3n": 20}


@dataclass(frozen=True)
class ModelTraits:
    """What llama.cpp reports about a loaded model."""

    architecture: str      # GGUF general.architecture
    n_layer: int
    n_swa: int             # llama_model_n_swa: 0 when no layer has a sliding window
    recurrent: bool        # llama_model_is_recurrent
    hybrid: bool           # llama_model_is_hybrid
    cell_ext: int = 0      # bytes of extra data per KV cell in a state (M-RoPE models: CELL_EXT_BYTES)
    kv_layers: int = 0     # layers that keep KV of their own (fewer when later layers share it); 0: n_layer

    @property
    def own_kv_layers(self) -> int:
        return self.kv_layers or self.n_layer

    def summary(self) -> str:
        kind = "recurrent" if self.recurrent else "hybrid" if self.hybrid else (
            f"sliding window {self.n_swa}" if self.n_swa else "plain KV")
        return f"{self.architecture}, {self.n_layer} layers, {kind}"


@dataclass(frozen=True)
class KVSupport:
    """The verdict: layout 'plain', 'sliding-window', 'recurrent' or 'refused' (with the reason, for a person).

    recurrent: the state ends with a recurrent section captured at chunk boundaries; attention: it also
    holds a plain attention cache first (hybrid), which a purely recurrent model's state does not.
    """

    layout: str
    window: int = 0
    reason: str = ""
    attention: bool = True
    cell_ext: int = 0

    @property
    def recurrent(self) -> bool:
        return self.layout == "recurrent"

    @property
    def refused(self) -> bool:
        return self.layout == "refused"


def kv_support(traits: ModelTraits, *, captures_recurrent: bool = True) -> KVSupport:
    """What KVBridge does with this model's KV. captures_recurrent: the engine can keep the recurrent
    state at chunk boundaries while it prefills (llama.cpp in-process can; a llama-server cannot)."""
    arch = traits.architecture or "unknown"
    if traits.recurrent or traits.hybrid:
        kind = "recurrent" if traits.recurrent else "hybrid (attention with recurrent state)"
        if arch not in RECURRENT_PROVEN:
            return KVSupport("refused", reason=(
                f"the {arch} architecture is {kind}, in a layout KVBridge has not proven against cold prefills "
                f"(proven: {', '.join(sorted(RECURRENT_PROVEN))}); it runs uncached"))
        if traits.n_swa:
            return KVSupport("refused", reason=(
                f"the {arch} architecture is {kind} with sliding-window attention (window {traits.n_swa}), a "
                "combination KVBridge does not restore; it runs uncached"))
        if not captures_recurrent:
            return KVSupport("refused", reason=(
                f"the {arch} architecture is {kind}: its recurrent state must be captured where each chunk ends "
                "while the prompt is prefilled, which this engine cannot do (llama.cpp in-process can: "
                "KVB_ENGINE=llamacpp); it runs uncached"))
        return KVSupport("recurrent", attention=traits.hybrid, cell_ext=traits.cell_ext)
    if traits.n_swa:
        if arch in SLIDING_WINDOW_PROVEN:
            return KVSupport("sliding-window", window=traits.n_swa, cell_ext=traits.cell_ext)
        return KVSupport("refused", reason=(
            f"the {arch} architecture uses sliding-window attention (window {traits.n_swa}) in a layout KVBridge has "
            f"not proven (proven: {', '.join(sorted(SLIDING_WINDOW_PROVEN))}); it runs uncached"))
    return KVSupport("plain", cell_ext=traits.cell_ext)
