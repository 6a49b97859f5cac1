"""Blend quality and cost: the curve over recomputed tokens per passage, 2 to 8 passages, and what a shift costs.

    python -m kvbridge.bench.blend_bench                       # 2,4,6,8 passages x 0,4,8,16,32 recomputed, 12 prompts
    python -m kvbridge.bench.blend_bench --passages 4 --recompute 0,16 --prompts 6

Place in the flow: the RAG corpus (kvbridge.bench.rag) -> a warm-up that stores every passage ->
per prompt, in one context (the blend runner's, so both sides share every rounding): **cold** (every
token computed: the reference) and **blend** at each recompute count, recomputing each passage's
last tokens (end) or its first (start) -> per row: TTFT, identical
greedy answers, same first token, and the divergence of the first token's distribution from cold's
(KL(cold || blend) and top-1 agreement). 0 recomputed tokens is a pure position shift, what
llama-server's --cache-reuse does.

The restore cost (4 passages, nothing recomputed): placing the stored segments of a prompt (fetch,
assemble, set_data, shift, share) plus the question's decode, whose first step applies the K shift,
against an exact prefix restore of the same cells (one object: fetch, assemble, set_data) plus the
same decode; the question's decode after the exact restore is taken off both, so the ratio is
restore against restore, the shift counted where llama.cpp does it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvbridge.bench.rag import DEFAULT_SEED, build_prompts, load_corpus, warmup_prompts
from kvbridge.bench.report import write_result_json
from kvbridge.blend.runner import ANSWER
from kvbridge.formats.llama_state import assemble_state, decode_chunk, encode_chunk, parse_state
from kvbridge.settings import Settings
from kvbridge.store.objects import ObjectMeta


@dataclass
class CurveRow:
    passages: int
    recompute: int
    at: str                   # which tokens of each passage were recomputed: end or start
    prompts: int
    cold_ttft_ms: float
    blend_ttft_ms: float
    speedup: float
    identical: float          # fraction of greedy answers equal to cold's, token for token
    same_first_token: float
    mean_kl: float            # KL(cold || blend) of the first generated token's distribution, nats
    median_kl: float
    reused_tokens: float      # mean per prompt


def kl_divergence(cold_logits: np.ndarray, blend_logits: np.ndarray) -> float:
    """KL(p_cold || p_blend) in nats, from logits (log-softmax in float64)."""
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        x = x - x.max()
        return x - np.log(np.exp(x).sum())

    lp, lq = log_softmax(cold_logits), log_softmax(blend_logits)
    return float(np.sum(np.exp(lp) * (lp - lq)))


def measure_curve(engine, passages: list[int], recompute: list[int], n_prompts: int, n_predict: int,
                  seed: int = DEFAULT_SEED, progress=print, at: tuple[str, ...] = ("end", "start")) -> list[CurveRow]:
    runner = engine._blend_runner()
    corpus = load_corpus()
    sep = engine.settings.blend_separator
    rows: list[CurveRow] = []
    for n_passages in passages:
        for prompt in warmup_prompts(corpus, sep, n_passages, seed):
            p = engine.prepare(prompt.messages)
            runner.run(p.tokens, p.segments, recompute=0, n_predict=1, reuse=False, store=True)
        variants = [(r, where) for where in at for r in recompute if r or where == at[0]]   # 0 is one variant
        per_r: dict[tuple[int, str], list] = {v: [] for v in variants}
        colds = []
        for index, prompt in enumerate(build_prompts(corpus, sep, n_prompts=n_prompts, n_passages=n_passages,
                                                     seed=seed)):
            p = engine.prepare(prompt.messages)
            cold = runner.run(p.tokens, p.segments, recompute=0, n_predict=n_predict, reuse=False, store=False)
            colds.append(cold.ttft_ms)
            for r, where in variants:
                b = runner.run(p.tokens, p.segments, recompute=r, n_predict=n_predict, store=False, recompute_at=where)
                per_r[(r, where)].append((b.ttft_ms, b.tokens == cold.tokens,
                                 bool(b.tokens[:1] == cold.tokens[:1]),
                                 kl_divergence(cold.first_logits, b.first_logits), b.reused_tokens))
            progress(f"  {n_passages} passages: prompt {index + 1}/{n_prompts}")
        for (r, where), results in per_r.items():
            ttft = statistics.fmean(x[0] for x in results)
            kls = [x[3] for x in results]
            rows.append(CurveRow(n_passages, r, where if r else "-", len(results), statistics.fmean(colds), ttft,
                                 statistics.fmean(colds) / ttft if ttft else 0.0,
                                 sum(x[1] for x in results) / len(results), sum(x[2] for x in results) / len(results),
                                 statistics.fmean(kls), statistics.median(kls),
                                 statistics.fmean(x[4] for x in results)))
    return rows


def measure_restore_cost(engine, n_prompts: int, seed: int = DEFAULT_SEED, n_passages: int = 4) -> dict:
    """Blended placement (recompute 0) against an exact prefix restore of the same cells, both + the question."""
    runner, store = engine._blend_runner(), engine.store
    ctx = runner.ctx
    corpus = load_corpus()
    sep = engine.settings.blend_separator
    for prompt in warmup_prompts(corpus, sep, n_passages, seed):
        p = engine.prepare(prompt.messages)
        runner.run(p.tokens, p.segments, recompute=0, n_predict=1, reuse=False, store=True)
    blend_ms, exact_ms, n_bytes = [], [], []
    for prompt in build_prompts(corpus, sep, n_prompts=n_prompts, n_passages=n_passages, seed=seed):
        p = engine.prepare(prompt.messages)
        q_start = p.segments[-1]
        question = list(p.tokens[q_start:])
        # the exact prefix of the same cells, as lmcache would restore it: one stored object
        runner.run(p.tokens, p.segments, recompute=0, n_predict=1, reuse=False, store=False)
        parsed = parse_state(ctx.save_seq(ANSWER))
        payload = encode_chunk(parsed, 0, q_start, list(p.tokens[:q_start]))
        key = b"blend-bench-exact-" + bytes(8)
        store.put(key, payload, ObjectMeta(namespace="blend-bench", n_tokens=q_start, tokens_digest=b"x" * 16))
        n_bytes.append(len(payload))
        for _ in range(3):
            ctx.seq_rm(ANSWER)
            t = time.perf_counter()
            obj = store.get(key, namespace="blend-bench")
            view = decode_chunk(obj.blob, runner.geometry)
            ctx.load_seq(ANSWER, assemble_state(runner.geometry, [(view, q_start)], seq_id=ANSWER))
            restored = time.perf_counter()
            runner._decode(ANSWER, question, q_start, want_logits=True)
            done = time.perf_counter()
            exact_ms.append(((restored - t) * 1000, (done - restored) * 1000))
            b = runner.run(p.tokens, p.segments, recompute=0, n_predict=1, store=False)
            blend_ms.append(b.fetch_ms + b.assemble_ms + b.handoff_ms + b.prefill_ms)
    question_ms = statistics.median(x[1] for x in exact_ms)
    exact_restore = statistics.median(x[0] for x in exact_ms)
    blend_restore = statistics.median(blend_ms) - question_ms
    return {"passages": n_passages, "prompts": n_prompts, "exact_restore_ms": exact_restore,
            "blend_restore_ms": blend_restore, "question_decode_ms": question_ms,
            "ratio": blend_restore / exact_restore if exact_restore else None,
            "restored_mb": statistics.median(n_bytes) / 1e6}


def measure_cache_reuse(engine, n_prompts: int, n_predict: int, seed: int = DEFAULT_SEED, n_passages: int = 4,
                        chunk: int = 16) -> dict:
    """llama-server's own answer to the same prompts: `--cache-reuse N` shifts chunks of the slot's previous
    prompt that reappear in the next one, recomputing nothing. Per measured prompt, with the slot holding
    the previous prompt: its answer with cache_prompt (the reuse), then without (the server's cold answer),
    compared as ours are; the same token ids as every other mode."""
    import requests

    from kvbridge.backends.llama_server.process import ServerProcess, built_binary, free_port, pinned_llama_cpp_version

    binary = built_binary(pinned_llama_cpp_version())
    if not binary.is_file():
        return {"skipped": f"{binary} not built (./scripts/build_llama_server.sh)"}
    s = engine.settings
    threads = str(s.resolved_threads())
    args = ["--model", str(engine.backend.model_file()), "--ctx-size", str(s.ctx_size), "--threads", threads,
            "--threads-batch", threads, "--parallel", "1", "--cache-ram", "0", "--flash-attn", "off",
            "--cache-reuse", str(chunk), "--batch-size", "512", "--ubatch-size", "512", "--no-webui", "--no-warmup"]
    server = ServerProcess(binary, args, "127.0.0.1", free_port())
    server.start()
    try:
        server.wait_healthy(s.llama_start_timeout)

        def complete(tokens, cache: bool) -> dict:
            body = {"prompt": list(tokens), "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "stream": False,
                    "cache_prompt": cache, "id_slot": 0, "return_tokens": True}
            resp = requests.post(server.url + "/completion", json=body, timeout=600)
            resp.raise_for_status()
            return resp.json()

        corpus = load_corpus()
        prompts = [engine.prepare(p.messages) for p in build_prompts(corpus, s.blend_separator, n_prompts=n_prompts + 1,
                                                                     n_passages=n_passages, seed=seed)]
        complete(prompts[0].tokens, False)    # the slot holds the prompt before the first measured one
        rows = []
        for p in prompts[1:]:
            reuse, cold = complete(p.tokens, True), complete(p.tokens, False)
            rows.append((reuse["tokens"] == cold["tokens"], reuse["tokens"][:1] == cold["tokens"][:1],
                         reuse["timings"]["prompt_ms"], cold["timings"]["prompt_ms"],
                         int(reuse["timings"].get("cache_n", 0)), len(p.tokens)))
    finally:
        server.stop()
    n = len(rows)
    return {"chunk": chunk, "passages": n_passages, "prompts": n,
            "identical": sum(r[0] for r in rows) / n, "same_first_token": sum(r[1] for r in rows) / n,
            "reuse_prompt_ms": statistics.fmean(r[2] for r in rows), "cold_prompt_ms": statistics.fmean(r[3] for r in rows),
            "reused_tokens": statistics.fmean(r[4] for r in rows), "prompt_tokens": statistics.fmean(r[5] for r in rows)}


CEILING_GROUP = 190   # recomputed tokens per llama_decode, each in a sequence of its own (llama.cpp allows 256)


def recompute_each(runner, tokens: list[int], positions: list[int]) -> None:
    """Recompute the tokens at `positions` of the placed answer sequence in context, CEILING_GROUP per decode.

    llama.cpp takes a sequence's new token only right after its last cell, so each recomputed token goes
    into a sequence of its own that shares the answer's cells before it (seq_cp_range); its new cell then
    replaces the stored one in the answer. Each sees the stored (shifted) cells before it, not the other
    recomputed ones: one layer of CacheBlend's mixing short of a full recompute."""
    ctx = runner.ctx
    for lo in range(0, len(positions), CEILING_GROUP):
        group = positions[lo: lo + CEILING_GROUP]
        for i, pos in enumerate(group):
            ctx.seq_rm(2 + i)
            ctx.seq_cp_range(ANSWER, 2 + i, 0, pos)
        code = ctx.decode([(tokens[pos], pos, 2 + i, False) for i, pos in enumerate(group)])
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code} for {len(group)} recomputed tokens")
        for i, pos in enumerate(group):
            ctx.seq_rm(ANSWER, pos, pos + 1)
            ctx.seq_cp_range(2 + i, ANSWER, pos, pos + 1)
            ctx.seq_rm(2 + i)


def measure_ceiling(engine, n_prompts: int, n_predict: int, seed: int = DEFAULT_SEED, n_passages: int = 4) -> dict:
    """What token-level recompute can reach at most: every token of every passage after the first (the first
    sits where it was computed, so it is exact) recomputed in context, against a pure shift and the default,
    each compared with cold as the curve is. The first token of the answer's distribution gets close to
    cold's (KL); whether whole greedy answers follow is what this row shows."""
    from kvbridge.backends.llama_context import LlamaContext
    from kvbridge.blend.runner import BlendResult, BlendRunner

    settings = engine.settings
    ctx = LlamaContext(settings, max(settings.ctx_size, 4096), CEILING_GROUP + 2)
    runner = BlendRunner(settings, engine.store, engine.namespace, context=ctx)
    try:
        corpus = load_corpus()
        sep = settings.blend_separator
        for prompt in warmup_prompts(corpus, sep, n_passages, seed):
            p = engine.prepare(prompt.messages)
            runner.run(p.tokens, p.segments, recompute=0, n_predict=1, reuse=False, store=True)
        default = settings.blend_recompute_tokens
        names = ("pure shift", f"default ({default} at each passage's end)", "every token of passages 2+")
        rows: dict[str, list] = {name: [] for name in names}
        colds = []
        for prompt in build_prompts(corpus, sep, n_prompts=n_prompts, n_passages=n_passages, seed=seed):
            p = engine.prepare(prompt.messages)
            tokens = [int(t) for t in p.tokens]
            cold = runner.run(tokens, p.segments, recompute=0, n_predict=n_predict, reuse=False, store=False)
            colds.append(cold.ttft_ms)
            for name in names[:2]:
                b = runner.run(tokens, p.segments, recompute=0 if name == names[0] else default,
                               n_predict=n_predict, store=False)
                rows[name].append((b.ttft_ms, b.tokens == cold.tokens, b.tokens[:1] == cold.tokens[:1],
                                   kl_divergence(cold.first_logits, b.first_logits)))
            result = BlendResult()
            t0 = time.perf_counter()
            ctx.seq_rm(ANSWER)
            placement = runner.place(tokens, p.segments, 0, result)
            spans = list(zip(p.segments, list(p.segments[1:]) + [len(tokens)]))[2:-1]
            recompute_each(runner, tokens, [pos for start, end in spans for pos in range(start, end)])
            logits = runner._decode(ANSWER, placement.pending, placement.kv_tokens, want_logits=True)
            first = logits.copy()
            runner._generate(result, logits, len(tokens), n_predict, 0.0, None, None, t0)
            rows[names[2]].append((result.ttft_ms, result.tokens == cold.tokens, result.tokens[:1] == cold.tokens[:1],
                                   kl_divergence(cold.first_logits, first)))
    finally:
        runner.close()
        ctx.close()
    return {"passages": n_passages, "prompts": n_prompts, "cold_ttft_ms": statistics.fmean(colds),
            "rows": [{"variant": name, "ttft_ms": statistics.fmean(r[0] for r in rs),
                      "identical": sum(r[1] for r in rs) / len(rs), "same_first_token": sum(r[2] for r in rs) / len(rs),
                      "mean_kl": statistics.fmean(r[3] for r in rs)} for name, rs in rows.items()]}


def format_ceiling(ceiling: dict) -> str:
    lines = [f"\nhow far recomputing tokens can go, {ceiling['passages']} passages, {ceiling['prompts']} prompts "
             f"(cold {ceiling['cold_ttft_ms']:.0f} ms):"]
    for row in ceiling["rows"]:
        lines.append(f"  {row['variant']:40} {row['ttft_ms']:>7.0f} ms  same answer {row['identical']:>4.0%}  "
                     f"same first token {row['same_first_token']:>4.0%}  mean KL {row['mean_kl']:.4f}")
    return "\n".join(lines)


def format_curve(rows: list[CurveRow]) -> str:
    head = (f"{'passages':>8} {'recompute':>9} {'at':>5} {'cold ms':>8} {'blend ms':>8} {'speedup':>7} {'same answer':>11} "
            f"{'same 1st':>8} {'mean KL':>8} {'median KL':>9} {'reused':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.passages:>8} {r.recompute:>9} {r.at:>5} {r.cold_ttft_ms:>8.1f} {r.blend_ttft_ms:>8.1f} "
                     f"{r.speedup:>6.1f}x {r.identical:>10.0%} {r.same_first_token:>8.0%} {r.mean_kl:>8.4f} "
                     f"{r.median_kl:>9.4f} {r.reused_tokens:>6.0f}")
    return "\n".join(lines)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--{what} takes comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 0:
        raise SystemExit(f"--{what} needs at least one number, none negative")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.bench.blend_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--passages", default="2,4,6,8", help="passages per prompt, comma-separated")
    parser.add_argument("--recompute", default="0,4,8,16,32", help="recomputed tokens per passage, comma-separated")
    parser.add_argument("--prompts", type=int, default=12, help="measured prompts per passage count")
    parser.add_argument("--at", default="end,start", help="which tokens of each passage are recomputed: end, start or both")
    parser.add_argument("--n-predict", type=int, default=16, help="greedy tokens per answer")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--no-restore-cost", action="store_true", help="skip the restore-cost measurement")
    parser.add_argument("--ceiling", action="store_true",
                        help="also recompute every token of the passages after the first (4 passages): the most "
                             "token-level recompute can reach, against a pure shift and the default")
    parser.add_argument("--cache-reuse", type=int, default=16, metavar="N",
                        help="also run llama-server --cache-reuse N on the 4-passage prompts (0: skip)")
    args = parser.parse_args(argv)
    passages, recompute = _ints(args.passages, "passages"), _ints(args.recompute, "recompute")
    at = tuple(a.strip() for a in args.at.split(",") if a.strip())
    if not at or any(a not in ("end", "start") for a in at):
        raise SystemExit(f"--at takes end, start or both (comma-separated), got {args.at!r}")
    from kvbridge.backends.llamacpp import LlamaCppBackend
    from kvbridge.engine.cached_engine import CachedEngine

    base = Settings.from_env()
    problems = base.validate()
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvb-blend-bench-") as l2:
        settings = base.replace(ctx_size=max(base.ctx_size, 4096), l2_dir=l2)
        with CachedEngine(settings, LlamaCppBackend(settings)) as engine:
            print(f"blend bench: {engine.backend.describe()}, {args.prompts} prompts per row", flush=True)
            rows = measure_curve(engine, passages, recompute, args.prompts, args.n_predict, args.seed, at=at)
            print(format_curve(rows))
            cost = None if args.no_restore_cost else measure_restore_cost(engine, min(args.prompts, 6), args.seed)
            if cost:
                print(f"\nrestore cost, {cost['passages']} passages, nothing recomputed: blended "
                      f"{cost['blend_restore_ms']:.1f} ms against an exact prefix restore of the same cells "
                      f"{cost['exact_restore_ms']:.1f} ms ({cost['restored_mb']:.1f} MB): {cost['ratio']:.2f}x "
                      f"(question decode {cost['question_decode_ms']:.1f} ms taken off both)")
            ceiling = measure_ceiling(engine, args.prompts, args.n_predict, args.seed) if args.ceiling else None
            if ceiling:
                print(format_ceiling(ceiling))
            peer = None
            if args.cache_reuse > 0:
                peer = measure_cache_reuse(engine, args.prompts, args.n_predict, args.seed, chunk=args.cache_reuse)
                if "skipped" in peer:
                    print(f"\nllama-server --cache-reuse: skipped, {peer['skipped']}")
                else:
                    print(f"\nllama-server --cache-reuse {peer['chunk']}, {peer['passages']} passages, {peer['prompts']} "
                          f"prompts (the slot holding the previous prompt): same answer {peer['identical']:.0%}, same "
                          f"first token {peer['same_first_token']:.0%}, {peer['reused_tokens']:.0f} of "
                          f"{peer['prompt_tokens']:.0f} prompt tokens reused, prompt {peer['reuse_prompt_ms']:.0f} ms "
                          f"against {peer['cold_prompt_ms']:.0f} ms cold")
    result = {"command": "blend-bench", "settings": {"passages": passages, "recompute": recompute, "at": at,
                                                     "prompts": args.prompts, "n_predict": args.n_predict},
              "curve": [asdict(r) for r in rows], "restore_cost": cost, "ceiling": ceiling,
              "llama_server_cache_reuse": peer}
    path = write_result_json(result, base.output_dir, "blend")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
