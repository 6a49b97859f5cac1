"""Document Q&A on the bench-size zoo through CachedEngine: every answer against cold, in-process and from L2.

Place in the flow: `python -m kvbridge.bench.probes.zoo_doc_qa` -> per architecture, two child processes on one
fresh L2 directory: the first answers each question cold, then in lmcache mode (the first request stores the
document's chunks, the others restore them); the second, a fresh process, answers each question in lmcache mode
again, restoring from L2. Every lmcache answer is set against its cold one twice: its text, and the logits of
the prompt's last position bit for bit, with the greedy margin (top-1 minus top-2 logit) of the cold run beside
them: random weights give thin margins, so equal text alone could hide a restore that computed differently.

The document and questions are the doc-qa scenario's (the built-in handbook, ~1.9k tokens with the chat
template); the models are `python -m kvbridge.models.zoo make ARCH --size bench` (zoo_model(ARCH, "bench")).
Docs/Research.md §30 has the figures; nothing here is a `kvbridge` command.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvbridge.settings import Settings
from kvbridge.settings.cmdline import Parser

ARCHS = ("lfm2", "qwen35", "granitehybrid", "mamba2", "gpt-oss", "gemma2")


def _settings(model_path: str, l2_dir: str, n_predict: int) -> Settings:
    return dataclasses.replace(Settings(), model_path=model_path, ctx_size=4096, n_predict=n_predict, l2_dir=l2_dir,
                               output_dir=str(Path(l2_dir).parent / "output"),
                               input_dir=str(Path(l2_dir).parent / "input"))


def _questions(count: int) -> list[tuple[dict, ...]]:
    from kvbridge.bench.common.scenarios import HANDBOOK_QUESTIONS, _doc_messages, builtin_document

    document = builtin_document()
    return [_doc_messages(document, q) for q in HANDBOOK_QUESTIONS[:count]]


def _answer(engine, messages, mode: str) -> dict:
    """One request; its text, where the restore ended, and the prompt's last logits (digest and margin)."""
    import numpy as np

    from kvbridge.models.matrix_oracle import top_margin

    record = engine.infer(messages, mode=mode)
    logits = getattr(engine.backend, "prompt_logits", None)   # None: an engine that does not keep them
    return {"mode": mode, "text": record.text, "error": record.error, "prompt_tokens": record.prompt_tokens,
            "matched": record.matched_tokens or 0, "tier": record.tier, "ttft_ms": round(record.ttft_ms or 0.0, 1),
            "logits": hashlib.sha256(np.ascontiguousarray(logits).tobytes()).hexdigest() if logits is not None else "",
            "margin": top_margin(logits) if logits is not None else None}


def child(phase: str, model_path: str, l2_dir: str, questions: int, n_predict: int) -> list[dict]:
    """`warm`: cold then lmcache for each question; `fresh`: lmcache only (a new process: L1 is empty)."""
    from kvbridge.backends.llamacpp import LlamaCppBackend
    from kvbridge.engine.cached_engine import CachedEngine

    settings = _settings(model_path, l2_dir, n_predict)
    rows = []
    with CachedEngine(settings, LlamaCppBackend(settings)) as engine:
        engine.backend.keep_prompt_logits = True
        asked = _questions(questions)
        modes = ("cold", "lmcache") if phase == "warm" else ("lmcache",)
        for mode in modes:
            for i, messages in enumerate(asked):
                rows.append({"q": i, "phase": phase, **_answer(engine, messages, mode)})
        engine.store.flush()   # the writes behind the last request reach L2 before the fresh process reads it
    return rows


def _run_child(phase: str, model_path: Path, l2_dir: str, questions: int, n_predict: int) -> list[dict]:
    run = subprocess.run([sys.executable, "-m", "kvbridge.bench.probes.zoo_doc_qa", "--child", phase,
                          "--model", str(model_path), "--l2", l2_dir, "--questions", str(questions),
                          "--n-predict", str(n_predict)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{phase} child failed on {model_path.name}: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def measure(arch: str, questions: int, n_predict: int) -> dict:
    """One architecture's row: answers and logits equal to cold, in-process and from L2, and the margins."""
    from kvbridge.models import zoo_model

    path = zoo_model(arch, "bench")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zoo-doc-qa-") as tmp:
        l2 = str(Path(tmp) / "l2")
        warm = _run_child("warm", path, l2, questions, n_predict)
        fresh = _run_child("fresh", path, l2, questions, n_predict)
    cold = {r["q"]: r for r in warm if r["mode"] == "cold"}
    lmcache = [r for r in warm if r["mode"] == "lmcache"]

    def tally(rows: list[dict]) -> dict:
        return {"text_equal": sum(r["text"] == cold[r["q"]]["text"] and not r["error"] for r in rows),
                "logits_equal": sum(bool(r["logits"]) and r["logits"] == cold[r["q"]]["logits"] for r in rows),
                "restored": sum(r["matched"] > 0 for r in rows), "n": len(rows),
                "matched": [r["matched"] for r in rows], "tiers": sorted({r["tier"] for r in rows if r["tier"]})}

    margins = [r["margin"] for r in cold.values() if r["margin"] is not None]
    return {"arch": arch, "model": path.name, "prompt_tokens": [cold[q]["prompt_tokens"] for q in sorted(cold)],
            "in_process": tally(lmcache), "fresh_from_l2": tally(fresh),
            "margin_min": round(min(margins), 4) if margins else None,
            "margin_median": round(statistics.median(margins), 4) if margins else None,
            "cold_ttft_ms": statistics.median(r["ttft_ms"] for r in cold.values()),
            "warm_ttft_ms": statistics.median(r["ttft_ms"] for r in lmcache[1:]) if len(lmcache) > 1 else None,
            "seconds": round(time.perf_counter() - started, 1)}


def step_cost(arch: str, repeats: int) -> dict:
    """What prefilling chunk by chunk costs a cold run: the first question's cold prefill (and first token) in
    KVB_CHUNK_SIZE steps against llama.cpp's own BATCH_TOKENS pieces, alternated (ABBA) on one engine, medians."""
    from kvbridge.backends.base import EngineReport, Prompt
    from kvbridge.backends.llamacpp import LlamaCppBackend
    from kvbridge.models import zoo_model

    with tempfile.TemporaryDirectory(prefix="zoo-step-cost-") as tmp:
        settings = _settings(str(zoo_model(arch, "bench")), str(Path(tmp) / "l2"), 1)
        backend = LlamaCppBackend(settings)
        backend.start()
        try:
            text = backend.render(_questions(1)[0])
            prompt = Prompt(text=text, tokens=tuple(backend.tokenize(text)))
            chunked = backend._prefill_step

            def cold_ms(step: int) -> float:
                backend._prefill_step = step
                started = time.perf_counter()
                for _ in backend.generate(prompt, n_predict=1, temperature=0.0, use_native_cache=False,
                                          report=EngineReport()):
                    pass
                return (time.perf_counter() - started) * 1000

            cold_ms(0)   # untimed: the first large prefill after a start allocates its buffers
            times: dict[int, list[float]] = {chunked: [], 0: []}
            for i in range(repeats):
                for step in ((chunked, 0) if i % 2 == 0 else (0, chunked)):
                    times[step].append(cold_ms(step))
        finally:
            backend.stop()
    by_chunk, by_piece = statistics.median(times[chunked]), statistics.median(times[0])
    return {"arch": arch, "prompt_tokens": len(prompt.tokens), "chunk_steps_ms": round(by_chunk),
            "batch_pieces_ms": round(by_piece), "ratio": round(by_chunk / by_piece, 3), "repeats": repeats}


def table(rows: list[dict]) -> str:
    lines = ["| architecture | in-process: text = cold | logits bit-equal | fresh process from L2: text = cold "
             "| logits bit-equal | restored (median tokens of prompt) | cold margin min / median |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        a, f = row["in_process"], row["fresh_from_l2"]
        restored = f"{statistics.median(a['matched'][1:] or [0]):.0f} / {statistics.median(row['prompt_tokens']):.0f}"
        lines.append(f"| {row['arch']} | {a['text_equal']}/{a['n']} | {a['logits_equal']}/{a['n']} "
                     f"| {f['text_equal']}/{f['n']} | {f['logits_equal']}/{f['n']} | {restored} "
                     f"| {row['margin_min']} / {row['margin_median']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m kvbridge.bench.probes.zoo_doc_qa", description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS), help="comma-separated zoo architectures")
    parser.add_argument("--questions", type=int, default=12, help="questions on the handbook (at most 12)")
    parser.add_argument("--n-predict", dest="n_predict", type=int, default=32, help="tokens each answer generates")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    parser.add_argument("--step-cost", dest="step_cost", type=int, metavar="REPEATS",
                        help="instead: a cold prefill in chunk steps against llama.cpp's own pieces, REPEATS each")
    parser.add_argument("--child", choices=("warm", "fresh"), help=argparse_hidden())
    parser.add_argument("--model", help=argparse_hidden())
    parser.add_argument("--l2", help=argparse_hidden())
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.model, args.l2, args.questions, args.n_predict)))
        return 0
    if args.step_cost:
        for arch in [a.strip() for a in args.archs.split(",") if a.strip()]:
            print(json.dumps(step_cost(arch, args.step_cost)), flush=True)
        return 0
    rows = []
    for arch in [a.strip() for a in args.archs.split(",") if a.strip()]:
        rows.append(measure(arch, args.questions, args.n_predict))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print(table(rows))
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
