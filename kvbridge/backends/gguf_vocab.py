"""A GGUF file's vocabulary and chat template, loaded without its weights (llama.cpp vocab_only).

Place in the flow: shadow engines (Ollama) run the model elsewhere, yet chunk hashes must cover the
token ids the engine really evaluates. Loading only the vocabulary costs about 0.1 s and little
memory, even for a multi-gigabyte GGUF. Chat messages are rendered by the one shared ChatTemplate
(kvbridge.backends.chat_template), exactly as the in-process engine renders them.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Sequence

from kvbridge.errors import EngineUnavailable
from kvbridge.backends.chat_template import ChatTemplate, template_of_llama


class GGUFVocab:
    """Tokenize, detokenize and render chat messages exactly as llama.cpp does for this GGUF.

    `counters` is the owning backend's Counter: template fallbacks are counted there, and so reach
    CachedEngine's metrics.
    """

    def __init__(self, gguf_path: str | Path, counters: Counter[str] | None = None):
        import llama_cpp  # imported here: shadow engines must load even where llama-cpp-python is missing

        self.path = Path(gguf_path)
        try:
            self._llama = llama_cpp.Llama(str(self.path), vocab_only=True, verbose=False)
        except (ValueError, OSError, RuntimeError) as err:
            raise EngineUnavailable(f"cannot read the vocabulary of {self.path}: {err}") from None
        self.template: ChatTemplate = template_of_llama(
            self._llama, counters if counters is not None else Counter(), self.path.name)

    @property
    def has_chat_template(self) -> bool:
        return self.template.has_template

    @property
    def n_vocab(self) -> int:
        """Token ids run 0..n_vocab-1 (an id past it would crash llama.cpp's detokenizer: check first)."""
        return int(self._llama.n_vocab())

    @property
    def metadata(self) -> dict[str, str]:
        """The GGUF's metadata as llama.cpp read it (general.architecture, general.size_label, ...)."""
        return dict(self._llama.metadata)

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        # add_bos=True adds BOS only when the model asks for it; special=True parses "<|im_start|>" etc.
        # as the single tokens they are, as Ollama and llama-server do for a raw prompt.
        return self._llama.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._llama.detokenize(list(tokens), special=True).decode("utf-8", "replace")

    def render(self, messages: Sequence[dict]) -> str:
        """The model's own chat template when it has one that renders these messages, else ChatML."""
        return self.template.render(messages)
