"""An engine process for the cache-server tests: `python tests/cs_engine_child.py ENGINE PLAN`.

Settings come from the environment (KVB_STORE_URL points at the cache server). PLAN:
  store    run the document prompt in lmcache mode (a miss: its KV goes to the server), print the
           record as one JSON line, then wait to be killed
  restore  fill the context with something else, run the prompt cold, fill it again, run it in
           lmcache mode; print {"cold": record, "warm": record} as one JSON line
"""
from __future__ import annotations

import json
import sys
import time

from kvbridge.backends import make_backend
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.settings import Settings

UNRELATED = [{"role": "user", "content": "Write a haiku about autumn leaves falling on a quiet pond at dusk."}]


def doc_prompt() -> list[dict]:
    from kvbridge.bench.common.scenarios import builtin_document

    doc = builtin_document()[:1200]
    return [{"role": "system", "content": "Answer from the document."},
            {"role": "user", "content": f"Document:\n{doc}\n\nQuestion: Who leads the operations team?"}]


def main(engine_key: str, plan: str) -> None:
    settings = Settings.from_env()
    problems = settings.validate()
    if problems:
        sys.exit("; ".join(problems))
    with CachedEngine(settings, make_backend(engine_key, settings)) as engine:
        if plan == "store":
            record = engine.infer(doc_prompt(), mode="lmcache", n_predict=12)
            print(json.dumps(record.to_dict()), flush=True)
            time.sleep(600)
        elif plan == "restore":
            engine.infer(UNRELATED, mode="native", n_predict=4)
            cold = engine.infer(doc_prompt(), mode="cold", n_predict=12)
            engine.infer(UNRELATED, mode="native", n_predict=4)
            warm = engine.infer(doc_prompt(), mode="lmcache", n_predict=12)
            print(json.dumps({"cold": cold.to_dict(), "warm": warm.to_dict()}), flush=True)
        else:
            sys.exit(f"unknown plan {plan!r}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
