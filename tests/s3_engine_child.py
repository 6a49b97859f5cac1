"""One "host" for the cross-host S3 tests: `python tests/s3_engine_child.py STEP [STEP ...]`.

Settings come from the environment (its own KVB_L2_DIR, the shared KVB_S3_*). Steps, in order:
  MODE:Q    answer question Q (an index into the handbook questions) on the document in MODE
            (cold, native or lmcache) and print the record as one JSON line, with the request's wall time
  wait      read one line from stdin first (the test does something between two requests)
  s3        print the S3 tier's health (breaker state, fault counters) as one JSON line
At the end the engine is closed, which waits for the writes queued for S3.
"""
from __future__ import annotations

import json
import sys
import time

from kvbridge.backends import make_backend
from kvbridge.bench.common.scenarios import DOC_QA_SYSTEM, HANDBOOK_QUESTIONS, builtin_document
from kvbridge.engine.cached_engine import CachedEngine
from kvbridge.settings import Settings

DOC_CHARS = 1200


def question_prompt(index: int) -> list[dict]:
    doc = builtin_document()[:DOC_CHARS]
    return [{"role": "system", "content": DOC_QA_SYSTEM},
            {"role": "user", "content": f"Document:\n{doc}\n\nQuestion: {HANDBOOK_QUESTIONS[index]}"}]


def main(steps: list[str]) -> None:
    settings = Settings.from_env()
    problems = settings.validate()
    if problems:
        sys.exit("; ".join(problems))
    with CachedEngine(settings, make_backend("llamacpp", settings)) as engine:
        s3 = next(tier for tier in engine.store.tiers if tier.name == "S3")
        for step in steps:
            if step == "wait":
                sys.stdin.readline()
                continue
            if step == "s3":
                print(json.dumps({"s3": s3.health(), "why_down": s3.why_down()}), flush=True)
                continue
            mode, _, question = step.partition(":")
            started = time.perf_counter()
            record = engine.infer(question_prompt(int(question)), mode=mode, n_predict=12)
            print(json.dumps({**record.to_dict(), "wall_s": time.perf_counter() - started}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
