"""Install advice that works today: the `pip install` line for one of KVBridge's extras.

KVBridge is not on a package index (README installs from a clone), so `pip install 'kvbridge[serve]'` would
fail; the line names the extra's own requirements instead, read from the installed distribution's metadata
(a wheel) or, in a source checkout, from its pyproject.toml (the source of truth there; an old egg-info may
lie beside it). Place in the flow: the messages of the CLI (kvbridge.cli.extras), `kvbridge setup`, the fleet
router and the llama.cpp build check call it when something an extra brings is missing. Imports nothing
from kvbridge but kvbridge.settings.paths.
"""
from __future__ import annotations

import re
import shlex
import sys
from importlib import metadata

from kvbridge.settings.paths import SOURCE_CHECKOUT

DISTRIBUTION = "kvbridge"
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")
_SELF = re.compile(r"^kvbridge\s*\[([^\]]*)\]", re.IGNORECASE)
LLAMA_COMPILE_NOTE = "llama-cpp-python compiles from source: about 5 minutes on 2 cores"


def declared_extras() -> dict[str, list[str]]:
    """{extra: its requirement lines} as declared: a checkout's pyproject.toml, else the installed metadata."""
    if SOURCE_CHECKOUT is not None and (SOURCE_CHECKOUT / "pyproject.toml").is_file():
        import tomllib

        project = tomllib.loads((SOURCE_CHECKOUT / "pyproject.toml").read_text())["project"]
        return {extra: list(lines) for extra, lines in project.get("optional-dependencies", {}).items()}
    extras: dict[str, list[str]] = {}
    try:
        lines = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return extras
    for line in lines:
        requirement, _, marker = line.partition(";")
        found = _EXTRA_MARKER.search(marker)
        if found:
            extras.setdefault(found.group(1), []).append(requirement.strip())
    return extras


def extra_requirements(*extras: str) -> list[str]:
    """The requirement lines the extras bring, `kvbridge[a,b]` self-references expanded, in declared order."""
    declared, seen, found = declared_extras(), set(), []

    def add(extra: str) -> None:
        if extra in seen:
            return
        seen.add(extra)
        for line in declared.get(extra, []):
            own = _SELF.match(line)
            if own:
                for inner in own.group(1).split(","):
                    add(inner.strip())
            elif line not in found:
                found.append(line)

    for extra in extras:
        add(extra)
    return found


def install_command(*extras: str) -> str:
    """`<this python> -m pip install '<requirement>' ...`: what installs the extras into this environment."""
    requirements = extra_requirements(*extras)
    if not requirements:   # metadata unreadable: the extra's name is still the most useful thing to say
        return f"{shlex.quote(sys.executable)} -m pip install <the requirements of the {', '.join(extras)} extra>"
    return " ".join([shlex.quote(sys.executable), "-m", "pip", "install", *(shlex.quote(r) for r in requirements)])


def install_advice(*extras: str) -> str:
    """Lines for a person: the pip line, the compile time when llama is among them, and a checkout's own way."""
    lines = [f"Install {'it' if len(extras) == 1 else 'them'}: {install_command(*extras)}"]
    if "llama" in extras:
        lines.append(f"({LLAMA_COMPILE_NOTE}.)")
    if SOURCE_CHECKOUT is not None:
        lines.append(f"In this checkout, {SOURCE_CHECKOUT}/scripts/setup.sh installs every extra at the versions "
                     "requirements.txt pins" + (" and builds llama-cpp-python for this CPU." if "llama" in extras
                                                 else "."))
    return "\n".join(lines)
