"""KV in and out of llama-server through its slot files: save, restore, reuse, and whose KV it is.

Place in the flow: lookup -> **restore: write a slot file, `POST /slots/0?action=restore`** -> suffix
prefill + generate -> **store: `action=save`, read the slot file** -> chunks.

SlotKV is a part of LlamaServerBackend (a mixin): it owns the restore file and the state of the last
slot action, and calls the backend's own JSON helpers (`_post_json`, `_get_json`), `slot_dir` and
`_context`. Slot files carry the same sequence-state bytes as llama-cpp-python's in-process API (see
kvbridge.formats.slot_file). Attached to a server whose slot directory is not on this machine, the
KV bytes cannot be read: a save then keeps the slot file on the server under a content name and
returns a reference (`SeqState.data` starts with SLOT_REF_MAGIC); a restore restores that file by name.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import struct
import uuid
from pathlib import Path
from typing import Sequence

from kvbridge.errors import StateTransferError
from kvbridge.backends.base import SeqState, WindowCapture
from kvbridge.backends.llama_server.api import LlamaServerError, slot_timing
from kvbridge.formats.slot_file import MappedSlotFile, SlotFileError, build_slot_file, read_slot_file, write_in_place

SLOT_ID = 0
SLOT_REF_MAGIC = b"KVBSLOTREF1\0"   # SeqState.data of a remote slot file: magic, u32 n_tokens, file name


class RestoreFailed(StateTransferError):
    """llama-server refused a slot file (or it could not be written here); the engine recomputes."""


class SlotKV:
    """Save and restore the one slot's KV through slot files (the KV half of LlamaServerBackend)."""

    slot_dir: Path | None
    _context: list[int]

    def _init_slot_kv(self) -> None:
        self.last_save_ms: float | None = None      # llama-server's own timings of the last slot action
        self.last_restore_ms: float | None = None
        self._n_restored: int | None = None        # the server's own count from the last restore action
        self._task_seed: int | None = None         # the seed our last /completion sent (marks its task)
        self._restore_name = f"kvb-restore-{uuid.uuid4().hex}.bin"
        self._mapped: MappedSlotFile | None = None   # the restore file while the engine assembles into it
        self._file_tokens: list[int] | None = None  # tokens of the complete state in the restore file

    def _release_slot_kv(self) -> None:
        """Close and remove the restore file (before the slot directory is forgotten)."""
        self._file_tokens = None
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None
        if self.slot_dir is not None:
            (self.slot_dir / self._restore_name).unlink(missing_ok=True)

    # whose task the slot ran ----------------------------------------------------------------
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

    # save -------------------------------------------------------------------------------------
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

    # restore ----------------------------------------------------------------------------------
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
