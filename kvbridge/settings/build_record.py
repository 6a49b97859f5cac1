"""The build record ./scripts/setup.sh writes beside the llama.cpp it compiled (`.venv/kvbridge-build.json`): its one
reader, for the build check (kvbridge.backends.build_check) and the cut verdicts' key (kvbridge.engine.cut_verdicts)."""
from __future__ import annotations

import json
from pathlib import Path

from kvbridge.settings.paths import BUILD_RECORD


def build_record(record: Path = BUILD_RECORD) -> dict:
    """What ./scripts/setup.sh wrote of the llama.cpp build it installed ({} without a usable record)."""
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def build_flags(record: Path = BUILD_RECORD) -> str:
    """The build flags ./scripts/setup.sh compiled llama.cpp with (llama-server is built with the same ones)."""
    if not record.exists():
        return "no build record"
    data = build_record(record)
    if not data:
        return "no build record"
    args = data.get("cmake_args") or []
    return " ".join(sorted(str(a) for a in args)) if isinstance(args, list) and args else "default flags"
