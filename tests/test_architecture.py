"""The package layout is the architecture: no module-level import cycles, layers import downwards only.

The import graph is read from the source with `ast` (module-level statements only; imports inside
functions and `if TYPE_CHECKING:` blocks are deliberate late bindings and do not count), so a cycle
is caught even where Python's import order happens to hide it.
"""
from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "kvbridge"

# layer -> the kvbridge packages (or modules) it may import at module level, besides itself
ALLOWED = {
    "kvbridge.errors": set(),
    # the plugin tables' loader (tests/test_architecture_house.py: how a layer finds the code plugged into it)
    "kvbridge.plugins": set(),
    "kvbridge.settings": {"kvbridge.errors", "kvbridge.plugins"},
    "kvbridge.formats": {"kvbridge.errors"},
    "kvbridge.store": {"kvbridge.errors", "kvbridge.settings", "kvbridge.plugins"},
    "kvbridge.backends": {"kvbridge.errors", "kvbridge.settings", "kvbridge.formats"},
    "kvbridge.engine": {"kvbridge.errors", "kvbridge.plugins", "kvbridge.settings", "kvbridge.formats",
                        "kvbridge.store", "kvbridge.backends.base", "kvbridge.backends.registry"},
    # the cache server sits beside the engine: it holds tiers (store) and never touches an engine
    "kvbridge.cache_server": {"kvbridge.errors", "kvbridge.settings", "kvbridge.store"},
    # the scheduler drives llama.cpp itself (the in-process adapter's model checks and chat template)
    # and keeps KV in the engine's object format through the store
    "kvbridge.scheduler": {"kvbridge.errors", "kvbridge.settings", "kvbridge.formats", "kvbridge.store",
                           "kvbridge.backends", "kvbridge.engine"},
    # blend mode drives llama.cpp's batch API (backends.llama_context) on the engine's prompts and keys
    "kvbridge.blend": {"kvbridge.errors", "kvbridge.settings", "kvbridge.formats", "kvbridge.store",
                       "kvbridge.backends", "kvbridge.engine"},
    "kvbridge.bench": {"kvbridge.errors", "kvbridge.settings", "kvbridge.engine", "kvbridge.store",
                       "kvbridge.backends", "kvbridge.formats", "kvbridge.cache_server", "kvbridge.scheduler",
                       "kvbridge.blend"},
    # the model zoo writes GGUFs (gguf) with the embedded model's tokenizer; its compatibility matrix runs
    # them through every path (engines, the cache server, the scheduler): everything below bench
    "kvbridge.models": {"kvbridge.errors", "kvbridge.plugins", "kvbridge.settings", "kvbridge.formats",
                        "kvbridge.store", "kvbridge.backends", "kvbridge.engine", "kvbridge.cache_server",
                        "kvbridge.blend", "kvbridge.scheduler", "kvbridge.serve"},
    # the OpenAI-compatible endpoint is a front on the scheduler or CachedEngine
    "kvbridge.serve": {"kvbridge.errors", "kvbridge.settings", "kvbridge.engine", "kvbridge.scheduler",
                       "kvbridge.backends"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _all_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(path: Path, module: str, is_package: bool, known: set[str]) -> set[str]:
    """kvbridge modules imported when `module` is imported (not counting function bodies or TYPE_CHECKING)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If):
            if not _is_type_checking(node):
                pending += node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body]
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found |= {f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known}
    deps = set()
    for name in found:
        if not name.startswith("kvbridge"):
            continue
        parts = name.split(".")
        # importing a.b.c also runs a.b's __init__ (unless it is one of our own ancestors, already running)
        for i in range(2, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in known and prefix != module and not module.startswith(prefix + "."):
                deps.add(prefix)
    return deps


@functools.lru_cache(maxsize=None)   # read once a run: every layer's test asks for it
def import_graph() -> dict[str, set[str]]:
    modules = _all_modules()
    known = set(modules)
    return {name: _module_level_imports(path, name, path.name == "__init__.py", known)
            for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_reader_sees_a_cycle(tmp_path):
    """The checker itself can fail: a two-module cycle is found."""
    graph = {"kvbridge.a": {"kvbridge.b"}, "kvbridge.b": {"kvbridge.a"}, "kvbridge.c": {"kvbridge.a"}}
    assert _cycles(graph) == [["kvbridge.a", "kvbridge.b"]]


def test_no_module_level_import_cycles():
    assert _cycles(import_graph()) == []


def _layer_of(module: str) -> str | None:
    for layer in sorted(ALLOWED, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layers_import_only_what_is_below_them(layer):
    """Each layer imports only the layers below it (importing a module also runs its parent packages)."""
    graph = import_graph()
    allowed = ALLOWED[layer] | {layer}
    wrong = sorted(
        f"{module} imports {dep}"
        for module, deps in graph.items() if _layer_of(module) == layer
        for dep in deps
        if not any(dep == a or dep.startswith(a + ".") or a.startswith(dep + ".") for a in allowed)
    )
    assert wrong == []


def run_python(code: str) -> str:
    """Run `code` in a fresh interpreter at the project root (nothing imported yet); its stdout."""
    run = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE_DIR.parent, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_the_embedded_store_loads_no_cache_server_code():
    """With KVB_STORE_URL unset nothing changes: importing and using the engine core loads no ZMQ client."""
    code = ("import sys; from kvbridge.engine.cached_engine import CachedEngine; from kvbridge.store import open_store\n"
            "print(','.join(sorted(m for m in sys.modules if m.startswith('kvbridge.cache_server') or m == 'zmq')))")
    assert run_python(code) == ""


def test_the_engine_core_loads_no_adapter():
    """Importing CachedEngine must not import any engine adapter (the core never needs one for a type)."""
    code = ("import sys; from kvbridge import CachedEngine, Settings, make_backend; CachedEngine, Settings\n"
            "from kvbridge.settings.engines import BUILTIN_ADAPTERS\n"
            "loaded = sorted(m for m in sys.modules for a in BUILTIN_ADAPTERS if m == a or m.startswith(a + '.'))\n"
            "print(','.join(loaded))")
    assert run_python(code) == ""


def test_public_and_readme_imports_work():
    code = ("from kvbridge import CachedEngine, Settings, make_backend\n"
            "from kvbridge.config import Settings as S2\n"
            "from kvbridge.backends import make_backend as m2\n"
            "from kvbridge.engine import CachedEngine as C2\n"
            "assert CachedEngine is C2 and Settings is S2 and make_backend is m2\n"
            "print(make_backend('llamacpp', Settings()).key)")
    assert run_python(code) == "llamacpp"


def test_the_imports_the_docs_show_work():
    """Every `from kvbridge...` / `import kvbridge...` line in the README's and Quickstart's Python examples runs."""
    root = PACKAGE_DIR.parent
    lines = []
    for doc in (root / "README.md", root / "Docs" / "Quickstart.md"):
        for block in doc.read_text().split("```python")[1:]:
            lines += [line.split("#")[0].strip() for line in block.split("```")[0].splitlines()
                      if line.startswith(("from kvbridge", "import kvbridge"))]
    assert lines, "no kvbridge import found in the docs' Python examples"
    run_python("\n".join(lines))
