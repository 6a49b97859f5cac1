"""The zoo's command line: `python -m kvbridge.models.zoo make ARCH --out PATH` and `... list`.

Place in the flow: a person (or a script) -> **zoo** -> catalog.make_model writes the GGUF; `list`
prints every architecture with its family, its KV shape, and llama.cpp's error for any this
llama.cpp will not load. Then `KVB_MODEL_PATH=PATH` runs KVBridge on it like any other model.
"""
from __future__ import annotations

import sys
from pathlib import Path

from kvbridge.models.catalog import ZOO_ARCHITECTURES, UnknownArchitecture, make_model
from kvbridge.models.dims import SIZES
from kvbridge.settings.cmdline import Parser


def list_text() -> str:
    width = max(len(a.name) for a in ZOO_ARCHITECTURES)
    lines = []
    for arch in ZOO_ARCHITECTURES:
        status = f"  DOES NOT LOAD: {arch.load_error}" if arch.load_error else ""
        lines.append(f"{arch.name:<{width}}  {arch.family:<14}  {arch.kv_shape}{status}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m kvbridge.models.zoo",
                                     description="Tiny random-weight GGUFs of llama.cpp architectures, "
                                                 "with SmolLM2's tokenizer")
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make", help="write one zoo model")
    make.add_argument("arch", help="llama.cpp's general.architecture name (see `list`)")
    make.add_argument("--out", type=Path, required=True, help="where to write the .gguf")
    make.add_argument("--size", choices=list(SIZES), default="test")
    make.add_argument("--seed", type=int, default=0)
    commands.add_parser("list", help="the architectures, their families and KV shapes")
    args = parser.parse_args(argv)
    if args.command == "list":
        print(list_text())
        return 0
    try:
        make_model(args.arch, args.out, args.size, args.seed)
    except UnknownArchitecture as err:
        print(f"zoo make: {err}", file=sys.stderr)
        return 2
    print(f"{args.out}: {args.arch} ({args.size}, seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
