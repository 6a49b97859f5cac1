"""A model's chat template, rendered in one place for every engine that renders prompts locally.

Place in the flow: chat messages -> **ChatTemplate.render** -> prompt text -> Backend.tokenize ->
chunk hashes. The in-process engine, llama-server and the vocab-only GGUF loader (Ollama) all render
here, so equal messages give equal text and, with equal tokenizers, equal token ids: chunk hashes
then agree across engines.

One rule for BOS: the tokenizer adds BOS itself when the model wants one (llama.cpp `add_bos`,
llama-server `add_special`), so a template that also writes the BOS text at its start has that text
stripped, exactly once. A template that raises (Jinja's `raise_exception`, a template error) is
counted (`chat_template_fallbacks` in the backend's counters) and the prompt falls back to ChatML.

Deliberately left out: tools, functions and any template variable beyond messages, bos/eos tokens
and the generation prompt; KVBridge sends plain chat.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Sequence

log = logging.getLogger(__name__)

FALLBACK_COUNTER = "chat_template_fallbacks"


def chatml(messages: Sequence[dict]) -> str:
    """The ChatML rendering used when a model carries no usable chat template."""
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


class ChatTemplate:
    """One model's Jinja chat template with its BOS/EOS texts; render() never raises for a bad template."""

    def __init__(self, template: str | None, *, bos_text: str, eos_text: str, tokenizer_adds_bos: bool,
                 counters: Counter[str], model_name: str = "the model"):
        self.template = template or ""
        self.bos_text = bos_text
        self.eos_text = eos_text
        self.tokenizer_adds_bos = tokenizer_adds_bos
        self.model_name = model_name
        self._counters = counters   # the backend's own Counter: CachedEngine moves it into Metrics
        self._formatter = None
        if self.template:
            # jinja2 through llama-cpp-python's formatter: Transformers' environment (sandbox,
            # loopcontrols, {% generation %}, tojson), imported only when a template exists
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            try:
                self._formatter = Jinja2ChatFormatter(template=self.template, eos_token=eos_text, bos_token=bos_text)
            except Exception as err:  # a template that does not even parse: every render falls back
                log.warning("chat template of %s does not parse (%s); prompts use ChatML", model_name, err)

    @property
    def has_template(self) -> bool:
        return self._formatter is not None

    def render(self, messages: Sequence[dict]) -> str:
        """The model's template applied to `messages` (with the generation prompt), else ChatML."""
        messages = [dict(m) for m in messages]
        if self._formatter is None:
            if self.template:
                self._counters[FALLBACK_COUNTER] += 1
            return self.strip_bos(chatml(messages))
        try:
            text = self._formatter(messages=messages).prompt
        except Exception as err:  # Jinja templates raise anything (raise_exception, TemplateError, TypeError...)
            self._counters[FALLBACK_COUNTER] += 1
            log.warning("chat template of %s failed (%s); using ChatML", self.model_name, err)
            text = chatml(messages)
        return self.strip_bos(text)

    def strip_bos(self, text: str) -> str:
        """Drop one leading BOS text when the tokenizer will add BOS itself (never two BOS tokens)."""
        if self.tokenizer_adds_bos and self.bos_text and text.startswith(self.bos_text):
            return text[len(self.bos_text):]
        return text


def template_of_llama(llm, counters: Counter[str], model_name: str) -> ChatTemplate:
    """The chat template a llama_cpp.Llama (full model or vocab_only) carries in its GGUF metadata."""

    def token_text(token: int) -> str:
        return llm.detokenize([token], special=True).decode("utf-8", "replace") if token >= 0 else ""

    # tokenizing nothing yields exactly the special tokens the tokenizer adds on its own (BOS or none)
    adds_bos = bool(llm.tokenize(b"", add_bos=True, special=True))
    return ChatTemplate(llm.metadata.get("tokenizer.chat_template"), bos_text=token_text(llm.token_bos()),
                        eos_text=token_text(llm.token_eos()), tokenizer_adds_bos=adds_bos, counters=counters,
                        model_name=model_name)
