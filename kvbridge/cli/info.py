"""`kvbridge namespace`, `engines` and `scenarios`: what is configured, what there is to choose from."""
from __future__ import annotations

from kvbridge.cli.command import Command
from kvbridge.cli.common import add_model_options, make_engine, settings_for_model


def add_namespace_options(parser) -> None:
    add_model_options(parser, "namespace")


def run_namespace(args) -> int:
    settings = settings_for_model("namespace", args)
    with make_engine(settings) as engine:
        status = engine.status()
        print(f"engine:    {status['label']} ({status['location']}), {status['kv_mode'].upper()}")
        print(f"namespace: {status['namespace']}")
        print(f"short:     {status['namespace_short']}")
        if getattr(args, "exact", None) is not None:   # --exact / --no-exact: serve's scheduler in that mode
            from kvbridge.engine.namespace import short_namespace
            from kvbridge.scheduler.exact import serve_namespace

            served, why = serve_namespace(engine)
            print(f"serve:     {short_namespace(served)}  ({why or 'exact mode: the same namespace'})")
        print(f"KV layout: {status['kv_layout']}")
        if status.get("model"):
            print(f"model:     {status['model']}")
        if status.get("kv_refusal"):
            print(f"refused:   {status['kv_refusal']}")
        if engine.traits is not None:
            from kvbridge.models.matrix_rows import matrix_line

            # the zoo's compatibility matrix (Docs/Compatibility.md): where this architecture restores exactly
            print(f"matrix:    {matrix_line(engine.traits.architecture)}")
    return 0


def run_engines(args) -> int:
    from kvbridge.backends import engine_specs

    for spec in engine_specs():
        aliases = f" (aliases: {', '.join(spec.aliases)})" if spec.aliases else ""
        print(f"{spec.key:13} {spec.cls.kv_mode.upper():6} {spec.label}{aliases}\n{'':20} {spec.blurb}")
    return 0


def run_scenarios(args) -> int:
    from kvbridge.bench.common.scenarios import scenario_specs

    for sc in scenario_specs():
        print(f"{sc.key:15} {sc.title}: {sc.description}")
    return 0


NAMESPACE = Command("namespace",
                    "start the configured engine and print its namespace (what its stored KV is keyed under)",
                    run_namespace, add_namespace_options)
ENGINES = Command("engines", "list the engines in the registry", run_engines)
SCENARIOS = Command("scenarios", "list the demo scenarios", run_scenarios)
