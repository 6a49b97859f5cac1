"""A GGUF file's vocabulary and chat template, loaded without its weights (llama.cpp vocab_only).

Place in the flow: shadow engines (Ollama) run the model elsewhere, yet chunk hashes must cover the
token ids the engine really evaluates. Loading only the vocabulary costs about 0.1 s and little
memory, even for a multi-gigabyte GGUF.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from ..errors import EngineUnavailable

log = logging.getLogger(__name__)


def chatml(messages: Sequence[dict]) -> str:
    """The ChatML rendering used when a model carries no usable chat template."""
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


class GGUFVocab:
    """Tokenize, detokenize and render chat messages exactly as llama.cpp does for this GGUF."""

    def __init__(self, gguf_path: str | Path):
        import llama_cpp  # imported here: shadow engines must load even where llama-cpp-python is missing
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self.path = Path(gguf_path)
        try:
            self._llama = llama_cpp.Llama(str(self.path), vocab_only=True, verbose=False)
        except (ValueError, OSError, RuntimeError) as err:
            raise EngineUnavailable(f"cannot read the vocabulary of {self.path}: {err}") from None
        self._formatter = None
        self.template_failures = 0  # renders that fell back to ChatML because the template raised
        template = self._llama.metadata.get("tokenizer.chat_template")
        if template:
            self._bos_text = self._token_text(self._llama.token_bos())
            self._formatter = Jinja2ChatFormatter(
                template, eos_token=self._token_text(self._llama.token_eos()), bos_token=self._bos_text)

    def _token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self._llama.detokenize([token], special=True).decode("utf-8", "replace")

    @property
    def has_chat_template(self) -> bool:
        return self._formatter is not None

    def tokenize(self, text: str) -> list[int]:
        # add_bos=True adds BOS only when the model asks for it; special=True parses "<|im_start|>" etc.
        # as the single tokens they are, as Ollama and llama-server do for a raw prompt.
        return self._llama.tokenize(text.encode("utf-8"), add_bos=True, special=True)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._llama.detokenize(list(tokens), special=True).decode("utf-8", "replace")

    def render(self, messages: Sequence[dict]) -> str:
        """The model's own chat template when it has one that renders these messages, else ChatML."""
        if self._formatter is None:
            return chatml(messages)
        try:
            text = self._formatter(messages=[dict(m) for m in messages]).prompt
        except Exception as err:  # Jinja templates raise anything (raise_exception, TemplateError...)
            self.template_failures += 1
            log.warning("chat template of %s failed (%s); using ChatML", self.path.name, err)
            return chatml(messages)
        # tokenize() adds BOS itself when the model wants one; a template that also writes it would double it.
        if self._bos_text and text.startswith(self._bos_text) and self._adds_bos():
            text = text[len(self._bos_text):]
        return text

    def _adds_bos(self) -> bool:
        probe = self._llama.tokenize(b"x", add_bos=True, special=False)
        return bool(probe) and probe[0] == self._llama.token_bos()
