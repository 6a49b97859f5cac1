"""The compatibility matrix as shipped: which row a loaded model is in, for `kvbridge namespace` and the GUI.

Place in the flow: `python -m kvbridge.models.matrix` writes compatibility.json (beside this module)
-> a started engine knows its architecture (ModelTraits) -> **matrix_line(architecture)** says on which
paths that architecture restores exactly and where it is refused, and why.

The rows are the zoo's: an architecture's row holds for any model of it as far as the layout goes
(the verdict is about how llama.cpp lays out the state, not about the weights). An architecture the
zoo does not make has no row, and the line says so.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

COMPATIBILITY_JSON = Path(__file__).with_name("compatibility.json")
FORMAT = "kvbridge compatibility matrix v1"


@lru_cache(maxsize=4)
def load_matrix(path: Path = COMPATIBILITY_JSON) -> dict:
    """The shipped matrix; an empty one when the file is missing or not this format (never an exception)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("format") == FORMAT else {}


def matrix_row(architecture: str, path: Path = COMPATIBILITY_JSON) -> dict | None:
    """The matrix's row of `architecture` (llama.cpp's general.architecture), or None when it has none."""
    return load_matrix(path).get("architectures", {}).get(architecture)


def path_verdicts(row: dict) -> dict[str, tuple[str, str]]:
    """path -> (verdict, reason), in the matrix's path order."""
    return {name: (cell.get("verdict", ""), cell.get("reason", "")) for name, cell in row.get("paths", {}).items()}


def matrix_line(architecture: str, path: Path = COMPATIBILITY_JSON) -> str:
    """One line for a person: the row's exact paths, then each refused or differing path with its reason."""
    row = matrix_row(architecture, path)
    if row is None:
        return f"{architecture or 'this architecture'}: no row in the compatibility matrix (the zoo does not make it)"
    verdicts = path_verdicts(row)
    exact = [name for name, (verdict, _) in verdicts.items() if verdict.startswith("exact")]
    parts = [f"{architecture} ({row.get('family', '?')}): exact on {', '.join(exact) if exact else 'no path'}"]
    for name, (verdict, reason) in verdicts.items():
        if not verdict.startswith("exact"):
            parts.append(f"{verdict} on {name}" + (f" ({reason})" if reason else ""))
    return "; ".join(parts)
