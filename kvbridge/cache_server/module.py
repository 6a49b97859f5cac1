"""The module contract of the cache server: what a built-in or plugin module is and what it may use.

The server (`python -m kvbridge cache-server`) is composed from small DiscoverableModule classes, one
concern each (lookup, storage, management, metrics are the built-ins in kvbridge.cache_server.modules;
opt-in ones live in kvbridge.cache_server.plugin_modules; external ones are named with
--server-module). kvbridge.cache_server.compose orders them by their declared dependencies, calls
`create(build_ctx)` on each, lets them register handlers on a HandlerRouter, and closes them in
reverse order; the server's main loop only routes messages to those handlers.

A module is a plain class; everything beyond `create` is optional:

    class EchoModule(DiscoverableModule):
        module_name = "echo"
        dependencies = (LookupModule,)

        @classmethod
        def create(cls, build_ctx):
            return cls(build_ctx.server_context, build_ctx.config_for(cls).get("prefix", ""))

        @server_module_handler("echo.say")
        def say(self, payload: bytes) -> bytes:
            return payload

Hooks a module may override (the base class defines them as no-ops):
  register_handlers(router)       core-request handlers (kvbridge.cache_server.calls has the Call/Answer shape)
  register_zmq_services(server)   sidecar sockets, bound before the server serves; close() must stop them
  attach_liveness_targets(list)   the modules with the InstanceLivenessTarget method set (management uses it)
  quiesce()                       stop background threads; runs for every module before any close()

This file is the stable surface plugin packages import; it imports nothing from the rest of the server.
"""
from __future__ import annotations

import abc
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Protocol, runtime_checkable

from kvbridge.errors import BadSettings

log = logging.getLogger("kvbridge.cache_server")

# set on a function by @server_module_handler: (method, requires_client_affinity)
HANDLER_MARK = "__kvb_server_module_handler__"


class ModuleStartupError(BadSettings):
    """The server cannot be composed from the configured modules; the message names the module or flag."""


def server_module_handler(method: str, requires_client_affinity: bool = False) -> Callable:
    """Mark `def fn(self, payload: bytes) -> bytes` as the handler of the envelope method `method`.

    The name is namespaced ("my_package.echo") so plugins cannot collide with each other by accident;
    with `requires_client_affinity` the call runs on the calling client's affinity thread, in order
    with its stores and retrieves, and is served only by server_module_affinity_call.
    """
    if not isinstance(method, str) or "." not in method or not all(method.split(".")):
        raise ValueError(f"server-module method {method!r} needs a namespace: name it like "
                         f"'my_package.{method if isinstance(method, str) and method else 'echo'}'")

    def mark(fn: Callable) -> Callable:
        setattr(fn, HANDLER_MARK, (method, bool(requires_client_affinity)))
        return fn

    return mark


@runtime_checkable
class InstanceLivenessTarget(Protocol):
    """Per-client state the management module pings and reaps. A module is a target by having the methods."""

    def touch_instance(self, instance_id: str) -> None: ...

    def reap_stale_instances(self, reap_timeout_s: float, registration_grace_s: float) -> list[str]: ...

    def tracked_instance_count(self) -> int: ...

    def drop_instance_state(self, instance_id: str) -> None: ...


LIVENESS_METHODS = ("touch_instance", "reap_stale_instances", "tracked_instance_count", "drop_instance_state")


def is_liveness_target(module: object) -> bool:
    """True when `module` has all four InstanceLivenessTarget methods (three of four is not a target)."""
    return all(callable(getattr(module, name, None)) for name in LIVENESS_METHODS)


@dataclass(frozen=True)
class Handler:
    """A registered handler: the callable, whether it runs on the client's affinity thread, its module."""

    fn: Callable
    affinity: bool = False
    owner: str = ""
    fast: bool = False   # short and never blocking: may run on the loop thread itself (see CacheServer)


class HandlerRouter:
    """Core request kinds and server-module methods -> the module handler that serves them.

    A core kind registered again is overridden (the later module wins: that is how a dependent module
    replaces its dependency's handler); a server-module method registered twice is a startup error.
    """

    def __init__(self) -> None:
        self._core: dict[str, Handler] = {}
        self._methods: dict[str, Handler] = {}
        self._registering = ""   # the module whose register_handlers() runs now: the default owner

    def handle(self, kind: str, fn: Callable, *, affinity: bool = False, owner: str = "", fast: bool = False) -> None:
        """Serve core request `kind` with `fn(call) -> Answer`, replacing any earlier handler.

        fast=True: the handler takes microseconds and never blocks (no disk, no network, no waiting),
        so the server may run it on its loop thread instead of handing it to a worker (one thread
        switch less each way). Leave it False unless that is true: a slow fast handler stalls every client.
        """
        owner = owner or self._registering
        previous = self._core.get(kind)
        if previous is not None:
            log.info("core handler %r: module %s overrides module %s", kind, owner or "?", previous.owner or "?")
        self._core[kind] = Handler(fn, affinity, owner, fast)

    def add_method(self, method: str, fn: Callable, *, affinity: bool = False, owner: str = "") -> None:
        """Serve server-module `method` with `fn(payload) -> bytes`; a second registration is an error."""
        owner = owner or self._registering
        previous = self._methods.get(method)
        if previous is not None:
            raise ModuleStartupError(
                f"server-module method {method!r} is registered by both module {previous.owner!r} and module "
                f"{owner!r}; rename one of them (method names are namespaced, e.g. 'my_package.{method}')")
        self._methods[method] = Handler(fn, affinity, owner)

    def core(self, kind: str) -> Handler | None:
        return self._core.get(kind)

    def method(self, name: str) -> Handler | None:
        return self._methods.get(name)

    def kinds(self) -> list[str]:
        return sorted(self._core)

    def methods(self) -> list[str]:
        return sorted(self._methods)

    @contextmanager
    def registering(self, owner: str) -> Iterator[HandlerRouter]:
        """While a module registers, handlers without an explicit owner are attributed to it."""
        self._registering = owner
        try:
            yield self
        finally:
            self._registering = ""


class DiscoverableModule(abc.ABC):
    """One concern of the cache server; subclasses set `module_name` and implement `create`."""

    module_name: ClassVar[str]
    # module classes (built-in or external) this one needs; a built-in that was replaced resolves to its
    # replacement, so depend on the built-in class, never on a plugin that may replace it
    dependencies: ClassVar[tuple[type[DiscoverableModule], ...]] = ()

    def __init__(self, context: Any) -> None:
        self.context = context   # the server's shared context: .settings, .store, .metrics

    @classmethod
    @abc.abstractmethod
    def create(cls, build_ctx: ModuleBuildContext) -> DiscoverableModule | None:
        """Build the module, or return None when it does not apply (e.g. metrics without a port)."""

    def report_status(self) -> dict:
        """A JSON-able dict for the server's status reply and the GUI."""
        return {}

    def register_handlers(self, router: HandlerRouter) -> None:
        """Register core-request handlers (called in construction order)."""

    def register_zmq_services(self, server: Any) -> None:
        """Bind sidecar sockets before the server starts serving; close() must stop them."""

    def attach_liveness_targets(self, targets: list) -> None:
        """Receive every module that is an InstanceLivenessTarget (called once, after composition)."""

    def quiesce(self) -> None:
        """Stop background threads; runs for every module, in reverse order, before any close()."""

    def close(self) -> None:
        """Release what the module holds; runs in reverse construction order."""


def module_label(cls: type) -> str:
    """`module_name (package.module.Class)` for messages; works for a class without a module_name."""
    name = getattr(cls, "module_name", None)
    path = f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', repr(cls))}"
    return f"'{name}' ({path})" if isinstance(name, str) else path


class ModuleBuildContext:
    """What `create(build_ctx)` may use: the server context, a module's config, its built dependencies.

    compose() hands each module its own build context, which knows the module being built; one made
    by hand (`ModuleBuildContext(server_context)`) serves a unit test of a single module's create().
    """

    def __init__(self, server_context: Any, *, building: type | None = None,
                 configs: dict[type, dict] | None = None, resolve: dict[type, type] | None = None,
                 built: dict[type, DiscoverableModule] | None = None) -> None:
        self.server_context = server_context
        self._building = building
        self._configs = configs if configs is not None else {}
        self._resolve = resolve if resolve is not None else {}   # built-in class -> its replacement
        self._built = built if built is not None else {}         # constructed so far, by class

    @property
    def settings(self) -> Any:
        return self.server_context.settings

    @property
    def store(self) -> Any:
        return self.server_context.store

    @property
    def metrics(self) -> Any:
        return self.server_context.metrics

    def config_for(self, module_class: type) -> dict:
        """The `config` object configured with the module's --server-module spec; {} for built-ins."""
        return dict(self._configs.get(self._resolve.get(module_class, module_class), {}))

    def require(self, module_class: type[DiscoverableModule]) -> DiscoverableModule:
        """The constructed instance of a declared dependency (a replaced built-in gives its replacement)."""
        wanted = self._resolve.get(module_class, module_class)
        if self._building is not None:
            declared = {self._resolve.get(dep, dep) for dep in self._building.dependencies}
            if wanted not in declared:
                raise ModuleStartupError(
                    f"module {module_label(self._building)} asked for {module_label(module_class)} without "
                    f"declaring it: add it to {self._building.__qualname__}.dependencies")
        instance = self._built.get(wanted)
        if instance is None:
            raise ModuleStartupError(f"module {module_label(wanted)} is not constructed (yet): "
                                     "require() only gives the dependencies a module declares")
        return instance


def __getattr__(name: str) -> Any:
    # The composition API lives in compose.py, which imports this file; forwarding lazily keeps
    # `from kvbridge.cache_server.module import compose` working without an import cycle.
    if name in {"ModuleSpec", "parse_module_specs", "builtin_module_classes", "load_module_classes",
                "compose", "ComposedModules"}:
        from kvbridge.cache_server import compose as _compose
        return getattr(_compose, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
