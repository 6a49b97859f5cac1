"""Does an attached llama-server keep every cell of a sliding-window model's cache (`--swa-full`)?

KVBridge starts its own llama-server with `--swa-full` for a sliding-window model (Gemma 3): a
restore then writes every cell of both caches (kvbridge.formats.llama_state.assemble_state), and the
server reuses a restored prompt like any other. A server the user started (KVB_LLAMA_SERVER_URL) may
run without it; then its sliding-window cache holds only about n_swa + n_ubatch cells, every restore
longer than that is refused, and the server itself re-processes whole prompts instead of reusing
them, so caching would silently cost more than it saves. Nothing the server reports says how it was
started (`/props` does not name --swa-full), so this asks the cache itself: a state that fills the
slot's context (at most n_swa + 4608 cells) is restored into the slot. A server with the full-size
cache takes it; one without refuses it, and the engine refuses to start with a message saying what
to change. The state is a tiny real prefill's cells repeated (every cell has the layout llama.cpp
wrote; their values do not matter), and the slot is erased after. A context no larger than the
small cache passes, rightly: there both caches are the same size. Left out: a server whose ubatch
exceeds 4096, whose small cache the probe may not overflow.
"""
from __future__ import annotations

import logging
import uuid

from kvbridge.backends.llama_server.api import LlamaServerError
from kvbridge.errors import StateTransferError
from kvbridge.formats.llama_chunks import assemble_state, decode_chunk, encode_chunk
from kvbridge.formats.llama_state import LayoutError, parse_state
from kvbridge.formats.slot_file import SlotFileError, build_slot_file, write_in_place

log = logging.getLogger(__name__)
PROBE_TEXT = "KVBridge checks the sliding-window cache."
PROBE_SPARE_CELLS = 4096 + 512


def swa_full_refusal(backend) -> str:
    """'' when the attached server can hold a restore that fills its context (or this cannot be
    asked: no slot directory here, not a window model); else the message for the person."""
    traits = backend.model_traits()
    if traits is None or not traits.n_swa or backend.slot_dir is None:
        return ""
    tokens = backend.tokenize(PROBE_TEXT)[:16]
    backend._post_json("/completion", {"prompt": tokens, "n_predict": 1, "cache_prompt": True, "id_slot": 0,
                                       "stream": False, "temperature": 0.0})
    try:
        saved = backend.save_state()
        state = parse_state(saved.data, traits.n_layer, window=traits.n_swa)
        n = state.n_cells
        ids = (list(saved.token_ids or ()) + [0] * n)[:n]   # any ids do: only the cells' layout is probed
        chunk = decode_chunk(encode_chunk(state, 0, n, ids), state.geometry)
        # more cells than the small cache holds with any usual ubatch (up to 4096), but not the whole of a
        # huge context: the probe's state is assembled in memory and written to a slot file
        cells = min(backend.n_ctx, traits.n_swa + PROBE_SPARE_CELLS)
        pieces = [(chunk, n)] * (cells // n) + ([(chunk, cells % n)] if cells % n else [])
        filled = assemble_state(state.geometry, pieces)
        filled_tokens = (ids * (cells // n + 1))[:cells]
        name = f"kvb-swa-probe-{uuid.uuid4().hex}.bin"
        path = backend.slot_dir / name
        try:
            write_in_place(path, build_slot_file(filled, filled_tokens))
            refused = ""
            try:
                backend._post_json("/slots/0?action=restore", {"filename": name})
            except LlamaServerError as exc:   # the refusal is the answer; its text goes in the message
                refused = str(exc)
        finally:
            path.unlink(missing_ok=True)
    except (LayoutError, SlotFileError, StateTransferError) as exc:   # the engine's own checks report these later
        log.info("sliding-window cache probe skipped: %s", exc)
        return ""
    finally:
        backend.reset_native_cache()
    if not refused:
        return ""
    return (f"llama-server at {backend.base_url} (KVB_LLAMA_SERVER_URL) runs the sliding-window model "
            f"{traits.architecture} without a full-size sliding-window cache: it refused a restore of {cells} "
            f"cells ({refused}). Restart it with --swa-full (KVBridge restores every cell of both "
            "caches), or leave KVB_LLAMA_SERVER_URL empty so KVBridge starts its own llama-server.")
