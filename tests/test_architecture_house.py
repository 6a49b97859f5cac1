"""The house: packages in layers that import downwards only, counting every import, small modules, one home per fact.

tests/test_architecture.py reads the module-level import graph (what runs when a module is imported).
This file is stricter about packages: an import inside a function counts too (a late import is still a
dependency of the code), and so does one under `if TYPE_CHECKING:`. Top-level modules (`__main__`,
`config`, `errors`) count as packages; `kvbridge/__init__.py` is the facade that names the public API.

A lower package finds the code of a higher one only through a registry: the higher one registers
itself, and the lower one's table of built-in plugin modules (a string per module, loaded on first
lookup, through `kvbridge.plugins.PluginModules`) says where to look. Those tables are listed in
PLUGIN_TABLES: each names modules of a higher layer only, and each module named fills that table
when imported (so the dependency in code runs from the plugin to its host, never back).
"""
from __future__ import annotations

import ast
import functools
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "kvbridge"
MAX_MODULE_LINES = 500

# lowest first: a package may import only packages before it in this list
LAYERS = (
    "kvbridge.errors",
    "kvbridge.plugins",
    "kvbridge.settings",
    "kvbridge.config",
    "kvbridge.formats",
    "kvbridge.store",
    "kvbridge.backends",
    "kvbridge.engine",
    "kvbridge.cache_server",
    "kvbridge.blend",
    "kvbridge.scheduler",
    "kvbridge.kv_events",
    "kvbridge.serve",
    "kvbridge.models",
    "kvbridge.fleet",
    "kvbridge.bench",
    "kvbridge.gui",
    "kvbridge.cli",
    "kvbridge.__main__",
)


@functools.lru_cache(maxsize=None)
def _nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of a module's syntax tree, parsed once a run: several checks walk every module."""
    return tuple(ast.walk(ast.parse(path.read_text(), filename=str(path))))


def _package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports_anywhere(path: Path, module: str) -> set[str]:
    """Every kvbridge module name an import statement anywhere in the file names (functions and TYPE_CHECKING too)."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in _nodes(path):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                names.add(".".join(base + ([node.module] if node.module else [])))
            else:
                names.add(node.module or "")
    return {n for n in names if n.startswith("kvbridge.")}


@functools.lru_cache(maxsize=None)
def package_graph() -> dict[str, dict[str, list[str]]]:
    """package -> {package it imports: ["module imports target", ...]}, the facade left out."""
    graph: dict[str, dict[str, list[str]]] = {}
    for module, path in _modules().items():
        if module == "kvbridge":
            continue
        source = _package_of(module)
        for target in _imports_anywhere(path, module):
            dest = _package_of(target)
            if dest != source:
                graph.setdefault(source, {}).setdefault(dest, []).append(f"{module} imports {target}")
    return graph


def _package_cycles(graph: dict[str, dict[str, list[str]]]) -> list[str]:
    """Each pair of packages that reach each other, with the imports that make the first reach the second."""
    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), {}):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    return sorted(f"{a} -> {b} ({'; '.join(sorted(why)[:3])}) and back" for a, edges in graph.items()
                  for b, why in edges.items() if a in reaches(b))


def test_the_package_checker_can_fail():
    graph = {"kvbridge.engine": {"kvbridge.blend": ["kvbridge.engine.x imports kvbridge.blend.y"]},
             "kvbridge.blend": {"kvbridge.store": ["..."]}, "kvbridge.store": {"kvbridge.engine": ["..."]}}
    assert len(_package_cycles(graph)) == 3


def test_no_two_packages_import_each_other_counting_imports_in_functions():
    assert _package_cycles(package_graph()) == []


def test_every_package_has_a_layer():
    packages = {_package_of(m) for m in _modules() if m != "kvbridge"}
    assert sorted(packages - set(LAYERS)) == []


def test_packages_import_only_the_layers_below_them():
    rank = {name: i for i, name in enumerate(LAYERS)}
    wrong = sorted(f"{why[0]} ({source} is not above {dest})" for source, edges in package_graph().items()
                   for dest, why in edges.items() if rank.get(dest, -1) >= rank.get(source, -1))
    assert wrong == []


def test_no_module_is_over_500_lines():
    long = sorted(f"{path.relative_to(PACKAGE_DIR.parent)}: {n} lines" for path in PACKAGE_DIR.rglob("*.py")
                  if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES)
    assert long == []


# --- the stable public names ---------------------------------------------------------------------

STABLE_NAMES = (
    ("kvbridge", "CachedEngine"),
    ("kvbridge", "Settings"),
    ("kvbridge", "make_backend"),
    ("kvbridge.__main__", "main"),
    ("kvbridge.cache_server.client", "CacheClient"),
    ("kvbridge.store.objects", "ObjectMeta"),
    ("kvbridge.engine.records", "RequestRecord"),
)


@pytest.mark.parametrize("module, name", STABLE_NAMES, ids=[f"{m}.{n}" for m, n in STABLE_NAMES])
def test_the_stable_names_stay_importable(module, name):
    assert getattr(importlib.import_module(module), name) is not None


def test_main_returns_the_exit_code(capsys):
    """`kvbridge.__main__.main(argv)` returns the exit code (no SystemExit for a command that ran)."""
    from kvbridge.__main__ import main

    assert main([]) == 0
    assert "commands:" in capsys.readouterr().out
    assert main(["scenarios"]) == 0
    assert "doc-qa" in capsys.readouterr().out


# --- one home per fact ---------------------------------------------------------------------------

def _calls_of(name: str) -> list[str]:
    """Modules (outside formats/, where the layout facts are defined) whose code calls `name(...)`."""
    found = []
    for module, path in _modules().items():
        if module.startswith("kvbridge.formats"):
            continue
        for node in _nodes(path):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name:
                found.append(module)
                break
    return sorted(found)


def _definitions_of(name: str) -> list[str]:
    found = []
    for module, path in _modules().items():
        for node in _nodes(path):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
                found.append(module)
    return sorted(found)


@pytest.mark.parametrize("call, home", [
    ("kv_support", "kvbridge.engine.layout"),        # which layout a model's KV must have, or its refusal
    ("kv_namespace", "kvbridge.engine.namespace"),   # the namespace every key lives under
])
def test_each_fact_is_worked_out_in_one_home(call, home):
    assert _calls_of(call) == [home]


def test_the_geometry_is_probed_in_one_place():
    """Only engine.layout turns a probe's state into a KVGeometry (CachedEngine, the scheduler and blend ask it)."""
    takers = []
    for module, path in _modules().items():
        if module.startswith("kvbridge.formats"):
            continue
        for node in _nodes(path):
            if (isinstance(node, ast.Attribute) and node.attr == "geometry" and isinstance(node.value, ast.Call)
                    and getattr(node.value.func, "id", None) == "parse_state"):
                takers.append(module)
    assert sorted(takers) == ["kvbridge.engine.layout"]


@pytest.mark.parametrize("name, home", [
    ("open_store", "kvbridge.store.opening"),
    ("Utf8Decoder", "kvbridge.backends.text_decoding"),
    ("decide_layout", "kvbridge.engine.layout"),
    ("namespace_for", "kvbridge.engine.namespace"),
    ("MissExplainer", "kvbridge.engine.misses"),   # the cause of a miss, named in one place
    ("EvictionRing", "kvbridge.store.history"),    # the history of a key
])
def test_each_shared_name_is_defined_once(name, home):
    assert _definitions_of(name) == [home]


def test_the_engine_blend_and_scheduler_use_no_engine_adapter():
    """The adapters are the registry's to load: the core and the modes above it import none of them."""
    from kvbridge.settings.engines import BUILTIN_ADAPTERS

    wrong = sorted(why for source in ("kvbridge.engine", "kvbridge.blend", "kvbridge.scheduler")
                   for why in package_graph().get(source, {}).get("kvbridge.backends", [])
                   if any(why.endswith(f" {a}") or f" {a}." in why for a in BUILTIN_ADAPTERS))
    assert wrong == []


# --- the benchmark registry and the command line ---------------------------------------------------

def test_every_bench_command_is_a_registry_row_and_reads_its_help_there():
    """`kvbridge bench*` commands are the registry's rows: the same names, the help from `measures`, a module that imports."""
    from kvbridge.bench.registry import BENCH_COMMANDS
    from kvbridge.cli.commands import BY_NAME

    cli_benches = sorted(name for name in BY_NAME if name.startswith("bench"))
    assert cli_benches == sorted(row.name for row in BENCH_COMMANDS)
    for row in BENCH_COMMANDS:
        assert BY_NAME[row.name].help == row.measures, row.name
        assert row.baseline.strip(), f"{row.name} names no baseline"
        importlib.import_module(row.module)


def test_research_probes_are_not_commands():
    from kvbridge.cli.commands import BY_NAME

    probes = sorted(p.stem for p in (PACKAGE_DIR / "bench" / "probes").glob("*.py") if p.stem != "__init__")
    assert probes, "no research probe found in kvbridge/bench/probes"
    assert not {p.replace("_", "-") for p in probes} & set(BY_NAME)


def test_main_only_dispatches():
    """`__main__` holds no command: each command's parser and body live in a module of kvbridge/cli/."""
    tree = ast.parse((PACKAGE_DIR / "__main__.py").read_text())
    functions = sorted(node.name for node in tree.body if isinstance(node, ast.FunctionDef))
    assert functions == ["main"]


# --- plugin tables: the one way a lower layer reaches code above it -------------------------------

PLUGIN_TABLES = (   # (the module holding the table, the table, a function listing what was registered)
    ("kvbridge.settings.engines", "BUILTIN_ADAPTERS", "known_engine_names"),
    ("kvbridge.settings.codecs", "BUILTIN_CODECS", "codec_names"),
    ("kvbridge.store.opening", "BUILTIN_REMOTE_STORES", None),
    ("kvbridge.engine.modes", "BUILTIN_MODE_PLUGINS", "mode_names"),
)


def test_a_module_names_a_higher_layer_only_in_a_plugin_table():
    """A string that names a kvbridge module of a higher layer (something importlib could load) stands only in
    a plugin table: no lower package reaches upwards by a name hidden elsewhere."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    listed = {plugin for host, table, _ in PLUGIN_TABLES for plugin in getattr(importlib.import_module(host), table)}
    known = set(_modules())
    wrong = []
    for module, path in _modules().items():
        if module == "kvbridge":
            continue   # the facade names the public API's homes
        for node in _nodes(path):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
                target = _package_of(node.value)
                if rank.get(target, -1) > rank[_package_of(module)] and node.value not in listed:
                    wrong.append(f"{module} names {node.value}")
    assert sorted(wrong) == []


@pytest.mark.parametrize("host, table, _", PLUGIN_TABLES, ids=[t[0] for t in PLUGIN_TABLES])
def test_a_plugin_table_names_only_modules_of_higher_layers(host, table, _):
    rank = {name: i for i, name in enumerate(LAYERS)}
    for plugin in getattr(importlib.import_module(host), table):
        assert rank[_package_of(plugin)] > rank[_package_of(host)], f"{plugin} is not above {host}"


RAW_TABLES = {"kvbridge.settings.engines": "_ENGINES", "kvbridge.settings.codecs": "_CODECS",
              "kvbridge.store.opening": "_KINDS", "kvbridge.engine.modes": "_MODES"}


@pytest.mark.parametrize("host, table", [t[:2] for t in PLUGIN_TABLES], ids=[t[0] for t in PLUGIN_TABLES])
def test_each_plugin_registers_into_its_host_when_imported(host, table):
    """Importing one plugin module (in a fresh interpreter, after its host alone) adds to the host's table."""
    raw = RAW_TABLES[host]
    for plugin in getattr(importlib.import_module(host), table):
        code = (f"import {host} as h\nbefore = len(h.{raw})\nimport {plugin}\n"
                f"print(before, len(h.{raw}))")
        out = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE_DIR.parent, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        before, after = map(int, out.stdout.split()[-2:])
        assert after > before, f"importing {plugin} registered nothing in {host}.{raw}"
