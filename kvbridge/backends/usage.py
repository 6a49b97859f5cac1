"""Engine-reported ground truth: every provider's cached-token counter normalised to one number.

Place in the flow: shadow engines cannot hand out KV, so KVBridge predicts reuse from its own index
and puts the engine's own count of reused prompt tokens next to it (`EngineReport.engine_cached_tokens`).
Each provider spells that count differently; this module reads them all and says which field it read.
Ollama reports no cached-token field at all, so `ollama_cached_tokens` estimates it from the timings.
Pure functions only: no I/O, so the fixtures and the live tests check the same code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

# Where the cached-token count lives, most specific first. llama-server sends both the OpenAI field
# and timings.cache_n (they agree); the OpenAI field wins because every compatible provider uses it.
CACHED_TOKEN_FIELDS: tuple[tuple[str, ...], ...] = (
    ("usage", "prompt_tokens_details", "cached_tokens"),          # OpenAI, Groq, OpenRouter, vLLM, llama-server
    ("x_groq", "usage", "prompt_tokens_details", "cached_tokens"),  # Groq's streamed usage block
    ("usage", "prompt_cache_hit_tokens"),                          # DeepSeek
    ("usage", "cache_read_input_tokens"),                          # Anthropic-style
    ("timings", "cache_n"),                                        # llama-server
    ("usageMetadata", "cachedContentTokenCount"),                  # Gemini native
)


def _dig(payload: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = payload
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def _as_count(value: Any) -> int | None:
    """A non-negative integer count, or None for anything else (null, strings, floats with fractions)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, float) and value >= 0 and value.is_integer():
        return int(value)
    return None


def cached_tokens_from(payload: Mapping[str, Any]) -> tuple[int | None, str | None]:
    """(cached prompt tokens, dotted name of the field read) from one response or stream chunk.

    (None, None) when the payload carries no known counter: "unknown", never silently 0.
    """
    for path in CACHED_TOKEN_FIELDS:
        count = _as_count(_dig(payload, path))
        if count is not None:
            return count, ".".join(path)
    return None, None


@dataclass(frozen=True)
class UsageCounts:
    """Token counts a provider reported for one request (None: not reported)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cached_field: str | None = None

    @property
    def billed_tokens(self) -> int | None:
        if self.prompt_tokens is None and self.completion_tokens is None:
            return None
        return (self.prompt_tokens or 0) + (self.completion_tokens or 0)


def usage_counts_from(payload: Mapping[str, Any]) -> UsageCounts | None:
    """All token counts from a payload that carries a usage block; None when it carries none."""
    usage = payload.get("usage")
    if not isinstance(usage, Mapping):
        usage = _dig(payload, ("x_groq", "usage"))
    timings = payload.get("timings")
    if not isinstance(usage, Mapping) and not isinstance(timings, Mapping):
        return None
    usage = usage if isinstance(usage, Mapping) else {}
    prompt = _as_count(usage.get("prompt_tokens"))
    completion = _as_count(usage.get("completion_tokens"))
    if prompt is None and "input_tokens" in usage:
        # Anthropic counts cache reads and writes apart from input_tokens; the prompt is their sum.
        parts = [_as_count(usage.get(k)) for k in ("input_tokens", "cache_read_input_tokens",
                                                   "cache_creation_input_tokens")]
        prompt = sum(p for p in parts if p is not None)
        completion = _as_count(usage.get("output_tokens"))
    if prompt is None and isinstance(timings, Mapping):
        cache_n, prompt_n = _as_count(timings.get("cache_n")), _as_count(timings.get("prompt_n"))
        if cache_n is not None and prompt_n is not None:
            prompt = cache_n + prompt_n
        completion = completion if completion is not None else _as_count(timings.get("predicted_n"))
    cached, field_name = cached_tokens_from(payload)
    return UsageCounts(prompt, completion, cached, field_name)


# --- Ollama -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OllamaCacheEstimate:
    """Cached prompt tokens derived from an Ollama final line, and how they were derived."""

    cached_tokens: int | None
    prompt_tokens: int | None      # Ollama's own whole-prompt count when known
    evaluated_tokens: int | None   # tokens Ollama actually computed when known
    method: str                    # "count" (older Ollama), "duration" (newer), "unknown"
    note: str


def ollama_counts_whole_prompt(prompt_eval_count: int, our_prompt_tokens: int, approx: bool) -> bool:
    """Does this prompt_eval_count cover the whole prompt (newer Ollama, or any cold request)?

    Older Ollama counts only evaluated tokens, so a warm request reports far fewer than we tokenized.
    With the model's own vocabulary the counts agree to a token or two (BOS); an approximate
    tokenizer needs a wide margin.
    """
    margin = max(2, int(our_prompt_tokens * (0.25 if approx else 0.01)))
    return prompt_eval_count >= our_prompt_tokens - margin


def ollama_cached_tokens(
    final: Mapping[str, Any],
    our_prompt_tokens: int,
    *,
    ns_per_prompt_token: float | None,
    approx: bool = False,
) -> OllamaCacheEstimate:
    """Estimate cached tokens from Ollama's final NDJSON line (Ollama has no cached-token field).

    Newer Ollama: prompt_eval_count is the whole prompt and prompt_eval_duration covers only the
    uncached part, so cached = count - duration / (ns per token measured on a cold request).
    Older Ollama: prompt_eval_count is the evaluated tokens only, so cached = our count - it.
    """
    count = _as_count(final.get("prompt_eval_count"))
    duration_ns = _as_count(final.get("prompt_eval_duration"))
    if count is None:
        # Ollama omits zero counts (omitempty): nothing was evaluated, the whole prompt was reused.
        return OllamaCacheEstimate(our_prompt_tokens, None, 0, "count",
                                   "cached tokens: Ollama evaluated no prompt token (prompt_eval_count absent)")
    if not ollama_counts_whole_prompt(count, our_prompt_tokens, approx):
        cached = max(0, our_prompt_tokens - count)
        return OllamaCacheEstimate(cached, None, count, "count",
                                   f"cached tokens = our {our_prompt_tokens} prompt tokens - prompt_eval_count "
                                   f"{count} (Ollama counts evaluated tokens only)")
    if duration_ns is None:
        return OllamaCacheEstimate(None, count, None, "unknown",
                                   "cached unknown: Ollama sent no prompt_eval_duration")
    if not ns_per_prompt_token:
        return OllamaCacheEstimate(None, count, None, "unknown",
                                   "cached unknown until a cold request calibrates the prefill rate")
    evaluated = min(count, max(0, round(duration_ns / ns_per_prompt_token)))
    cached = count - evaluated
    rate = 1e9 / ns_per_prompt_token
    return OllamaCacheEstimate(cached, count, evaluated, "duration",
                               f"cached tokens estimated from prompt_eval_duration {duration_ns / 1e6:.1f} ms "
                               f"at the calibrated prefill rate {rate:.0f} tokens/s")
