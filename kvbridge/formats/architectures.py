"""Which KV layouts KVBridge restores, decided from what llama.cpp says about the model.

Place in the flow: engine start -> **model traits -> KVSupport** -> probe the layout -> namespace.
The decision rests on the model (`general.architecture`, `llama_model_n_swa`,
`llama_model_is_recurrent`, `llama_model_is_hybrid`), never on whether some bytes happen to parse:
- a plain KV cache (n_swa = 0, not recurrent, not hybrid: llama, qwen2, mistral and the like) is
  accepted, as it always was;
- a sliding-window model is accepted only for architectures whose layout was proven token for token
  against cold prefills (SLIDING_WINDOW_PROVEN: Gemma 3's standard window over two caches);
- recurrent and hybrid models (Mamba, RWKV, Qwen3-Next, Granite 4, ...) keep state that is not
  per-position KV, and other sliding-window architectures (gpt-oss, Llama 4's chunked window, ...)
  are unproven: they are refused. A refused model runs uncached: nothing is stored or restored.
"""
from __future__ import annotations

from dataclasses import dataclass

# Sliding-window architectures whose state layout (a global cache, then a standard sliding-window
# cache) is tested end to end: restored answers equal cold ones (tests/test_model_matrix.py).
SLIDING_WINDOW_PROVEN = frozenset({"gemma3"})


@dataclass(frozen=True)
class ModelTraits:
    """What llama.cpp reports about a loaded model."""

    architecture: str      # GGUF general.architecture
    n_layer: int
    n_swa: int             # llama_model_n_swa: 0 when no layer has a sliding window
    recurrent: bool        # llama_model_is_recurrent
    hybrid: bool           # llama_model_is_hybrid

    def summary(self) -> str:
        kind = "recurrent" if self.recurrent else "hybrid" if self.hybrid else (
            f"sliding window {self.n_swa}" if self.n_swa else "plain KV")
        return f"{self.architecture}, {self.n_layer} layers, {kind}"


@dataclass(frozen=True)
class KVSupport:
    """The verdict: layout 'plain', 'sliding-window' or 'refused' (with the reason, for a person)."""

    layout: str
    window: int = 0
    reason: str = ""

    @property
    def refused(self) -> bool:
        return self.layout == "refused"


def kv_support(traits: ModelTraits) -> KVSupport:
    arch = traits.architecture or "unknown"
    if traits.recurrent or traits.hybrid:
        kind = "recurrent" if traits.recurrent else "hybrid (attention with recurrent state)"
        return KVSupport("refused", reason=(
            f"the {arch} architecture is {kind}: its state is not per-position KV, so KVBridge cannot cut it into "
            "chunks or prove a restore; it runs uncached"))
    if traits.n_swa:
        if arch in SLIDING_WINDOW_PROVEN:
            return KVSupport("sliding-window", window=traits.n_swa)
        return KVSupport("refused", reason=(
            f"the {arch} architecture uses sliding-window attention (window {traits.n_swa}) in a layout KVBridge has "
            f"not proven (proven: {', '.join(sorted(SLIDING_WINDOW_PROVEN))}); it runs uncached"))
    return KVSupport("plain")
