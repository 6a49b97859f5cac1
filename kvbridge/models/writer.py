"""ZooWriter: one GGUF file of seeded random weights, written through the `gguf` package.

Place in the flow: a builder (attention.py, hybrid.py) -> **ZooWriter** (keys, tensors, the
tokenizer of the embedded SmolLM2) -> a .gguf that llama.cpp loads like any other model.

What llama.cpp's CPU backend needs of the tensors (found the hard way, issue 33's prototypes):
matrices are F16 (an all-F32 model crashes in mul_mat), vectors that enter element-wise ops (norms,
biases, ssm_d) stay F32. Every tensor draws from its own generator, seeded by the architecture, the
model's seed and the tensor's name, so the same seed gives the same bytes and adding a tensor changes no other one.
Names and keys are checked against gguf's constants for the architecture; the ones gguf's tables do
not list are still written (a GGUF name is a plain string) and kept in `literal_names` for `list`.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np

from kvbridge.models.tokenizer import copy_tokenizer
from kvbridge.settings.models import DEFAULT_MODEL, EMBEDDED_MODELS

TOKENIZER_SOURCE = EMBEDDED_MODELS[DEFAULT_MODEL]   # SmolLM2: its tokenizer and chat template ride along
Q4_0_BLOCK = 32                                      # values per Q4_0 block: an f16 scale + 16 bytes of nibbles


def _known_tensor_names(arch: str) -> set[str]:
    """gguf's tensor name patterns for `arch` ("blk.{bid}.attn_q"), or none when gguf does not know it."""
    by_name = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in by_name:
        return set()
    return {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS.get(by_name[arch], ())}


def _known_key_suffixes() -> set[str]:
    """Every `{arch}.something` key format gguf's Keys classes name, as "something"."""
    found = set()
    for group in vars(gguf.Keys).values():
        for value in vars(group).values() if isinstance(group, type) else ():
            if isinstance(value, str) and value.startswith("{arch}."):
                found.add(value[len("{arch}."):])
    return found


class ZooWriter:
    """Keys under `{arch}.`, tensors by ggml shape (ne0 first), each seeded by its name."""

    def __init__(self, arch: str, out: Path, seed: int, tokenizer_source: Path | None = None):
        self.arch, self.seed = arch, seed
        self.writer = gguf.GGUFWriter(str(out), arch)
        self.n_vocab = copy_tokenizer(self.writer, tokenizer_source or TOKENIZER_SOURCE.path)
        self.writer.add_name(f"kvbridge-zoo-{arch}")
        self.writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        self._tensor_patterns = _known_tensor_names(arch)
        self._key_suffixes = _known_key_suffixes()
        self.literal_names: list[str] = []
        self.u32("vocab_size", self.n_vocab)

    # --- keys --------------------------------------------------------------------------------------
    def _key(self, suffix: str) -> str:
        if suffix not in self._key_suffixes:
            self.literal_names.append(f"{self.arch}.{suffix}")
        return f"{self.arch}.{suffix}"

    def u32(self, suffix: str, value: int) -> None:
        self.writer.add_uint32(self._key(suffix), int(value))

    def f32(self, suffix: str, value: float) -> None:
        self.writer.add_float32(self._key(suffix), float(value))

    def u32s(self, suffix: str, values: list[int]) -> None:
        self.writer.add_key_value(self._key(suffix), [int(v) for v in values], gguf.GGUFValueType.ARRAY,
                                  sub_type=gguf.GGUFValueType.UINT32)

    def i32s(self, suffix: str, values: list[int]) -> None:
        self.writer.add_key_value(self._key(suffix), [int(v) for v in values], gguf.GGUFValueType.ARRAY,
                                  sub_type=gguf.GGUFValueType.INT32)

    def flag(self, suffix: str, value: bool) -> None:
        self.writer.add_bool(self._key(suffix), bool(value))

    # --- tensors -----------------------------------------------------------------------------------
    def rng(self, name: str) -> np.random.Generator:
        digest = hashlib.sha256(f"{self.arch}:{self.seed}:{name}".encode()).digest()
        return np.random.default_rng(int.from_bytes(digest[:8], "little"))

    def _check_name(self, name: str) -> None:
        stem = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
        pattern = stem
        if stem.startswith("blk."):
            parts = stem.split(".", 2)
            pattern = "blk.{bid}." + parts[2] if len(parts) == 3 else stem
        if pattern not in self._tensor_patterns and pattern not in self.literal_names:
            self.literal_names.append(pattern)

    def _add(self, name: str, array: np.ndarray) -> None:
        self._check_name(name)
        self.writer.add_tensor(name, array)

    def matrix(self, name: str, ne: tuple[int, ...], gain: float = 1.0) -> None:
        """A weight matrix, F16, N(0, gain^2 / fan_in) so activations keep their scale (ne[0] is the fan-in)."""
        values = self.rng(name).standard_normal(tuple(reversed(ne)), dtype=np.float32)
        self._add(name, (values * (gain / np.sqrt(ne[0]))).astype(np.float16))

    def normal(self, name: str, ne: tuple[int, ...], std: float = 1.0, f16: bool = False) -> None:
        """N(0, std^2) without the fan-in rule (embeddings, conv kernels, small biases)."""
        values = self.rng(name).standard_normal(tuple(reversed(ne)), dtype=np.float32) * np.float32(std)
        self._add(name, values.astype(np.float16 if f16 else np.float32))

    def uniform(self, name: str, ne: tuple[int, ...], low: float, high: float) -> None:
        self._add(name, self.rng(name).uniform(low, high, tuple(reversed(ne))).astype(np.float32))

    def const(self, name: str, ne: tuple[int, ...], value: float) -> None:
        """F32 filled with one value: norm gains (1), zero biases, fixed skips."""
        self._add(name, np.full(tuple(reversed(ne)), value, dtype=np.float32))

    def norm(self, name: str, ne: tuple[int, ...]) -> None:
        """A norm gain near 1 (F32: element-wise)."""
        self._add(name, (1.0 + 0.1 * self.rng(name).standard_normal(tuple(reversed(ne)))).astype(np.float32))

    def head(self, name: str, n_embd: int, gain: float, tail: float) -> None:
        """An output head (n_vocab rows) whose row norms are log-normal with spread `tail`.

        With equal row norms the top two of 49k Gaussian logits are often within noise; a few rows that
        are much longer than the rest make the winner's lead a sizeable fraction of its logit, while the
        hidden state still decides which of them wins.
        """
        rng = self.rng(name)
        rows = rng.standard_normal((self.n_vocab, n_embd), dtype=np.float32) * np.float32(gain / np.sqrt(n_embd))
        rows *= np.exp(np.float32(tail) * rng.standard_normal((self.n_vocab, 1), dtype=np.float32))
        self._add(name, rows.astype(np.float16))

    def q4_0(self, name: str, ne: tuple[int, int], scale: float) -> None:
        """Random Q4_0 blocks written directly (values (q - 8) * scale): a huge table without quantizing."""
        rows, cols = ne[1], ne[0]
        blocks = rows * cols // Q4_0_BLOCK
        raw = np.empty((blocks, 18), dtype=np.uint8)
        raw[:, :2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
        raw[:, 2:] = self.rng(name).integers(0, 256, (blocks, 16), dtype=np.uint8)
        self._check_name(name)
        self.writer.add_tensor(name, raw.reshape(rows, cols // Q4_0_BLOCK * 18), raw_dtype=gguf.GGMLQuantizationType.Q4_0)

    def close(self) -> None:
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_tensors_to_file()
        self.writer.close()
