"""The zoo's catalog: each architecture by llama.cpp's `general.architecture` name, its family, its KV shape.

Place in the flow: `zoo make ARCH` / `zoo_model(ARCH)` -> **make_model** looks ARCH up here -> its
builder (attention.py, hybrid.py) writes the file through a ZooWriter.

The family says what a restore has to carry: `attention` (KV that grows with the prompt),
`sliding-window` (KV of which windowed layers keep only the last n_swa positions, or chunks),
`hybrid` (attention KV beside recurrent state) and `recurrent` (state only). `load_error` records
llama.cpp's own error for an architecture this llama.cpp will not load (`zoo list` prints it);
none is recorded today. GENERATOR_VERSION changes whenever a builder's output changes, so a cached
file of an older generator is never taken for a new one.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvbridge.models import attention, hybrid
from kvbridge.models.dims import SIZES, Dims
from kvbridge.models.writer import ZooWriter

GENERATOR_VERSION = 1
FAMILIES = ("attention", "sliding-window", "hybrid", "recurrent")


@dataclass(frozen=True)
class ZooArch:
    name: str                                  # llama.cpp's general.architecture
    family: str                                # one of FAMILIES
    kv_shape: str                              # what its cache holds, in a line
    build: Callable[[ZooWriter, Dims], None]
    overrides: dict[str, dict] = dataclasses.field(default_factory=dict)   # size -> Dims fields
    load_error: str | None = None              # llama.cpp's error where this llama.cpp will not load it

    def dims(self, size: str) -> Dims:
        return dataclasses.replace(SIZES[size], **self.overrides.get(size, {}))


# A tied head is also the input embedding: with the default row spread a few long rows win whatever the
# context, and the model repeats one token. A narrower spread lets the context choose.
TIED_HEAD = {size: {"head_tail": 0.3} for size in SIZES}
# gemma3n caps its logits at 30 (tanh, a constant in llama.cpp): a head that reaches past the cap ties at it.
CAPPED_HEAD = {size: {"head_gain": 1.5, "head_tail": 0.7} for size in SIZES}
# At the bench size a 2k-token cold prefill should take seconds, like llama's (~3 s on 2 quiet cores):
# MoE layers run slowly on the CPU, and gemma3n's 22 layers each carry 4 altup streams.
BENCH_MOE = {"bench": {"n_layer": 6, "n_ff": 1024}}
BENCH_GEMMA3N = {"bench": {"n_embd": 256, "n_ff": 1024, "n_head": 4, "n_head_kv": 2}}

ZOO_ARCHITECTURES: tuple[ZooArch, ...] = (
    ZooArch("llama", "attention", "full attention on every layer: KV grows with the prompt (the control)",
            attention.build_llama),
    ZooArch("gemma2", "sliding-window", "windowed (n_swa) and global layers alternate; logit soft-capping",
            attention.build_gemma2, overrides=TIED_HEAD),
    ZooArch("gemma3", "sliding-window", "2 windowed : 1 global layers, per-kind rope base",
            attention.build_gemma3, overrides=TIED_HEAD),
    ZooArch("gpt-oss", "sliding-window", "windowed and global layers alternate, attention sinks; MoE FFN",
            attention.build_gpt_oss, overrides=BENCH_MOE),
    ZooArch("cohere2", "sliding-window", "3 windowed : 1 global layers, parallel attention and FFN",
            attention.build_cohere2, overrides=TIED_HEAD),
    ZooArch("llama4", "sliding-window", "chunked attention (8192-token chunks) on 3 of 4 layers; MoE every 2nd",
            attention.build_llama4),
    ZooArch("gemma3n", "sliding-window", "windowed and global alternate; layers 20-21 reuse the KV of 18-19",
            attention.build_gemma3n,
            overrides={size: {**CAPPED_HEAD[size], **BENCH_GEMMA3N.get(size, {})} for size in SIZES}),
    ZooArch("lfm2", "hybrid", "short-conv state (3 tokens) per layer, attention KV on every 3rd layer",
            hybrid.build_lfm2),
    ZooArch("granitehybrid", "hybrid", "Mamba-2 state per layer, attention KV on every 3rd layer",
            hybrid.build_granitehybrid),
    ZooArch("qwen3next", "hybrid", "gated delta-net state, gated attention KV on every 4th layer; MoE",
            hybrid.build_qwen3next, overrides=BENCH_MOE),
    ZooArch("qwen35", "hybrid", "gated delta-net state, gated attention KV on every 4th layer",
            hybrid.build_qwen35),
    ZooArch("falcon-h1", "hybrid", "attention KV and Mamba-2 state side by side in every layer",
            hybrid.build_falcon_h1),
    ZooArch("mamba2", "recurrent", "Mamba-2 conv and SSM state per layer, no KV",
            hybrid.build_mamba2),
    ZooArch("rwkv7", "recurrent", "RWKV-7 wkv state and token shift per layer, no KV",
            hybrid.build_rwkv7),
)
_BY_NAME = {a.name: a for a in ZOO_ARCHITECTURES}


class UnknownArchitecture(KeyError):
    """An ARCH the zoo does not make; the message names the ones it does."""

    def __str__(self) -> str:
        return self.args[0]


def zoo_arch(name: str) -> ZooArch:
    if name not in _BY_NAME:
        raise UnknownArchitecture(f"the model zoo has no architecture {name!r}; it makes: "
                                  f"{', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def check_size(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"unknown zoo size {size!r}; the sizes are: {', '.join(SIZES)}")


def make_model(arch: str, out: Path, size: str = "test", seed: int = 0) -> list[str]:
    """Write the zoo model `arch` at `size` to `out` (written beside it, then renamed: never half a file).

    Returns the tensor names and keys written by their literal names (gguf's tables do not list them).
    """
    entry = zoo_arch(arch)
    check_size(size)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        writer = ZooWriter(arch, partial, seed)
        entry.build(writer, entry.dims(size))
        writer.close()
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return writer.literal_names
