"""Dims: the widths of a zoo model at one size, shared by every builder.

`test` is for the suite (made in about a second, a few hundred tokens prefill in well under a
second); `bench` is for the speed targets (a 2k-token cold prefill takes seconds on 2 cores, so a
restore's speed-up measures the restore, not overhead). A builder may widen what its architecture
forces (gemma3n's 22 layers, a hybrid's two attention and two recurrent layers); the catalog
(catalog.py) may override fields per architecture, e.g. the head gain that keeps greedy choices
clear of ties.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dims:
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_swa: int              # sliding window: small against the test prompts, so the window matters
    head_gain: float = 4.0  # std of a logit before the log-normal row spread (writer.ZooWriter.head)
    head_tail: float = 1.0  # spread of the head's row norms (log-normal sigma)
    n_ctx_train: int = 8192

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


SIZES: dict[str, Dims] = {
    "test": Dims(n_embd=128, n_layer=4, n_ff=384, n_head=4, n_head_kv=2, n_swa=32),
    "bench": Dims(n_embd=512, n_layer=12, n_ff=2048, n_head=8, n_head_kv=4, n_swa=256),
}
