"""The cache server's module system: spec parsing, discovery, replacement, dependency order, handlers,
liveness targets and shutdown order.

The real built-ins are written separately, so composition runs over a fake built-in package
(tests/cs_plugins/fake_builtins: storage <- lookup, storage <- management) and plugin modules in
tests/cs_plugins, loaded by module_path exactly as an operator's --server-module would load them.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kvbridge.cache_server.compose import (
    ModuleSpec, builtin_module_classes, compose, load_module_classes, parse_module_specs,
)
from kvbridge.cache_server.module import (
    HandlerRouter, InstanceLivenessTarget, ModuleBuildContext, ModuleStartupError,
    is_liveness_target, server_module_handler,
)
from kvbridge.errors import BadSettings
from tests.cs_plugins import EVENTS
from tests.cs_plugins.fake_builtins.storage import StorageModule

FAKE_BUILTINS = "tests.cs_plugins.fake_builtins"


@pytest.fixture(autouse=True)
def clear_events():
    EVENTS.clear()
    yield
    EVENTS.clear()


@pytest.fixture
def server_context():
    return SimpleNamespace(settings="settings", store="store", metrics="metrics")


def spec(name: str, **config) -> ModuleSpec:
    return ModuleSpec(f"tests.cs_plugins.{name}", config)


def build(server_context, *names: str, **configs):
    """Compose the fake built-ins plus tests.cs_plugins.<name> for each name (config by name)."""
    return compose([spec(n, **configs.get(n, {})) for n in names], server_context, builtin_package=FAKE_BUILTINS)


def names(composed) -> list[str]:
    return [m.module_name for m in composed.modules]


# --- specs ---------------------------------------------------------------------------------------

def test_a_spec_is_one_object_with_config_defaulting_to_empty():
    assert parse_module_specs('{"module_path": "pkg.mod"}', "--server-module") == [ModuleSpec("pkg.mod", {})]
    assert parse_module_specs('{"module_path": "pkg.mod", "config": {"mode": "shadow"}}', "--server-module") == [
        ModuleSpec("pkg.mod", {"mode": "shadow"})]


def test_one_flag_may_hold_a_json_list_of_specs():
    text = '[{"module_path": "a.one"}, {"module_path": "b.two", "config": {"n": 2}}]'
    assert parse_module_specs(text, "--server-module") == [ModuleSpec("a.one", {}), ModuleSpec("b.two", {"n": 2})]


@pytest.mark.parametrize("text, says", [
    ('{"module_path": ', "not valid JSON"),
    ('"pkg.mod"', "expected a JSON object"),
    ('{"config": {}}', "module_path is missing"),
    ('{"module_path": ""}', "dotted Python module path"),
    ('{"module_path": "pkg/mod.py"}', "dotted Python module path"),
    ('{"module_path": 3}', "dotted Python module path"),
    ('{"module_path": "pkg.mod", "config": [1]}', "config of 'pkg.mod' must be a JSON object"),
    ('{"module_path": "pkg.mod", "cfg": {}}', "unknown field(s) 'cfg'"),
    ('[{"module_path": "pkg.ok"}, 7]', "item 1: expected an object"),
])
@pytest.mark.parametrize("source", ["--server-module", "KVB_CACHE_SERVER_MODULES"])
def test_a_bad_spec_names_its_source_and_what_is_wrong(text, says, source):
    with pytest.raises(ModuleStartupError) as raised:
        parse_module_specs(text, source)
    assert str(raised.value).startswith(source) and says in str(raised.value)
    assert isinstance(raised.value, BadSettings)


# --- discovery -----------------------------------------------------------------------------------

def test_builtin_discovery_takes_concrete_classes_defined_in_public_submodules():
    found = {cls.module_name for cls in builtin_module_classes(FAKE_BUILTINS)}
    # _private.py is skipped, the abstract TierModuleBase in storage.py is skipped, and StorageModule,
    # imported by lookup.py and management.py, is counted once (where it is defined)
    assert found == {"storage", "lookup", "management"}
    assert len(builtin_module_classes(FAKE_BUILTINS)) == 3


def test_a_builtin_package_that_does_not_exist_yet_means_no_builtins():
    assert builtin_module_classes("tests.cs_plugins.no_such_package") == []


def test_loading_a_spec_takes_only_the_classes_its_module_defines():
    assert [cls.__name__ for cls in load_module_classes(spec("echo"))] == ["EchoModule"]
    assert [cls.module_name for cls in load_module_classes(spec("cycle"))] == ["alpha", "beta", "gamma"]


@pytest.mark.parametrize("path, says", [
    ("tests.cs_plugins.no_such_module", "could not be imported"),
    ("tests.cs_plugins.no_classes", "defines no concrete DiscoverableModule"),
])
def test_a_module_path_that_gives_no_module_fails_naming_it(path, says):
    with pytest.raises(ModuleStartupError, match=says) as raised:
        load_module_classes(ModuleSpec(path, {}))
    assert path in str(raised.value)


def test_a_shipped_opt_in_module_runs_only_when_named(server_context):
    """Like kvbridge.cache_server.plugin_modules: outside the walked package, so never composed on its own."""
    assert "qstore" not in names(build(server_context))
    composed = compose([ModuleSpec("tests.cs_plugins.fake_plugin_modules.qstore", {})], server_context,
                       builtin_package=FAKE_BUILTINS)
    assert "qstore" in names(composed)
    assert {row["name"]: row["external"] for row in composed.describe()}["qstore"] is True


# --- construction --------------------------------------------------------------------------------

def test_modules_are_built_in_dependency_order_with_ties_broken_by_name(server_context):
    composed = build(server_context, "echo")
    # after lookup both echo and management are ready: echo first by name, though management was ready earlier
    assert names(composed) == ["storage", "lookup", "echo", "management"]
    assert composed.dependencies_of("echo") == ["lookup"]
    assert composed.dependencies_of("storage") == []


def test_each_constructed_module_is_logged_with_its_dependencies(server_context, caplog):
    with caplog.at_level(logging.INFO, logger="kvbridge.cache_server"):
        build(server_context, "echo")
    lines = [r.getMessage() for r in caplog.records if r.name == "kvbridge.cache_server"]
    built = [line for line in lines if "(dependencies=" in line]
    assert built == ["storage(dependencies=[])", "lookup(dependencies=[storage])", "echo(dependencies=[lookup])",
                     "management(dependencies=[storage])"]


def test_config_for_gives_a_module_its_spec_config_and_builtins_nothing(server_context):
    composed = build(server_context, "echo", echo={"prefix": "> "})
    assert composed.by_name["echo"].config == {"prefix": "> "}
    assert composed.by_name["storage"].config == {}
    assert composed.router.method("echo.say").fn(b"hi") == b"> hi"


def test_the_build_context_forwards_the_server_context():
    context = SimpleNamespace(settings="S", store="T", metrics="M")
    build_ctx = ModuleBuildContext(context)
    assert (build_ctx.server_context, build_ctx.settings, build_ctx.store, build_ctx.metrics) == (context, "S", "T", "M")


def test_a_subclass_keeping_a_builtin_name_replaces_it_everywhere(server_context):
    composed = build(server_context, "replace_lookup", "echo", replace_lookup={"k": 1})
    lookup = composed.by_name["lookup"]
    assert type(lookup).__name__ == "BetterLookup"
    assert [type(m).__name__ for m in composed.modules].count("LookupModule") == 0   # the built-in is not built
    assert composed.by_name["echo"].lookup is lookup    # echo's dependency on LookupModule resolved to it
    assert lookup.config == {"k": 1}                    # config_for(LookupModule) is the replacement's config
    assert composed.router.method("lookup.debug").fn(b"x") == b"better:x"   # an overridden handler keeps serving
    assert {row["name"]: row["external"] for row in composed.describe()}["lookup"] is True


def test_a_builtin_name_without_subclassing_the_builtin_fails(server_context):
    with pytest.raises(ModuleStartupError, match="uses the built-in name 'lookup' without subclassing") as raised:
        build(server_context, "bad_name")
    assert "ImpostorLookup" in str(raised.value) and "tests.cs_plugins.bad_name" in str(raised.value)


def test_two_configured_modules_with_one_name_fail(server_context):
    with pytest.raises(ModuleStartupError, match="share the name 'echo'") as raised:
        build(server_context, "echo", "dup_name")
    assert "EchoModule" in str(raised.value) and "OtherEcho" in str(raised.value)


def test_a_missing_dependency_fails_naming_both_modules(server_context):
    with pytest.raises(ModuleStartupError, match="missing module dependencies") as raised:
        build(server_context, "missing_dep")
    assert "'haunted'" in str(raised.value) and "'ghost'" in str(raised.value)


def test_a_dependency_cycle_fails_naming_the_modules_in_it(server_context):
    with pytest.raises(ModuleStartupError, match="cycle") as raised:
        build(server_context, "cycle")
    message = str(raised.value)
    assert "alpha -> beta -> alpha" in message
    assert "gamma" not in message   # downstream of the cycle, not in it


def test_a_module_whose_create_returns_none_is_skipped(server_context):
    composed = build(server_context, "optional")
    assert "optional" not in composed.by_name and composed.skipped == ["optional"]
    assert "optional" in names(build(server_context, "optional", optional={"enabled": True}))


def test_depending_on_a_skipped_module_fails(server_context):
    with pytest.raises(ModuleStartupError, match="'needs_optional'.*depends on 'optional'.*returned None"):
        build(server_context, "optional", "needs_optional")


def test_a_create_that_raises_closes_what_was_built_and_names_the_module(server_context):
    with pytest.raises(ModuleStartupError, match="'broken'.*failed to start: RuntimeError: device not found"):
        build(server_context, "broken")
    assert EVENTS == ["lookup.close", "storage.close"]   # management (after broken by name) was never built


def test_require_refuses_an_undeclared_or_unbuilt_module(server_context):
    with pytest.raises(ModuleStartupError, match="'sneaky'.*without declaring it"):
        build(server_context, "undeclared")
    with pytest.raises(ModuleStartupError, match="'storage'.*not constructed"):
        ModuleBuildContext(server_context).require(StorageModule)


# --- handlers ------------------------------------------------------------------------------------

def test_a_dependent_module_overrides_a_core_handler_of_its_dependency(server_context, caplog):
    with caplog.at_level(logging.INFO, logger="kvbridge.cache_server"):
        composed = build(server_context, "core_override")
    handler = composed.router.core("lookup")
    assert handler.owner == "fast_lookup" and handler.fn(None) == "fast+lookup"
    assert "core handler 'lookup': module fast_lookup overrides module lookup" in caplog.text
    assert composed.router.core("store_inline").owner == "storage"   # owner defaults to the registering module
    assert composed.router.kinds() == ["lookup", "store_inline"]


def test_envelope_methods_are_collected_with_their_affinity(server_context):
    router = build(server_context, "echo").router
    assert router.methods() == ["echo.pin", "echo.say", "lookup.debug"]
    assert (router.method("echo.say").affinity, router.method("echo.pin").affinity) == (False, True)
    assert router.method("echo.pin").owner == "echo"
    assert router.method("echo.nope") is None


@pytest.mark.parametrize("bad", ["echo", "", ".echo", "pkg."])
def test_a_method_name_without_a_namespace_is_refused_when_decorating(bad):
    with pytest.raises(ValueError, match="needs a namespace") as raised:
        server_module_handler(bad)
    assert repr(bad) in str(raised.value)


@pytest.mark.parametrize("other", ["dup_method_plain", "dup_method_affinity"])
def test_two_modules_claiming_one_method_fail_naming_both(server_context, other):
    with pytest.raises(ModuleStartupError, match="'echo.say' is registered by both") as raised:
        build(server_context, "echo", other)
    owner = {"dup_method_plain": "say_again", "dup_method_affinity": "pinned_say"}[other]
    assert "'echo'" in str(raised.value) and f"'{owner}'" in str(raised.value)
    assert EVENTS[-1] == "storage.close"   # the modules already built were closed


def test_the_router_alone():
    router = HandlerRouter()
    router.handle("ping", lambda call: 1, owner="a")
    router.handle("ping", lambda call: 2, affinity=True, owner="b")
    assert router.core("ping").fn(None) == 2 and router.core("ping").affinity and router.core("missing") is None


# --- liveness ------------------------------------------------------------------------------------

def test_liveness_targets_are_found_by_their_method_set(server_context):
    composed = build(server_context, "partial_liveness", "full_liveness")
    targets = sorted(m.module_name for m in composed.liveness_targets)
    assert targets == ["lookup", "session_table"]   # almost_target has 3 of the 4 methods
    assert composed.by_name["management"].targets == composed.liveness_targets
    assert not is_liveness_target(composed.by_name["almost_target"])
    assert isinstance(composed.by_name["session_table"], InstanceLivenessTarget)
    composed.touch("worker-1")
    assert composed.by_name["session_table"].touched == ["worker-1"]
    assert composed.by_name["lookup"].tracked_instance_count() == 1


# --- runtime and shutdown ------------------------------------------------------------------------

def test_status_reports_every_module_and_an_error_for_one_that_raises(server_context, caplog):
    composed = build(server_context, "fragile")
    with caplog.at_level(logging.ERROR, logger="kvbridge.cache_server"):
        status = composed.status()
    assert status["fragile"] == {"error": "RuntimeError: status exploded"}
    assert status["storage"] == {"store": "store"}
    assert status["management"] == {"targets": 1, "reaper_running": True}
    assert "fragile: report_status failed" in caplog.text


def test_describe_lists_the_modules_for_the_gui(server_context):
    rows = build(server_context, "echo").describe()
    assert rows[2] == {"name": "echo", "class": "tests.cs_plugins.echo.EchoModule", "dependencies": ["lookup"],
                       "external": True}
    assert [row["external"] for row in rows] == [False, False, True, False]


def test_zmq_services_are_registered_with_the_server_object(server_context):
    composed = build(server_context, "echo")
    server = object()
    composed.register_zmq_services(server)
    assert composed.by_name["echo"].zmq_server is server


def test_shutdown_quiesces_everything_then_closes_in_reverse_order(server_context):
    composed = build(server_context, "echo")
    management = composed.by_name["management"]
    composed.close()
    # management's reaper stops before lookup (a liveness target) drops its instances' state
    assert EVENTS == ["management.quiesce", "management.close", "lookup.close", "storage.close"]
    assert management.reaper_running is False
    composed.close()
    assert len(EVENTS) == 4   # idempotent


def test_a_close_that_raises_does_not_stop_the_others(server_context, caplog):
    composed = build(server_context, "fragile")
    assert names(composed) == ["fragile", "storage", "lookup", "management"]
    with caplog.at_level(logging.ERROR, logger="kvbridge.cache_server"):
        composed.close()
    assert EVENTS == ["management.quiesce", "management.close", "lookup.close", "storage.close", "fragile.close"]
    assert "fragile: close() failed" in caplog.text



def test_the_composition_api_is_also_importable_from_the_module_contract():
    from kvbridge.cache_server import module
    from kvbridge.cache_server.module import ComposedModules, compose as forwarded
    assert forwarded is compose and ComposedModules.__name__ == "ComposedModules"
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018
