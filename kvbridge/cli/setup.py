"""`kvbridge setup`: fetch the embedded models and say what else this installation needs."""
from __future__ import annotations

import sys

from kvbridge.cli.command import Command
from kvbridge.settings import Settings


def add_arguments(p) -> None:
    p.add_argument("--model", action="append", metavar="NAME",
                   help="also fetch this embedded model, or 'all' (repeatable); SmolLM2 and KVB_MODEL's "
                        "are always fetched")


def run(args) -> int:
    import importlib.util

    from kvbridge.settings import DATA_HOME, SOURCE_CHECKOUT, WORK_DIR
    from kvbridge.settings.install import LLAMA_COMPILE_NOTE, install_command
    from kvbridge.settings.model_fetch import FetchError, fetch_models
    from kvbridge.settings.models import DEFAULT_MODEL, EMBEDDED_MODELS

    settings = Settings.from_env()
    names = [DEFAULT_MODEL]
    for name in [settings.model, *(args.model or [])]:
        for wanted in (EMBEDDED_MODELS if name == "all" else [name]):
            if wanted not in names:
                names.append(wanted)
    print(f"models folder: {DATA_HOME / 'models'}; settings: {WORK_DIR / '.env'} and KVB_ variables")
    try:
        fetch_models(names, say=print)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("llama_cpp") is None:
        where = ("./scripts/setup.sh builds it down the instruction-set ladder." if SOURCE_CHECKOUT else
                 f"{install_command('llama')} builds it from source ({LLAMA_COMPILE_NOTE.partition(': ')[2]}; "
                 "set CMAKE_ARGS for your CPU's instruction set if the first decode crashes).")
        print(f"llama-cpp-python is not installed, so the in-process engine cannot run yet: {where}")
    else:
        start = "./scripts/start.sh" if SOURCE_CHECKOUT else "kvbridge gui"
        print(f"llama-cpp-python is installed: {start} starts the testbed on the embedded model.")
    return 0


COMMAND = Command(
    "setup",
    "fetch the embedded models (SmolLM2, KVB_MODEL's, --model) into the models folder and say what "
    "else this installation needs (in a source checkout ./scripts/setup.sh does all of it)",
    run, add_arguments)
