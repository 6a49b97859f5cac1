"""Composing the cache server from its modules: specs -> classes -> dependency order -> instances -> handlers.

The built-ins are every concrete DiscoverableModule defined in kvbridge.cache_server.modules; nothing
else runs unless the operator names it (--server-module or KVB_CACHE_SERVER_MODULES), including the
opt-in modules shipped in kvbridge.cache_server.plugin_modules. A configured module may replace a
built-in by subclassing it and keeping its module_name. Startup fails, with a message for a person,
on anything ambiguous: a name clash, a missing dependency, a cycle, a method two modules claim.

Deliberately left out: entry-point discovery (installing a package never changes the server) and
per-module enable/disable flags (a module whose create() returns None simply does not run).
"""
from __future__ import annotations

import heapq
import importlib
import inspect
import json
import logging
import pkgutil
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from kvbridge.cache_server.module import (
    HANDLER_MARK, DiscoverableModule, HandlerRouter, ModuleBuildContext, ModuleStartupError,
    is_liveness_target, module_label,
)

log = logging.getLogger("kvbridge.cache_server")

BUILTIN_PACKAGE = "kvbridge.cache_server.modules"
SPEC_FIELDS = ("module_path", "config")
_SPEC_EXAMPLE = '{"module_path": "my_package.server_module", "config": {}}'


@dataclass(frozen=True)
class ModuleSpec:
    """One configured module: the Python module to import and the config its classes get."""

    module_path: str
    config: dict = field(default_factory=dict)


def parse_module_specs(text: str, source: str) -> list[ModuleSpec]:
    """One JSON object or a JSON list of them; `source` (the flag or variable) starts every error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModuleStartupError(f"{source}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                                 f"give an object like {_SPEC_EXAMPLE} or a list of them") from None
    if isinstance(value, dict):
        return [_parse_spec(value, source)]
    if isinstance(value, list):
        return [_parse_spec(item, f"{source} item {i}") for i, item in enumerate(value)]
    raise ModuleStartupError(f"{source}: expected a JSON object like {_SPEC_EXAMPLE} or a list of them, "
                             f"got {type(value).__name__}")


def _parse_spec(value: Any, where: str) -> ModuleSpec:
    if not isinstance(value, dict):
        raise ModuleStartupError(f"{where}: expected an object like {_SPEC_EXAMPLE}, got {type(value).__name__}")
    unknown = sorted(set(value) - set(SPEC_FIELDS))
    if unknown:
        raise ModuleStartupError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; "
                                 f"a module spec has only {' and '.join(SPEC_FIELDS)}")
    path = value.get("module_path")
    if path is None:
        raise ModuleStartupError(f"{where}: module_path is missing; give the Python module to load, like {_SPEC_EXAMPLE}")
    if not isinstance(path, str) or not path or not all(part.isidentifier() for part in path.split(".")):
        raise ModuleStartupError(f"{where}: module_path must be a dotted Python module path like "
                                 f"'my_package.server_module', got {path!r}")
    config = value.get("config", {})
    if not isinstance(config, dict):
        raise ModuleStartupError(f"{where}: config of {path!r} must be a JSON object, got {type(config).__name__}")
    return ModuleSpec(path, config)


def _classes_defined_in(mod: ModuleType) -> list[type[DiscoverableModule]]:
    """Concrete DiscoverableModule subclasses defined in `mod` itself (not ones it imports)."""
    return [obj for obj in vars(mod).values()
            if isinstance(obj, type) and issubclass(obj, DiscoverableModule)
            and obj.__module__ == mod.__name__ and not inspect.isabstract(obj)]


def builtin_module_classes(package: str = BUILTIN_PACKAGE) -> list[type[DiscoverableModule]]:
    """Every module class in `package`'s submodules (names starting with "_" are skipped); [] if no package."""
    try:
        pkg = importlib.import_module(package)
    except ModuleNotFoundError as exc:
        # only the package itself missing means "no built-ins"; a built-in that fails to import is a bug
        if exc.name and (package == exc.name or package.startswith(exc.name + ".")):
            return []
        raise
    classes: list[type[DiscoverableModule]] = []
    for info in pkgutil.iter_modules(getattr(pkg, "__path__", []), prefix=package + "."):
        if not info.name.rsplit(".", 1)[-1].startswith("_"):
            classes += _classes_defined_in(importlib.import_module(info.name))
    return classes


def load_module_classes(spec: ModuleSpec) -> list[type[DiscoverableModule]]:
    """Import `spec.module_path` and return the module classes it defines (at least one)."""
    try:
        mod = importlib.import_module(spec.module_path)
    except Exception as exc:
        raise ModuleStartupError(f"server module {spec.module_path!r} could not be imported: "
                                 f"{type(exc).__name__}: {exc}") from exc
    classes = _classes_defined_in(mod)
    if not classes:
        raise ModuleStartupError(f"server module {spec.module_path!r} defines no concrete DiscoverableModule "
                                 "subclass (module classes it imports from elsewhere do not count)")
    return classes


class ComposedModules:
    """The constructed modules in construction order, their router and liveness targets."""

    def __init__(self, modules: list[DiscoverableModule], router: HandlerRouter, liveness_targets: list,
                 dependencies: dict[str, list[str]], external: set[str], skipped: list[str]) -> None:
        self.modules = modules
        self.by_name = {m.module_name: m for m in modules}
        self.router = router
        self.liveness_targets = liveness_targets
        self.skipped = skipped   # module names whose create() returned None
        self._dependencies = dependencies
        self._external = external
        self._closed = False
        self._close_lock = threading.Lock()

    def dependencies_of(self, name: str) -> list[str]:
        return list(self._dependencies[name])

    def describe(self) -> list[dict]:
        """One row per constructed module, for the GUI: name, class, dependencies, external."""
        return [{"name": m.module_name, "class": f"{type(m).__module__}.{type(m).__qualname__}",
                 "dependencies": self.dependencies_of(m.module_name), "external": m.module_name in self._external}
                for m in self.modules]

    def status(self) -> dict:
        """{module_name: report_status()}; a module whose report fails shows the error, the others still report."""
        out = {}
        for module in self.modules:
            try:
                out[module.module_name] = module.report_status()
            except Exception as exc:
                log.exception("module %s: report_status failed", module.module_name)
                out[module.module_name] = {"error": f"{type(exc).__name__}: {exc}"}
        return out

    def touch(self, instance_id: str) -> None:
        """A client was heard from: every liveness target keeps its state alive."""
        for target in self.liveness_targets:
            target.touch_instance(instance_id)

    def register_zmq_services(self, server: Any) -> None:
        """Let each module bind its sidecar services, in construction order, before the server serves."""
        for module in self.modules:
            _startup_hook(module, "register_zmq_services", server)

    def close(self) -> None:
        """Quiesce every module, then close every module, both in reverse order; runs once."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        _shut_down(self.modules)


def compose(specs: list[ModuleSpec], server_context: Any, builtin_package: str = BUILTIN_PACKAGE) -> ComposedModules:
    """Build the server's modules: the built-ins plus the configured ones, in dependency order."""
    classes, resolve, configs, external = _collect_classes(specs, builtin_package)
    order = _dependency_order(classes, resolve)
    built: dict[type, DiscoverableModule] = {}
    skipped: list[type] = []
    modules: list[DiscoverableModule] = []
    dependencies: dict[str, list[str]] = {}
    try:
        for cls in order:
            deps = [resolve.get(dep, dep) for dep in cls.dependencies]
            missing = [dep for dep in deps if dep in skipped]
            if missing:
                raise ModuleStartupError(
                    f"module {module_label(cls)} depends on {', '.join(module_label(d) for d in missing)}, "
                    "which did not start (its create() returned None); configure it or drop the dependency")
            module = _create(cls, ModuleBuildContext(server_context, building=cls, configs=configs,
                                                     resolve=resolve, built=built))
            if module is None:
                log.info("%s skipped (create() returned None)", cls.module_name)
                skipped.append(cls)
                continue
            built[cls] = module
            modules.append(module)
            dependencies[cls.module_name] = [dep.module_name for dep in deps]
            log.info("%s(dependencies=[%s])", cls.module_name, ", ".join(dependencies[cls.module_name]))
        router = _register_handlers(modules)
        targets = [m for m in modules if is_liveness_target(m)]
        for module in modules:
            _startup_hook(module, "attach_liveness_targets", list(targets))
    except BaseException:
        _shut_down(modules)
        raise
    return ComposedModules(modules, router, targets, dependencies,
                           {cls.module_name for cls in external}, [cls.module_name for cls in skipped])


def _collect_classes(specs: list[ModuleSpec], builtin_package: str):
    """(classes, built-in -> replacement, class -> config, configured classes); name clashes fail here."""
    builtins = builtin_module_classes(builtin_package)
    configured = [(cls, spec) for spec in specs for cls in load_module_classes(spec)]
    for cls in builtins + [cls for cls, _ in configured]:
        if not isinstance(getattr(cls, "module_name", None), str) or not cls.module_name:
            raise ModuleStartupError(f"module class {module_label(cls)} has no module_name; set one on the class")
    builtin_by_name = _unique_by_name(builtins, "built-in modules")
    _unique_by_name([cls for cls, _ in configured], "configured modules")
    resolve: dict[type, type] = {}
    for cls, spec in configured:
        builtin = builtin_by_name.get(cls.module_name)
        if builtin is None:
            continue
        if not issubclass(cls, builtin):
            raise ModuleStartupError(
                f"module {module_label(cls)} from {spec.module_path!r} uses the built-in name {cls.module_name!r} "
                f"without subclassing {module_label(builtin)}; subclass it to replace it, or pick another name")
        resolve[builtin] = cls
        if cls is not builtin:
            log.info("module %s replaces built-in %s", module_label(cls), module_label(builtin))
    classes = [resolve.get(b, b) for b in builtins] + [cls for cls, _ in configured if cls not in resolve.values()]
    configs = {cls: spec.config for cls, spec in configured}
    return classes, resolve, configs, [cls for cls, _ in configured]


def _unique_by_name(classes: list[type], what: str) -> dict[str, type]:
    by_name: dict[str, type] = {}
    for cls in classes:
        other = by_name.setdefault(cls.module_name, cls)
        if other is not cls:
            raise ModuleStartupError(f"two {what} share the name {cls.module_name!r}: "
                                     f"{module_label(other)} and {module_label(cls)}; module names must be unique")
    return by_name


def _dependency_order(classes: list[type], resolve: dict[type, type]) -> list[type]:
    """Kahn's algorithm, ties broken by module_name so the order is the same on every start."""
    present = set(classes)
    needs: dict[type, set[type]] = {}
    missing = []
    for cls in classes:
        deps = {resolve.get(dep, dep) for dep in cls.dependencies}
        missing += [f"{module_label(cls)} needs {module_label(dep)}" for dep in deps if dep not in present]
        needs[cls] = deps & present
    if missing:
        raise ModuleStartupError("missing module dependencies: " + "; ".join(missing) +
                                 ". Name the module that defines each one with --server-module")
    dependents: dict[type, list[type]] = {cls: [] for cls in classes}
    for cls, deps in needs.items():
        for dep in deps:
            dependents[dep].append(cls)
    waiting = {cls: len(deps) for cls, deps in needs.items()}
    ready = [(cls.module_name, cls) for cls in classes if not waiting[cls]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, cls = heapq.heappop(ready)
        order.append(cls)
        for dependent in dependents[cls]:
            waiting[dependent] -= 1
            if not waiting[dependent]:
                heapq.heappush(ready, (dependent.module_name, dependent))
    if len(order) < len(classes):
        cycle = _find_cycle({cls: needs[cls] for cls in classes if waiting[cls]})
        raise ModuleStartupError("module dependency cycle: " + " -> ".join(c.module_name for c in cycle) +
                                 "; a module cannot depend on itself, directly or through others")
    return order


def _find_cycle(needs: dict[type, set[type]]) -> list[type]:
    """One cycle among modules Kahn could not order (each still waits on another of them): a -> b -> a."""
    path: list[type] = []
    cls = min(needs, key=lambda c: c.module_name)
    while cls not in path:
        path.append(cls)
        cls = min((dep for dep in needs[cls] if dep in needs), key=lambda c: c.module_name)
    return path[path.index(cls):] + [cls]


def _create(cls: type, build_ctx: ModuleBuildContext) -> DiscoverableModule | None:
    try:
        module = cls.create(build_ctx)
    except Exception as exc:
        raise ModuleStartupError(f"module {module_label(cls)} failed to start: {type(exc).__name__}: {exc}") from exc
    if module is not None and not isinstance(module, DiscoverableModule):
        raise ModuleStartupError(f"module {module_label(cls)}: create() returned {type(module).__name__}, "
                                 "not a DiscoverableModule or None")
    return module


def _register_handlers(modules: list[DiscoverableModule]) -> HandlerRouter:
    """Core handlers and @server_module_handler methods, module by module in construction order."""
    router = HandlerRouter()
    for module in modules:
        with router.registering(module.module_name):
            _startup_hook(module, "register_handlers", router)
            for method, affinity, fn in _marked_handlers(module):
                router.add_method(method, fn, affinity=affinity)
    return router


def _marked_handlers(module: DiscoverableModule) -> list[tuple[str, bool, Any]]:
    """(method, affinity, bound fn) for each @server_module_handler; an override of one keeps serving it."""
    found = []
    for attr in dir(type(module)):
        for klass in type(module).__mro__:
            mark = getattr(vars(klass).get(attr), HANDLER_MARK, None)
            if mark is not None:
                found.append((mark[0], mark[1], getattr(module, attr)))
                break
    return found


def _startup_hook(module: DiscoverableModule, hook: str, *args: Any) -> None:
    try:
        getattr(module, hook)(*args)
    except ModuleStartupError:
        raise
    except Exception as exc:
        raise ModuleStartupError(f"module {module_label(type(module))}: {hook}() failed: "
                                 f"{type(exc).__name__}: {exc}") from exc


def _shut_down(modules: list[DiscoverableModule]) -> None:
    """quiesce() all, then close() all, in reverse; one that raises is logged and the others still run."""
    for step in ("quiesce", "close"):
        for module in reversed(modules):
            try:
                getattr(module, step)()
            except Exception:
                log.exception("module %s: %s() failed; shutting down the others anyway", module.module_name, step)
