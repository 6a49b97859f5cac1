"""The model zoo: tiny GGUFs of every architecture KVBridge must cache, made here with seeded random weights.

Place in the flow: below bench (which measures on them) and above serve; the settings never import
it. `python -m kvbridge.models.zoo make ARCH --out PATH` writes one; `zoo_model(ARCH)` gives a cached
one to tests and benchmarks. Each carries the embedded SmolLM2's tokenizer and chat template, so
prompts tokenize as usual, and an exactness oracle needs no trained weights: a restore is right when
it gives the cold prefill's logits and tokens, whatever the weights are.

- catalog.py: ZOO_ARCHITECTURES (name, family, KV shape, builder), make_model
- dims.py: the sizes (`test`, `bench`)
- attention.py, hybrid.py: the builders; writer.py: ZooWriter; tokenizer.py: SmolLM2's keys
- cache.py: zoo_model; probe.py: load, greedy margins, prefill time; zoo.py: the command line
"""
from kvbridge.models.cache import ZOO_DIR, zoo_model
from kvbridge.models.catalog import FAMILIES, ZOO_ARCHITECTURES, UnknownArchitecture, ZooArch, make_model, zoo_arch

__all__ = ["FAMILIES", "ZOO_ARCHITECTURES", "ZOO_DIR", "UnknownArchitecture", "ZooArch", "make_model", "zoo_arch",
           "zoo_model"]
