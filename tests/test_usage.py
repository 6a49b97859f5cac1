"""Normalising every provider's cached-token counter, Ollama's estimate, and the approximate tokenizer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.backends.approx_tokenizer import ApproxTokenizer, approx_token_count
from kvbridge.backends.usage import (
    cached_tokens_from, ollama_cached_tokens, ollama_counts_whole_prompt, usage_counts_from,
)

REPO = Path(__file__).resolve().parent.parent


# --- cached_tokens_from: one case per provider's field --------------------------------------

@pytest.mark.parametrize("payload, expected", [
    ({"usage": {"prompt_tokens": 2006, "prompt_tokens_details": {"cached_tokens": 1920}}},
     (1920, "usage.prompt_tokens_details.cached_tokens")),                              # OpenAI, OpenRouter, vLLM
    ({"x_groq": {"usage": {"prompt_tokens_details": {"cached_tokens": 1024}}}},
     (1024, "x_groq.usage.prompt_tokens_details.cached_tokens")),                       # Groq
    ({"usage": {"prompt_cache_hit_tokens": 1536, "prompt_cache_miss_tokens": 114}},
     (1536, "usage.prompt_cache_hit_tokens")),                                          # DeepSeek
    ({"usage": {"input_tokens": 14, "cache_read_input_tokens": 1980}},
     (1980, "usage.cache_read_input_tokens")),                                          # Anthropic-style
    ({"timings": {"cache_n": 236, "prompt_n": 4}}, (236, "timings.cache_n")),           # llama-server
    ({"usageMetadata": {"cachedContentTokenCount": 4096}},
     (4096, "usageMetadata.cachedContentTokenCount")),                                  # Gemini native
    ({"usage": {"prompt_tokens_details": {"cached_tokens": 0}}},
     (0, "usage.prompt_tokens_details.cached_tokens")),                                 # a real zero is kept
])
def test_cached_tokens_from_each_provider_field(payload, expected):
    assert cached_tokens_from(payload) == expected


def test_llama_server_sends_both_fields_and_the_openai_one_is_read():
    payload = {"usage": {"prompt_tokens_details": {"cached_tokens": 236}}, "timings": {"cache_n": 236}}
    assert cached_tokens_from(payload) == (236, "usage.prompt_tokens_details.cached_tokens")


@pytest.mark.parametrize("payload", [
    {}, {"usage": None}, {"usage": {"prompt_tokens": 10}}, {"choices": []},
    {"usage": {"prompt_tokens_details": {"cached_tokens": None}}},
    {"usage": {"prompt_tokens_details": {"cached_tokens": -3}}},
    {"usage": {"prompt_tokens_details": {"cached_tokens": True}}},
    {"usage": {"prompt_tokens_details": {"cached_tokens": "12"}}},
    {"usage": {"prompt_tokens_details": None}},
])
def test_no_known_counter_means_unknown_not_zero(payload):
    assert cached_tokens_from(payload) == (None, None)


def test_usage_counts_anthropic_prompt_is_input_plus_cache_reads_and_writes():
    counts = usage_counts_from({"usage": {"input_tokens": 14, "output_tokens": 8, "cache_read_input_tokens": 1980,
                                          "cache_creation_input_tokens": 6}})
    assert (counts.prompt_tokens, counts.completion_tokens, counts.cached_tokens) == (2000, 8, 1980)
    assert counts.billed_tokens == 2008


def test_usage_counts_from_llama_server_timings_alone():
    counts = usage_counts_from({"timings": {"cache_n": 236, "prompt_n": 4, "predicted_n": 8}})
    assert (counts.prompt_tokens, counts.completion_tokens, counts.cached_tokens) == (240, 8, 236)
    assert counts.cached_field == "timings.cache_n"


def test_usage_counts_none_without_a_usage_block():
    assert usage_counts_from({"choices": [{"delta": {"content": "x"}}], "usage": None}) is None


# --- Ollama: which semantics, and the estimate ---------------------------------------------

def test_older_ollama_counts_evaluated_tokens_only():
    estimate = ollama_cached_tokens({"prompt_eval_count": 1, "prompt_eval_duration": 3_900_000}, 101,
                                    ns_per_prompt_token=None)
    assert (estimate.cached_tokens, estimate.evaluated_tokens, estimate.method) == (100, 1, "count")
    assert "prompt_eval_count 1" in estimate.note and "evaluated tokens only" in estimate.note


def test_newer_ollama_estimates_from_duration_at_the_calibrated_rate():
    # 4 ms per token cold (250 tokens/s, as measured for SmolLM2 here); 4.1 ms of prefill is one token.
    estimate = ollama_cached_tokens({"prompt_eval_count": 101, "prompt_eval_duration": 4_100_000}, 101,
                                    ns_per_prompt_token=4_000_000)
    assert (estimate.cached_tokens, estimate.evaluated_tokens, estimate.method) == (100, 1, "duration")
    assert estimate.prompt_tokens == 101
    assert "250 tokens/s" in estimate.note


def test_newer_ollama_before_calibration_is_unknown_and_says_why():
    estimate = ollama_cached_tokens({"prompt_eval_count": 101, "prompt_eval_duration": 4_100_000}, 101,
                                    ns_per_prompt_token=None)
    assert estimate.cached_tokens is None
    assert estimate.note == "cached unknown until a cold request calibrates the prefill rate"


def test_duration_estimate_is_clamped_to_the_prompt():
    slow = ollama_cached_tokens({"prompt_eval_count": 100, "prompt_eval_duration": 900_000_000}, 100,
                                ns_per_prompt_token=4_000_000)
    assert (slow.cached_tokens, slow.evaluated_tokens) == (0, 100)


def test_absent_prompt_eval_count_means_nothing_was_evaluated():
    estimate = ollama_cached_tokens({"eval_count": 8}, 101, ns_per_prompt_token=None)
    assert (estimate.cached_tokens, estimate.evaluated_tokens) == (101, 0)


def test_whole_prompt_margin_is_wider_for_an_approximate_tokenizer():
    assert ollama_counts_whole_prompt(100, 101, approx=False)
    assert not ollama_counts_whole_prompt(90, 101, approx=False)
    assert ollama_counts_whole_prompt(90, 101, approx=True)
    assert not ollama_counts_whole_prompt(40, 101, approx=True)


# --- the approximate tokenizer --------------------------------------------------------------

def test_approx_tokenizer_round_trips_and_keeps_prefixes():
    tokenizer = ApproxTokenizer()
    text = "Hello, world_x! 12345 naïve  tabs\tend. Über-long-word"
    ids = tokenizer.tokenize(text)
    assert tokenizer.detokenize(ids) == text
    assert ApproxTokenizer.pieces(text)[:4] == ["Hell", "o", ",", " wor"]
    assert all(0 <= i < 2 ** 32 for i in ids)
    longer = tokenizer.tokenize(text + " and more words follow here")
    assert longer[:len(ids)] == ids
    assert approx_token_count(text) == len(ids)


def test_approx_tokenizer_ids_are_the_same_in_every_process():
    """Chunk keys must survive restarts: no salted hash() anywhere."""
    code = ("import json; from kvbridge.backends.approx_tokenizer import ApproxTokenizer; "
            "print(json.dumps(ApproxTokenizer().tokenize('The same text, twice.')))")
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True,
                                      text=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout)
            for seed in ("1", "2")]
    assert runs[0] == runs[1] == ApproxTokenizer().tokenize("The same text, twice.")
    # pinned (blake2b, 4-byte digest, of each piece): a change here changes every approx chunk key
    assert runs[0] == [1393462268, 3292254438, 2636669083, 1127508772, 1692504232, 4288953519, 1608540186,
                       4179684484, 3634827914]
