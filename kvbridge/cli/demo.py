"""`kvbridge demo`: a short Document Q&A in cold and lmcache modes, printed as it runs."""
from __future__ import annotations

import tempfile

from kvbridge.cli.command import Command
from kvbridge.cli.common import add_model_options, make_engine, settings_for_model


def run(args) -> int:
    from kvbridge.bench.common.runner import run_scenario

    settings = settings_for_model("demo", args)
    with tempfile.TemporaryDirectory(prefix="kvb-demo-l2-") as l2:
        with make_engine(settings, l2) as engine:
            print(f"Demo: Document Q&A on {engine.status()['label']}, 3 questions, cold then lmcache.")
            for r in run_scenario(engine, "doc-qa", ["cold", "lmcache"], n_requests=3, n_predict=24):
                print(f"  {r.mode:8} {r.label[:40]:40} TTFT {r.ttft_ms:8.1f} ms  reused {r.matched_tokens:5}/"
                      f"{r.prompt_tokens} tokens from {r.tier:4}  {r.text.strip()[:50]!r}")
    return 0


COMMAND = Command("demo", "run a short Document Q&A in cold and lmcache modes and print what happened",
                  run, lambda parser: add_model_options(parser, "demo"))
