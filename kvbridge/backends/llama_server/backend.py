"""LlamaServerBackend: llama.cpp's own HTTP server, with full KV through its slot files.

Place in the flow: prompt -> tokens (`POST /tokenize`) -> chunk hashes -> lookup -> **restore: write
a slot file, `POST /slots/0?action=restore`** -> suffix prefill + generate (`POST /completion`,
streaming, prompt sent as token ids) -> **store: `action=save`, read the slot file** -> chunks.

Slot files carry the same sequence-state bytes as llama-cpp-python's in-process API (see
kvbridge.formats.slot_file), so with the same model, cache types and V layout both engines share
one namespace and one set of stored chunks. The server runs with one slot (`-np 1`), `--cache-ram 0`
(its own RAM prompt cache would blur what our store saves) and a private `--slot-save-path`.

Attached to a server whose slot directory is not on this machine (KVB_LLAMA_SERVER_URL without
KVB_LLAMA_SERVER_SLOT_DIR), the KV bytes cannot be read: save_state() then keeps the slot file on
the server under a content name and returns a reference (`SeqState.data` starts with SLOT_REF_MAGIC,
`self.kv_by_reference` is True); restore_state() restores that file by name.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Iterator, Sequence

import requests

from kvbridge.settings import Settings
from kvbridge.errors import BadSettings, EngineUnavailable, KVBridgeError, StateTransferError
from kvbridge.backends.base import Backend, EngineReport, Message, Prompt, Sampling, SeqState, WindowCapture
from kvbridge.backends.model_traits import traits_of_file
from kvbridge.formats.architectures import ModelTraits
from kvbridge.backends.chat_template import ChatTemplate
from kvbridge.backends.llama_server.process import (
    ServerProcess, build_advice, built_binary, built_build_info, free_port, pinned_llama_cpp_version, port_is_free)
from kvbridge.backends.llama_server.api import LlamaServerError, fill_report, slot_timing, sse_events
from kvbridge.backends.llama_server.identity import ServerIdentity, server_identity
from kvbridge.backends.llama_server.swa_probe import swa_full_refusal
from kvbridge.backends.llamacpp import (cache_type_problems, swa_fingerprint, check_model_file, ggml_type_id, model_file_problems,
                                       model_path_for)
from kvbridge.backends.registry import EngineSpec, register_engine
from kvbridge.formats.slot_file import MappedSlotFile, SlotFileError, build_slot_file, read_slot_file, write_in_place

SLOT_ID = 0
SLOT_REF_MAGIC = b"KVBSLOTREF1\0"   # SeqState.data of a remote slot file: magic, u32 n_tokens, file name
HTTP_TIMEOUT_S = 30.0               # tokenize, props, slot actions
STREAM_TIMEOUT_S = (5.0, 600.0)     # /completion: connect, then the longest silence (a long cold prefill)


class RestoreFailed(StateTransferError):
    """llama-server refused a slot file (or it could not be written here); the engine recomputes."""


class LlamaServerBackend(Backend):
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
        self.last_save_ms: float | None = None      # llama-server's own timings of the last slot action
        self.last_restore_ms: float | None = None
        self._http = requests.Session()
        self._context: list[int] = []
        self._props: dict = {}                     # GET /props of the server we talk to
        self.identity: ServerIdentity | None = None  # what the server reports about its model
        self._template: ChatTemplate | None = None
        self._n_restored: int | None = None        # the server's own count from the last restore action
        self._task_seed: int | None = None         # the seed our last /completion sent (marks its task)
        self._lock = threading.Lock()
        self._restore_name = f"kvb-restore-{uuid.uuid4().hex}.bin"
        self._mapped: MappedSlotFile | None = None   # the restore file while the engine assembles into it
        self._file_tokens: list[int] | None = None  # tokens of the complete state in the restore file
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
                self._attach(self.settings.llama_server_url.rstrip("/"))
            else:
                self._start_own()
            try:
                self._read_props()
                refusal = swa_full_refusal(self) if self.server is None else ""   # ours runs with --swa-full
                if refusal:
                    raise EngineUnavailable(refusal)
            except KVBridgeError:
                self._release()  # a half-started engine would leave its server running
                raise
            self._context = []

    def _start_own(self) -> None:
        binary = self._resolve_binary()
        model = model_path_for(self.settings)
        check_model_file(model)
        ggml_type_id(self.settings.cache_type_k, "KVB_CACHE_TYPE_K")
        ggml_type_id(self.settings.cache_type_v, "KVB_CACHE_TYPE_V")
        chosen_port = self.settings.llama_server_port
        if chosen_port and not port_is_free(chosen_port):
            raise EngineUnavailable(
                f"Port {chosen_port} on 127.0.0.1 is already in use (KVB_LLAMA_SERVER_PORT); "
                f"choose another port or 0 for any free one.")
        threads = str(self.settings.resolved_threads())
        args = [
            "--model", str(model), "--ctx-size", str(self.settings.ctx_size),
            "--threads", threads, "--threads-batch", threads,
            "--parallel", "1", "--cache-ram", "0",
            "--flash-attn", "on" if self.settings.flash_attn else "off",
            "--cache-type-k", self.settings.cache_type_k.lower(),
            "--cache-type-v", self.settings.cache_type_v.lower(),
            # the in-process engine's batch sizes, so both evaluate prompts the same way
            "--batch-size", "512", "--ubatch-size", "512",
            "--no-webui", "--no-warmup",
        ]
        if self._traits_of(model).n_swa:
            # every cell of the sliding-window cache is kept, so earlier window rows can be captured
            # (capture_window) and the server trims a restored prompt like any other (see Docs/Models.md)
            args.append("--swa-full")
        for attempt in (1, 2):
            server = ServerProcess(binary, args, "127.0.0.1", chosen_port or free_port())
            server.start()
            try:
                server.wait_healthy(self.settings.llama_start_timeout)
                break
            except EngineUnavailable as exc:
                # a free port can be taken between our probe and the server's bind: try another once
                if chosen_port or attempt == 2 or "KVB_LLAMA_SERVER_PORT" not in str(exc):
                    raise
        self.server, self.binary, self.model_path = server, binary, model
        self.base_url, self.slot_dir = server.url, server.slot_dir

    def _resolve_binary(self) -> Path:
        if self.settings.llama_server_bin:
            binary = Path(self.settings.llama_server_bin).expanduser()
            where = f"KVB_LLAMA_SERVER_BIN={self.settings.llama_server_bin}"
        else:
            binary = built_binary(pinned_llama_cpp_version())
            where = "the default build location; KVB_LLAMA_SERVER_BIN can point at another binary"
        if not binary.is_file():
            raise EngineUnavailable(f"llama-server binary {binary} does not exist ({where}). "
                                    f"{build_advice()}.")
        if not binary.stat().st_mode & 0o111:
            raise EngineUnavailable(f"llama-server binary {binary} is not executable ({where}).")
        return binary

    def _attach(self, url: str) -> None:
        try:
            ok = self._http.get(f"{url}/health", timeout=5).status_code == 200
        except requests.RequestException as exc:
            raise EngineUnavailable(f"No llama-server answers at {url} (KVB_LLAMA_SERVER_URL): {exc}") from exc
        if not ok:
            raise EngineUnavailable(f"llama-server at {url} (KVB_LLAMA_SERVER_URL) is not healthy (still loading?).")
        slot_dir = self.settings.llama_server_slot_dir
        if slot_dir and not Path(slot_dir).expanduser().is_dir():
            raise EngineUnavailable(f"KVB_LLAMA_SERVER_SLOT_DIR={slot_dir} is not a directory on this machine.")
        self.base_url = url
        self.slot_dir = Path(slot_dir).expanduser() if slot_dir else None

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
        self._file_tokens = None
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None
        if self.slot_dir is not None:
            (self.slot_dir / self._restore_name).unlink(missing_ok=True)
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

    def _new_task_seed(self) -> int:
        self._task_seed = secrets.randbelow(0xFFFFFFFF)   # 0xFFFFFFFF itself means "random" to llama.cpp
        return self._task_seed

    def _slot_last_ran_ours(self) -> bool | None:
        """Whether the slot's latest task is our last /completion (its seed is ours); None: cannot tell."""
        try:
            slots = self._get_json("/slots")
        except LlamaServerError:
            return None   # a server started with --no-slots
        slot = next((s for s in slots if isinstance(s, dict) and s.get("id") == SLOT_ID), None) \
            if isinstance(slots, list) else None
        seed = ((slot or {}).get("params") or {}).get("seed")
        if seed is None or self._task_seed is None:
            return None
        return int(seed) == self._task_seed and not slot.get("is_processing")

    def reset_native_cache(self) -> None:
        self._post_json(f"/slots/{SLOT_ID}?action=erase", {})
        self._context = []

    # full KV access ------------------------------------------------------------------------
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

    def capture_window(self, n_tokens: int) -> WindowCapture | None:
        """Truncate the slot to its first n_tokens (a one-token request that reuses them: the server
        re-evaluates the last one) and save it: the slot file's sliding-window cache then holds the window
        ending there. The re-evaluated position is not trusted (trusted_end = n_tokens - 1)."""
        context = list(self._context)
        if self.slot_dir is None or n_tokens < 2 or n_tokens > len(context):
            return None
        tokens = context[:n_tokens]
        body = {"prompt": tokens, "n_predict": 1, "cache_prompt": True, "id_slot": SLOT_ID, "stream": False,
                "temperature": 0.0, "seed": self._new_task_seed()}
        try:
            self._post_json("/completion", body)
        except LlamaServerError as exc:
            raise StateTransferError(f"llama-server did not truncate its slot: {exc}") from exc
        self._context = tokens
        state = self.save_state()
        if state.token_ids is None or list(state.token_ids[:n_tokens]) != tokens:
            return None   # the slot ran another client's task in between: nothing of it is ours
        return WindowCapture(data=state.data, whole_state=True, trusted_end=n_tokens - 1)

    def context_tokens(self) -> list[int]:
        return list(self._context)

    def save_state(self) -> SeqState:
        if self.kv_by_reference:
            return self._save_by_reference()
        name = f"kvb-save-{uuid.uuid4().hex}.bin"
        path = self.slot_dir / name
        try:
            result = self._post_json(f"/slots/{SLOT_ID}?action=save", {"filename": name})
            self.last_save_ms = slot_timing(result, "save_ms")
            slot = read_slot_file(path, seq_id=SLOT_ID)
        except LlamaServerError as exc:
            raise StateTransferError(f"llama-server did not save its slot: {exc}") from exc
        except (OSError, SlotFileError) as exc:
            raise StateTransferError(f"could not read llama-server's slot file {path}: {exc}") from exc
        finally:
            path.unlink(missing_ok=True)
        # The slot file's own ids say whose KV this is: another client may have used the slot since
        # our /completion, and then these are its tokens, not ours (CachedEngine stores nothing).
        ids = slot.tokens[: slot.n_cells]
        self._context = ids
        return SeqState(data=slot.state, n_tokens=slot.n_cells, token_ids=tuple(ids))

    def _save_by_reference(self) -> SeqState:
        """Save the slot on the server under a name derived from its tokens: equal tokens, equal KV,
        so a name is only ever rewritten with the same content and saved files do not pile up."""
        if not self._context:
            raise StateTransferError("the slot's tokens are unknown (nothing generated since start); not saved")
        digest = hashlib.blake2b(json.dumps(self._context).encode(), digest_size=16).hexdigest()
        name = f"kvb-slot-{digest}.bin"
        try:
            result = self._post_json(f"/slots/{SLOT_ID}?action=save", {"filename": name})
        except LlamaServerError as exc:
            raise StateTransferError(f"llama-server did not save its slot: {exc}") from exc
        self.last_save_ms = slot_timing(result, "save_ms")
        # The slot file cannot be read from here, so whose KV it holds is checked after the save: the
        # slot must hold as many tokens as ours and its latest task must still be our /completion.
        # () tells CachedEngine the state is someone else's. (A file of ours overwritten that way is
        # harmless: it carries the ids it was saved with, and llama-server reuses KV only for those.)
        ours = int(result.get("n_saved", -1)) == len(self._context) and self._slot_last_ran_ours()
        token_ids = tuple(self._context) if ours else (() if ours is False else None)
        # the count travels inside the reference: a store may re-wrap the state with fewer token ids
        ref = SLOT_REF_MAGIC + struct.pack("<I", len(self._context)) + name.encode()
        return SeqState(data=ref, n_tokens=len(self._context), token_ids=token_ids)

    def state_buffer(self, size: int, tokens: Sequence[int]):
        """Map the restore slot file and hand out the spot where its state goes (saves one 40 MB copy)."""
        if self.slot_dir is None:
            return None
        if self._mapped is None:
            self._mapped = MappedSlotFile(self.slot_dir / self._restore_name)
        self._file_tokens = None   # the file is being rebuilt
        return self._mapped.buffer(tokens, size)

    def reuse_last_restore(self, tokens: Sequence[int]) -> bool:
        """Restore the restore file again when it starts with `tokens` (document Q&A: every question
        restores the same document prefix), skipping assembly and the file write. Extra tokens at its
        end are trimmed by the server's own prefix matching on the next request, as after any restore
        (a sliding-window model's file too: it holds every cell of both caches, see assemble_state)."""
        tokens = [int(t) for t in tokens]
        held = self._file_tokens
        if self.slot_dir is None or held is None or len(held) < len(tokens) or held[: len(tokens)] != tokens:
            return False
        self._restore_file(self._restore_name, wanted=len(tokens))
        self._context = list(held)
        return True

    def restore_state(self, state: SeqState, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens]
        head = len(SLOT_REF_MAGIC)
        if bytes(state.data[:head]) == SLOT_REF_MAGIC:
            name = bytes(state.data[head + 4:]).decode()
            self._restore_file(name, wanted=len(tokens))
            self._context = []  # the server's slot holds tokens we no longer list
            return
        if self.slot_dir is None:
            raise RestoreFailed("this llama-server's slot directory is not on this machine (KVB_LLAMA_SERVER_SLOT_DIR)")
        # one file per backend, rewritten in place for every restore (see write_in_place); removed by stop()
        path = self.slot_dir / self._restore_name
        mapped = self._mapped
        self._file_tokens = None
        try:
            if mapped is not None and mapped.holds(state.data) and mapped.tokens == tokens:
                mapped.finish()     # the state was assembled straight into the file
            else:
                write_in_place(path, build_slot_file(state.data, tokens))
        except (OSError, SlotFileError) as exc:
            raise RestoreFailed(f"cannot write a slot file: {exc}") from exc
        self._restore_file(self._restore_name, wanted=len(tokens))
        self._context = tokens
        self._file_tokens = tokens   # the file is complete and the server took it

    def _restore_file(self, name: str, wanted: int) -> None:
        """`action=restore` of one slot file; the server's own count of restored tokens (`n_restored`,
        the first `wanted` of them: a reused restore file may hold more) is what held_tokens() reports."""
        self._n_restored = None
        try:
            result = self._post_json(f"/slots/{SLOT_ID}?action=restore", {"filename": name})
        except LlamaServerError as exc:
            self._context = []
            raise RestoreFailed(str(exc)) from exc
        self.last_restore_ms = slot_timing(result, "restore_ms")
        self._n_restored = min(int(result.get("n_restored", 0)), wanted)

    def held_tokens(self) -> int | None:
        """The server's own count from the last restore action (CachedEngine compares it with what it
        restored; a mismatch is counted as restore_ineffective and the prompt is recomputed)."""
        return self._n_restored


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
