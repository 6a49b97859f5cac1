"""Ollama in shadow mode: Ollama keeps its KV to itself, so KVBridge indexes and predicts.

Place in the flow: prompt -> **tokens (the model's own vocabulary, read vocab-only from Ollama's
model store; else approximate)** -> chunk hashes -> lookup (prediction only) -> **Ollama prefills and
generates (/api/generate, raw prompt, streamed)** -> **Ollama's own timings -> cached-token ground
truth** (kvbridge.backends.usage.ollama_cached_tokens).

Cold mode unloads the model first (keep_alive=0): Ollama's prompt cache lives in the loaded model's
context, so an unloaded model has nothing to reuse. That also calibrates the prefill rate that newer
Ollama versions need for a cached-token estimate.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any, Iterator, Sequence

import requests

from kvbridge.settings import Settings, env_name
from kvbridge.errors import BadSettings, EngineUnavailable, KVBridgeError
from kvbridge.backends.approx_tokenizer import ApproxTokenizer
from kvbridge.backends.base import Backend, EngineReport, Message, Prompt
from kvbridge.backends.chat_template import chatml
from kvbridge.backends.gguf_vocab import GGUFVocab
from kvbridge.backends.http_util import error_text, is_read_timeout, json_objects
from kvbridge.backends.ollama.model_store import locate_ollama_model
from kvbridge.backends.registry import EngineSpec, register_engine
from kvbridge.backends.usage import ollama_cached_tokens

log = logging.getLogger(__name__)

COLD_NOTE = "cold: model unloaded (keep_alive=0) before the request, so Ollama's prompt cache is empty"
MIN_CALIBRATION_TOKENS = 8   # shorter cold prompts are dominated by fixed overhead
MALFORMED_COUNTER = "malformed_stream_lines"   # in self.counters, so it reaches CachedEngine's metrics


def keep_alive_value(text: str) -> str | int:
    """KVB_OLLAMA_KEEP_ALIVE as Ollama wants it: "5m" stays a duration, "-1" or "300" become seconds."""
    text = (text or "").strip()
    try:
        return int(text)
    except ValueError:
        return text or "5m"


# Go's time.ParseDuration syntax, as Ollama reads keep_alive
_DURATION_RE = re.compile(r"-?(?:\d+(?:\.\d+)?(?:ns|us|ms|s|m|h)?)+")


class OllamaBackend(Backend):
    key = "ollama"
    kv_mode = "shadow"

    @classmethod
    def settings_problems(cls, settings: Settings, environ: Mapping[str, str]) -> list[str]:
        s = settings
        problems = []
        if not s.ollama_url:
            problems.append("KVB_OLLAMA_URL is empty; Ollama listens on http://127.0.0.1:11434 by default")
        if not s.ollama_model:
            problems.append("KVB_OLLAMA_MODEL is empty; name a model you have pulled (see `ollama list`), e.g. llama3.2")
        if not _DURATION_RE.fullmatch(s.ollama_keep_alive.strip()):
            problems.append(f"KVB_OLLAMA_KEEP_ALIVE={s.ollama_keep_alive!r} is not a duration; use e.g. 5m, 1h, 0 or -1")
        return problems
    connect_timeout_s = 5.0
    read_timeout_s = 300.0   # the first request after an unload waits for the model to load

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.url = settings.ollama_url.rstrip("/")
        self.model = settings.ollama_model.strip()
        self.server_version = ""
        self.vocab: GGUFVocab | None = None
        self.approx_tokens = True           # until start() finds the model's GGUF
        self.tokenizer_note = "not started"
        self.manifest_digest = ""           # of the local manifest whose GGUF gives the vocabulary
        self._approx = ApproxTokenizer()
        self._session: requests.Session | None = None
        self._calibration_ns = 0            # summed prompt_eval_duration of cold requests
        self._calibration_tokens = 0        # summed prompt_eval_count of the same requests

    # lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if not self.model:
            raise BadSettings(f"{env_name('ollama_model')} is empty: set it to a model Ollama has pulled, "
                              "e.g. KVB_OLLAMA_MODEL=llama3.2:1b (see `ollama list`).")
        self._session = requests.Session()
        version = self._request("GET", "/api/version", timeout=self.connect_timeout_s).json()
        self.server_version = str(version.get("version", "")) if isinstance(version, dict) else ""
        show = self._request("POST", "/api/show", body={"model": self.model}, allow=(404,))
        if show.status_code == 404:
            raise EngineUnavailable(f"Ollama at {self.url} has no model {self.model!r} "
                                    f"({env_name('ollama_model')}); pull it with `ollama pull {self.model}`.")
        self._load_vocabulary()

    def stop(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def describe(self) -> str:
        version = f" {self.server_version}" if self.server_version else ""
        return f"Ollama{version} at {self.url}, model {self.model} (tokens: {self.tokenizer_note})"

    def kv_fingerprint(self) -> dict[str, str]:
        """What separates this index from another: server, model, and which token ids it holds.

        The manifest digest names the exact model files, so no multi-gigabyte GGUF needs hashing.
        """
        return {"engine": self.key, "url": self.url, "model": self.model,
                "tokens": f"gguf {self.manifest_digest}" if not self.approx_tokens else "approx v1"}

    def _load_vocabulary(self) -> None:
        """Use the model's real vocabulary when Ollama's store on this machine holds its GGUF."""
        found = locate_ollama_model(self.settings.ollama_models, self.model)
        if found is None:
            self._use_approx(f"approx (no GGUF for {self.model!r} under "
                             f"{env_name('ollama_models')}={self.settings.ollama_models})")
            return
        served = self._served_manifest_digest()
        if served and served != found.manifest_digest.split(":", 1)[1]:
            self._use_approx(f"approx (the local store's {self.model!r} differs from the one Ollama serves)")
            return
        try:
            self.vocab = GGUFVocab(found.gguf_path, self.counters)
        except EngineUnavailable as err:
            self._use_approx(f"approx ({err})")
            return
        self.approx_tokens = False
        self.manifest_digest = found.manifest_digest
        self.tokenizer_note = f"model vocabulary from {found.gguf_path.name}"

    def _use_approx(self, why: str) -> None:
        log.warning("Ollama model %s: %s", self.model, why)
        self.vocab, self.approx_tokens, self.tokenizer_note, self.manifest_digest = None, True, why, ""

    def _served_manifest_digest(self) -> str:
        """The manifest digest Ollama lists for our model ('' when it does not say)."""
        tags = self._request("GET", "/api/tags", timeout=self.connect_timeout_s).json()
        wanted = {self.model, f"{self.model}:latest"}
        for entry in tags.get("models", []) if isinstance(tags, dict) else []:
            if isinstance(entry, dict) and (entry.get("name") in wanted or entry.get("model") in wanted):
                return str(entry.get("digest", "")).removeprefix("sha256:")
        return ""

    # prompts -------------------------------------------------------------------------------
    def render(self, messages: Sequence[Message]) -> str:
        return self.vocab.render(messages) if self.vocab else chatml(messages)

    def tokenize(self, text: str) -> list[int]:
        return self.vocab.tokenize(text) if self.vocab else self._approx.tokenize(text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.vocab.detokenize(tokens) if self.vocab else self._approx.detokenize(tokens)

    # generation ----------------------------------------------------------------------------
    @property
    def prefill_ns_per_token(self) -> float | None:
        """Ollama's cold prefill cost per prompt token, measured on cold requests (None: not yet)."""
        return self._calibration_ns / self._calibration_tokens if self._calibration_tokens else None

    def reset_native_cache(self) -> None:
        """Unload the model: its context, and with it Ollama's prompt cache, is freed."""
        self._request("POST", "/api/generate", body={"model": self.model, "keep_alive": 0}).close()

    def generate(self, prompt: Prompt, *, n_predict: int, temperature: float, use_native_cache: bool,
                 report: EngineReport) -> Iterator[str]:
        if not use_native_cache:
            self.reset_native_cache()
            report.notes.append(COLD_NOTE)
        request = {
            "model": self.model, "prompt": prompt.text, "raw": True, "stream": True,
            "keep_alive": keep_alive_value(self.settings.ollama_keep_alive),
            "options": {"temperature": temperature, "num_predict": n_predict, "seed": 0,
                        "num_ctx": self.settings.ctx_size},
        }
        response = self._request("POST", "/api/generate", body=request, stream=True)
        final: dict[str, Any] | None = None
        malformed = 0
        try:
            for event in json_objects(response.iter_lines()):
                if event is None:
                    malformed += 1
                    continue
                if event.get("error"):
                    raise EngineUnavailable(f"Ollama reported an error: {event['error']}")
                piece = event.get("response") or ""
                if piece:
                    yield piece
                if event.get("done"):
                    final = event
        except requests.RequestException as err:
            if is_read_timeout(err):
                raise EngineUnavailable(f"Ollama at {self.url} sent nothing for {self.read_timeout_s:g} s "
                                        "mid-stream") from None
            raise EngineUnavailable(f"the stream from Ollama at {self.url} broke off: {type(err).__name__}") from None
        finally:
            response.close()
        if malformed:
            self.counters[MALFORMED_COUNTER] += malformed
            report.notes.append(f"skipped {malformed} malformed line(s) in Ollama's stream")
        if final is None:
            raise EngineUnavailable(f"Ollama's stream ended without its final line ({self.url}/api/generate)")
        self._fill_report(final, prompt, report, cold=not use_native_cache)

    def _fill_report(self, final: dict, prompt: Prompt, report: EngineReport, *, cold: bool) -> None:
        our_tokens = len(prompt.tokens)
        approx = self.approx_tokens or prompt.approx_tokens
        eval_count = final.get("eval_count")
        report.completion_tokens = eval_count if isinstance(eval_count, int) else None
        if cold:
            self._calibrate(final)
        estimate = ollama_cached_tokens(final, our_tokens, ns_per_prompt_token=self.prefill_ns_per_token,
                                        approx=approx)
        report.prompt_tokens = estimate.prompt_tokens if estimate.prompt_tokens is not None else our_tokens
        report.engine_cached_tokens = estimate.cached_tokens
        report.engine_prefill_tokens = estimate.evaluated_tokens
        report.notes.append(estimate.note)

    def _calibrate(self, final: dict) -> None:
        count, duration = final.get("prompt_eval_count"), final.get("prompt_eval_duration")
        if isinstance(count, int) and isinstance(duration, int) and count >= MIN_CALIBRATION_TOKENS and duration > 0:
            self._calibration_ns += duration
            self._calibration_tokens += count

    # HTTP ----------------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, body: dict | None = None, stream: bool = False,
                 timeout: float | None = None, allow: tuple[int, ...] = ()) -> requests.Response:
        """One call to Ollama; every failure becomes an EngineUnavailable naming KVB_OLLAMA_URL."""
        session = self._session or requests.Session()
        self._session = session
        url = f"{self.url}{path}"
        try:
            response = session.request(method, url, json=body, stream=stream,
                                       timeout=(self.connect_timeout_s, timeout or self.read_timeout_s))
        except requests.ConnectionError:
            raise EngineUnavailable(f"Ollama is not reachable at {self.url} ({env_name('ollama_url')}). "
                                    "Start it with `ollama serve`, or point KVB_OLLAMA_URL at a running "
                                    "Ollama.") from None
        except requests.Timeout:
            raise EngineUnavailable(f"Ollama at {self.url} did not answer {method} {path} in time "
                                    f"({env_name('ollama_url')}).") from None
        if response.status_code >= 400 and response.status_code not in allow:
            detail = error_text(response)
            response.close()
            raise KVBridgeError(f"Ollama refused {method} {path} ({response.status_code}): {detail}"
                                + (f" (model {self.model!r}, {env_name('ollama_model')})"
                                   if response.status_code == 404 else ""))
        return response


register_engine(EngineSpec(
    key="ollama",
    label="Ollama (shadow)",
    cls=OllamaBackend,
    blurb="A model served by Ollama; KVBridge predicts reuse and compares it with Ollama's own prompt cache.",
    aliases=(),
    fields=("ollama_url", "ollama_model", "ollama_keep_alive", "ollama_models", "ctx_size"),
))
