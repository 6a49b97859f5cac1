"""The KV layout decision: what the model is says which layout to expect, a probe state must be exactly it.

Place in the flow: engine start -> **decide_layout** (kv_support of the model's traits: refused, plain or
sliding-window -> a tiny real state, parsed as exactly that layout -> the KVGeometry chunks are cut by,
or the reason, for a person, why the model runs uncached) -> namespace (its kv_layout digest) -> requests.

CachedEngine, the scheduler and blend mode all decide here; how the probe's state bytes are obtained
is theirs and passed in as a callable (a Backend generates one token; a LlamaContext decodes into a
sequence: probe_state_on_sequence). The bytes never decide the layout: the model does.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from kvbridge.errors import StateTransferError
from kvbridge.formats.architectures import KVSupport, ModelTraits, kv_support
from kvbridge.formats.llama_state import KVGeometry, LayoutError, parse_state

log = logging.getLogger(__name__)
# The probe's state bytes (a sequence state as llama_state_seq_get_data writes it); raising stops the start.
ProbeState = Callable[[], "bytes | memoryview"]


@dataclass(frozen=True)
class LayoutDecision:
    """geometry: the layout proven by the probe; None with refusal "" means whole snapshots (no probe)."""

    geometry: KVGeometry | None = None
    refusal: str = ""                  # set: KVBridge cannot restore this model's KV exactly; it runs uncached
    support: KVSupport | None = None   # what the model's traits said (None: the traits were unknown)

    @property
    def namespace_key(self) -> str:
        """The namespace's kv_layout field: the geometry's digest, or what stands in for it."""
        if self.refusal:
            return "refused"
        return self.geometry.digest().hex()[:16] if self.geometry is not None else "snapshot"


def decide_layout(traits: ModelTraits | None, probe_state: ProbeState, *, by_reference: bool = False,
                  captures_recurrent: bool = False) -> LayoutDecision:
    """The layout of `traits` proven on `probe_state()`, or the refusal. by_reference: the engine's state bytes
    cannot be read here (a llama-server's slot files on another machine), so a plain model keeps whole
    snapshots and a sliding-window one is refused; nothing is probed. captures_recurrent: the engine keeps
    the recurrent state at chunk boundaries (Backend.captures_recurrent); without it a recurrent or hybrid
    model is refused."""
    if traits is None:
        return LayoutDecision(refusal="the engine did not say what kind of model it runs, so no KV layout can be "
                                      "proven; it runs uncached")
    support = kv_support(traits, captures_recurrent=captures_recurrent and not by_reference)
    if support.refused:
        log.warning("KV caching refused: %s", support.reason)
        return LayoutDecision(refusal=support.reason, support=support)
    if by_reference:
        if support.window:
            return LayoutDecision(support=support, refusal=(
                f"the {traits.architecture} model's sliding-window cache cannot be restored from whole snapshots kept "
                "on the server (set KVB_LLAMA_SERVER_SLOT_DIR to its slot directory for chunked KV); it runs uncached"))
        return LayoutDecision(support=support)
    try:
        return LayoutDecision(geometry=probe_geometry(traits, support, probe_state), support=support)
    except LayoutError as exc:
        reason = (f"the {traits.architecture} model's KV state is not the {support.layout} layout "
                  f"llama.cpp writes for it ({exc}); it runs uncached")
        log.warning("KV caching refused: %s", reason)
        return LayoutDecision(refusal=reason, support=support)


def probe_geometry(traits: ModelTraits | None, support: KVSupport, probe_state: ProbeState) -> KVGeometry:
    """The geometry of the probe's state parsed as exactly the expected layout; LayoutError when it is not."""
    n_layer = None if traits is None else traits.n_layer if support.recurrent else traits.own_kv_layers
    return parse_state(probe_state(), n_layer, window=support.window, cell_ext=support.cell_ext,
                       recurrent=support.recurrent, attention=support.attention).geometry


class ProbeDecodeFailed(StateTransferError):
    """llama_decode did not take the probe's tokens (code: what it returned)."""

    def __init__(self, code: int, n_tokens: int, seq: int) -> None:
        super().__init__(f"llama_decode returned {code} for the {n_tokens}-token KV layout probe in sequence {seq}")
        self.code, self.n_tokens = code, n_tokens


def probe_state_on_sequence(ctx, seq: int, text: str, *, max_tokens: int | None = None) -> bytes:
    """The state of the empty sequence `seq` of a kvbridge.backends.llama_context.LlamaContext after decoding
    `text` (its first max_tokens tokens, in one batch); the sequence is empty again afterwards."""
    tokens = ctx.tokenize(text)[:max_tokens]
    ctx.seq_rm(seq)
    try:
        code = ctx.decode([(t, i, seq, i == len(tokens) - 1) for i, t in enumerate(tokens)])
        if code != 0:
            raise ProbeDecodeFailed(code, len(tokens), seq)
        return bytes(ctx.save_seq(seq))
    finally:
        ctx.seq_rm(seq)
