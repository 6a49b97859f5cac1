"""LlamaServerBackend: llama.cpp's own HTTP server, with full KV through its slot files.

Place in the flow: prompt -> tokens (`POST /tokenize`) -> chunk hashes -> lookup -> restore (a slot
file, see slots.py) -> **suffix prefill + generate (`POST /completion`, streaming, prompt sent as
token ids)** -> store (`action=save`, see slots.py) -> chunks.

This module is the adapter itself: lifecycle, prompts, generation and what the KV is keyed by. The
server it talks to is started or attached in launch.py; KV leaves and returns through slot files in
slots.py (SlotKV). Slot files carry the same sequence-state bytes as llama-cpp-python's in-process
API (see kvbridge.formats.slot_file), so with the same model, cache types and V layout both engines
share one namespace and one set of stored chunks. The server runs with one slot (`-np 1`),
`--cache-ram 0` (its own RAM prompt cache would blur what our store saves) and a private
`--slot-save-path`.

Attached to a server whose slot directory is not on this machine (KVB_LLAMA_SERVER_URL without
KVB_LLAMA_SERVER_SLOT_DIR), the KV bytes cannot be read: `self.kv_by_reference` is True and slot
files stay on the server under content names (see slots.py).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Iterator, Sequence

import requests

from kvbridge.settings import Settings
from kvbridge.errors import BadSettings, EngineUnavailable, KVBridgeError
from kvbridge.backends.base import Backend, EngineReport, Message, Prompt, Sampling
from kvbridge.backends.model_traits import traits_of_file
from kvbridge.formats.architectures import ModelTraits
from kvbridge.backends.chat_template import ChatTemplate
from kvbridge.backends.llama_server.process import ServerProcess, built_build_info, pinned_llama_cpp_version
from kvbridge.backends.llama_server.api import LlamaServerError, fill_report, sse_events
from kvbridge.backends.llama_server.identity import ServerIdentity, server_identity
from kvbridge.backends.llama_server.launch import attach_to, start_own_server
from kvbridge.backends.llama_server.slots import SLOT_ID, SlotKV
from kvbridge.backends.llama_server.swa_probe import swa_full_refusal
from kvbridge.backends.llama_cpp_model import cache_type_problems, swa_fingerprint, model_file_problems
from kvbridge.backends.registry import EngineSpec, register_engine

HTTP_TIMEOUT_S = 30.0               # tokenize, props, slot actions
STREAM_TIMEOUT_S = (5.0, 600.0)     # /completion: connect, then the longest silence (a long cold prefill)


class LlamaServerBackend(SlotKV, Backend):
    """The engine adapter: lifecycle, prompts and generation here; slot-file KV in SlotKV (slots.py)."""

    key = "llama-server"
    kv_mode = "full"

    @classmethod
    def settings_problems(cls, settings: Settings, environ: Mapping[str, str]) -> list[str]:
        problems = cache_type_problems(settings)
        if settings.llama_server_url:
            return problems  # attaching to a running server: it has its own binary and model
        problems += model_file_problems(settings)
        binary = Path(settings.llama_server_bin).expanduser() if settings.llama_server_bin else None
        if binary is not None and not (binary.is_file() and os.access(binary, os.X_OK)):
            problems.append(f"KVB_LLAMA_SERVER_BIN={settings.llama_server_bin} is not an executable file; "
                            "leave it empty to use the one ./scripts/build_llama_server.sh builds")
        return problems
    assembles_in_place = True   # restores are assembled straight into a mapped slot file

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.server: ServerProcess | None = None
        self.base_url = ""
        self.slot_dir: Path | None = None    # where slot files can be read and written from here
        self.model_path: Path | None = None
        self.binary: Path | None = None
        self.n_ctx = settings.ctx_size
        self.build_info = ""
        self._http = requests.Session()
        self._context: list[int] = []
        self._props: dict = {}                     # GET /props of the server we talk to
        self.identity: ServerIdentity | None = None  # what the server reports about its model
        self._template: ChatTemplate | None = None
        self._lock = threading.Lock()
        self._init_slot_kv()
        self._traits: tuple[Path, ModelTraits] | None = None   # (model file, what llama.cpp says of it)

    @property
    def kv_by_reference(self) -> bool:
        """True when KV stays on the (remote) server and SeqState holds a slot-file name."""
        return bool(self.base_url) and self.slot_dir is None

    # lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self.base_url:
                return
            if self.settings.llama_server_url:
                url = self.settings.llama_server_url.rstrip("/")
                self.slot_dir = attach_to(self._http, url, self.settings)
                self.base_url = url
            else:
                self.server, self.binary, self.model_path = start_own_server(self.settings, self._traits_of)
                self.base_url, self.slot_dir = self.server.url, self.server.slot_dir
            try:
                self._read_props()
                refusal = swa_full_refusal(self) if self.server is None else ""   # ours runs with --swa-full
                if refusal:
                    raise EngineUnavailable(refusal)
            except KVBridgeError:
                self._release()  # a half-started engine would leave its server running
                raise
            self._context = []

    def _read_props(self) -> None:
        props = self._get_json("/props")
        self.n_ctx = int(props.get("default_generation_settings", {}).get("n_ctx") or self.settings.ctx_size)
        self.build_info = str(props.get("build_info", ""))
        if self.model_path is None and props.get("model_path"):
            self.model_path = Path(props["model_path"])  # attached: the server's own path, maybe not local
        if int(props.get("total_slots", 1)) < 1:
            raise EngineUnavailable(f"llama-server at {self.base_url} has no slots.")
        self._props = props
        self._template = None
        try:
            models = self._get_json("/v1/models")
        except LlamaServerError:
            models = None   # an older server without /v1/models: /props alone identifies less
        self.identity = server_identity(self.base_url, props, models)

    def stop(self) -> None:
        with self._lock:
            self._release()

    def _release(self) -> None:
        self._release_slot_kv()
        if self.server is not None:
            self.server.stop()
            self.server = None
        self.base_url = ""
        self.slot_dir = None
        self._context = []
        self._n_restored = None
        self.identity = None

    def describe(self) -> str:
        if not self.base_url:
            return "llama-server (not started)"
        model = self.model_path.name if self.model_path else "?"
        if self.model_file() is None and self.identity is not None and not self.identity.identified:
            model += (": the server does not identify its model, so its KV is kept in a namespace of this "
                      "connection only (not shared across reconnects)")
        if self.server is not None:
            return f"llama-server {self.base_url} (own process {self.server.pid}, {model}, slot files in {self.slot_dir})"
        if self.slot_dir is not None:
            return f"llama-server {self.base_url} (attached, {model}, slot files in {self.slot_dir})"
        return (f"llama-server {self.base_url} (attached, {model}; its slot directory is not on this machine: "
                f"whole-slot save/restore by file name, set KVB_LLAMA_SERVER_SLOT_DIR for chunked KV)")

    # HTTP helpers --------------------------------------------------------------------------
    def _url(self, path: str) -> str:
        if not self.base_url:
            raise EngineUnavailable("llama-server is not started; connect the engine first.")
        return self.base_url + path

    def _post_json(self, path: str, body: dict) -> dict:
        return self._request("POST", path, body)

    def _get_json(self, path: str) -> dict:
        return self._request("GET", path, None)

    def _request(self, method: str, path: str, body: dict | None) -> dict:
        """One JSON request. Every call made through here is idempotent (tokenize, props, slot
        save/restore/erase under a given file name), so a connection the server dropped is retried once."""
        url = self._url(path)
        for attempt in (1, 2):
            try:
                resp = self._http.request(method, url, json=body, timeout=HTTP_TIMEOUT_S)
                break
            except requests.ConnectionError as exc:
                if attempt == 2:
                    raise EngineUnavailable(f"llama-server at {self.base_url} did not answer {path}: {exc}") from exc
            except requests.RequestException as exc:
                raise EngineUnavailable(f"llama-server at {self.base_url} did not answer {path}: {exc}") from exc
        if resp.status_code != 200:
            raise LlamaServerError(path, resp)
        return resp.json()

    # prompts -------------------------------------------------------------------------------
    def render(self, messages: Sequence[Message]) -> str:
        """The GGUF's chat template (as /props reports it), rendered where the in-process engine renders it."""
        if self._template is None:
            props = self._props
            # tokenizing nothing yields exactly the special tokens the server adds on its own (BOS or none)
            adds_bos = bool(self.tokenize(""))
            self._template = ChatTemplate(
                props.get("chat_template") or None, bos_text=props.get("bos_token") or "",
                eos_text=props.get("eos_token") or "", tokenizer_adds_bos=adds_bos, counters=self.counters,
                model_name=self.model_path.name if self.model_path else self.base_url)
        return self._template.render(messages)

    def tokenize(self, text: str) -> list[int]:
        # add_special/parse_special mirror Llama.tokenize(add_bos=True, special=True) in-process:
        # identical ids are what lets both engines share a namespace.
        body = {"content": text, "add_special": True, "parse_special": True}
        return [int(t) for t in self._post_json("/tokenize", body)["tokens"]]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._post_json("/detokenize", {"tokens": [int(t) for t in tokens]})["content"]

    # generation ----------------------------------------------------------------------------
    def generate(self, prompt: Prompt, *, n_predict: int, temperature: float, use_native_cache: bool,
                 report: EngineReport) -> Iterator[str]:
        tokens = [int(t) for t in prompt.tokens]
        if len(tokens) + n_predict > self.n_ctx:
            raise BadSettings(f"The prompt ({len(tokens)} tokens) plus {n_predict} new tokens does not fit "
                              f"the context of {self.n_ctx} tokens (KVB_CTX_SIZE).")
        sampling = Sampling.for_temperature(temperature)   # the in-process engine's sampler
        body = {
            "prompt": tokens, "n_predict": n_predict, "stream": True, "return_tokens": True,
            "cache_prompt": use_native_cache, "id_slot": SLOT_ID,
            "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
            "min_p": sampling.min_p, "repeat_penalty": sampling.repeat_penalty,
            # a seed of our own marks the slot's task as ours (GET /slots shows it); greedy output ignores it
            "seed": self._new_task_seed(),
        }
        if not use_native_cache:
            report.notes.append("cold: cache_prompt=false, llama-server recomputes the whole prompt")
        generated: list[int] = []
        try:
            # Connection: close -- llama-server may drop a connection after a stream ends; a pooled
            # one would then fail the next request with "Remote end closed connection".
            resp = self._http.post(self._url("/completion"), json=body, stream=True, timeout=STREAM_TIMEOUT_S,
                                   headers={"Connection": "close"})
        except requests.RequestException as exc:
            raise EngineUnavailable(f"llama-server at {self.base_url} did not answer /completion: {exc}") from exc
        with resp:
            if resp.status_code != 200:
                raise LlamaServerError("/completion", resp)
            for event in sse_events(resp):
                generated.extend(int(t) for t in event.get("tokens") or ())
                if event.get("content"):
                    yield event["content"]
                if event.get("stop"):
                    fill_report(report, event, len(tokens))
        # the slot keeps the prompt and every generated token it evaluated (all but the last)
        self._context = tokens + generated[:-1]

    def reset_native_cache(self) -> None:
        self._post_json(f"/slots/{SLOT_ID}?action=erase", {})
        self._context = []

    # what the KV is keyed by ---------------------------------------------------------------
    def kv_fingerprint(self) -> dict[str, str]:
        """The in-process engine's keys, so equal configurations give one namespace.

        `llama_cpp_python` names the llama-cpp-python release whose vendored llama.cpp the server
        runs: known when its build_info (`b<n>-<commit>`) equals that of scripts/build_llama_server.sh's
        build for the pinned release; any other server is keyed by its own build_info and so never
        shares chunks with the in-process engine. `v_trans` follows KVB_FLASH_ATTN (flash attention
        off -> V transposed); an attached server started otherwise has its restores refused by
        llama.cpp, counted, and recomputed. A model file that is not on this machine cannot be hashed
        into the namespace: what the server reports about it is added instead (see identity.py).
        """
        version = pinned_llama_cpp_version()
        same_llama_cpp = bool(self.build_info) and self.build_info == built_build_info(version)
        fingerprint = {
            "engine_family": "llama.cpp",
            "llama_cpp_python": version if same_llama_cpp else f"llama-server {self.build_info or 'unknown build'}",
            "cache_type_k": self.settings.cache_type_k.lower(),
            "cache_type_v": self.settings.cache_type_v.lower(),
            "v_trans": "0" if self.settings.flash_attn else "1",
            **swa_fingerprint(self.model_traits()),
        }
        if self.model_file() is None and self.identity is not None:
            # the model file is not here to be hashed: what the server reports about it identifies it
            fingerprint.update(self.identity.fingerprint())
        return fingerprint

    def model_file(self) -> Path | None:
        """The GGUF the server runs, when it is a file on this machine (its sha256 keys the namespace)."""
        return self.model_path if self.model_path is not None and self.model_path.is_file() else None

    def _traits_of(self, path: Path) -> ModelTraits:
        if self._traits is None or self._traits[0] != path:
            self._traits = (path, traits_of_file(path))
        return self._traits[1]

    def model_traits(self) -> ModelTraits | None:
        """Read from the GGUF with llama.cpp; None (KV caching refused) when the server's model is not a file here."""
        model = self.model_file()
        return self._traits_of(model) if model is not None else None

    def context_tokens(self) -> list[int]:
        return list(self._context)



register_engine(EngineSpec(
    key="llama-server",
    label="llama-server (full KV, slot files)",
    cls=LlamaServerBackend,
    blurb="llama.cpp's HTTP server: KV leaves and returns through slot files, shared with the in-process engine.",
    aliases=("llamaserver", "server"),
    fields=("llama_server_bin", "llama_server_url", "llama_server_slot_dir", "llama_server_port", "model_path",
            "ctx_size", "threads",
            "flash_attn", "cache_type_k", "cache_type_v", "llama_start_timeout", "chunk_size"),
))
