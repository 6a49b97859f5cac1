"""Blend quality and cost: the curve over recomputed tokens per passage, 2 to 8 passages, and what a shift costs.

    python -m kvbridge.bench.probes.blend_bench                       # 2,4,6,8 passages x 0,4,8,16,32 recomputed, 12 prompts
    python -m kvbridge.bench.probes.blend_bench --passages 4 --recompute 0,16 --prompts 6 --corpus clinic

Place in the flow: the RAG corpus (kvbridge.bench.rag) -> a warm-up that stores every passage ->
per prompt, in one context (the blend runner's, so both sides share every rounding): **cold** (every
token computed: the reference) and **blend** at each recompute count, recomputing each passage's
last tokens (end) or its first (start) -> per row: TTFT, identical
greedy answers, same first token, and the divergence of the first token's distribution from cold's
(KL(cold || blend) and top-1 agreement), and how many answers, cold's and blend's, state the
question's expected fact (the task's own quality). 0 recomputed tokens is a pure position shift, what
llama-server's --cache-reuse does.

--ceiling adds how far recomputing can go: half of every passage, the answering passage whole, and
cold's own KV placed through blend's placement, which must answer as cold token for token (the
placement loses nothing; what blend loses is the passages' stale context).

The restore cost (4 passages, nothing recomputed): placing the stored segments of a prompt (fetch,
assemble, set_data, shift, share) plus the question's decode, whose first step applies the K shift,
against an exact prefix restore of the same cells (one object: fetch, assemble, set_data) plus the
same decode; the question's decode after the exact restore is taken off both, so the ratio is
restore against restore, the shift counted where llama.cpp does it.
"""
from __future__ import annotations

import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from kvbridge.bench.rag import (CORPORA, DEFAULT_CORPUS, DEFAULT_SEED, build_prompts, load_corpus, wants_completion,
                               warmup_prompts)
from kvbridge.bench.common.report import holds_fact, write_result_json
from kvbridge.blend.passages import FoundPassage
from kvbridge.blend.result import BlendResult
from kvbridge.blend.runner import ANSWER, SCRATCH, BlendRunner
from kvbridge.errors import BadSettings
from kvbridge.engine.segments import segment_spans
from kvbridge.formats.llama_chunks import assemble_state, decode_chunk, encode_chunk
from kvbridge.formats.llama_state import parse_state
from kvbridge.settings import Settings
from kvbridge.settings.cmdline import Parser
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
    cold_fact: float          # fraction of cold answers stating the question's expected fact (report.holds_fact)
    fact: float               # the same for blend's answers


def kl_divergence(cold_logits: np.ndarray, blend_logits: np.ndarray) -> float:
    """KL(p_cold || p_blend) in nats, from logits (log-softmax in float64)."""
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        x = x - x.max()
        return x - np.log(np.exp(x).sum())

    lp, lq = log_softmax(cold_logits), log_softmax(blend_logits)
    return float(np.sum(np.exp(lp) * (lp - lq)))


WARM_UPS = ("all", "measured")


def warm_up(engine, runner, corpus: dict, n_passages: int, seed: int, measured: Sequence, how: str = "all") -> None:
    """Store the passages before measuring, each computed in a warm-up prompt (not where it is measured):
    every warm-up prompt ("all", the default), or only those holding a passage of a measured prompt
    ("measured", a quick run's size). A passage is stored by the first warm-up prompt holding it, which
    "measured" keeps, so the measured prompts find the same stored KV either way."""
    prompts = warmup_prompts(corpus, engine.settings.blend_separator, n_passages, seed, wants_completion(engine))
    if how == "measured":
        needed = {pid for prompt in measured for pid in prompt.passage_ids}
        prompts = [prompt for prompt in prompts if needed & set(prompt.passage_ids)]
    for prompt in prompts:
        p = engine.prepare(prompt.request)
        runner.run(p.tokens, p.segments, recompute=0, n_predict=1, store=True)   # prefills only what is not stored


def measure_curve(engine, passages: list[int], recompute: list[int], n_prompts: int, n_predict: int,
                  seed: int = DEFAULT_SEED, progress=print, at: tuple[str, ...] = ("end", "start"),
                  warm: str = "all", corpus_name: str = DEFAULT_CORPUS) -> list[CurveRow]:
    runner = engine._blend_runner()
    corpus = load_corpus(corpus_name)
    sep = engine.settings.blend_separator
    rows: list[CurveRow] = []
    for n_passages in passages:
        prompts = build_prompts(corpus, sep, n_prompts=n_prompts, n_passages=n_passages, seed=seed,
                                completion=wants_completion(engine))
        warm_up(engine, runner, corpus, n_passages, seed, prompts, warm)
        variants = [(r, where) for where in at for r in recompute if r or where == at[0]]   # 0 is one variant
        per_r: dict[tuple[int, str], list] = {v: [] for v in variants}
        colds, cold_facts = [], []
        for index, prompt in enumerate(prompts):
            p = engine.prepare(prompt.request)
            cold = runner.run(p.tokens, p.segments, recompute=0, n_predict=n_predict, reuse=False, store=False)
            colds.append(cold.ttft_ms)
            cold_facts.append(holds_fact(cold.text, prompt.answer))
            for r, where in variants:
                b = runner.run(p.tokens, p.segments, recompute=r, n_predict=n_predict, store=False, recompute_at=where)
                per_r[(r, where)].append((b.ttft_ms, b.tokens == cold.tokens,
                                 bool(b.tokens[:1] == cold.tokens[:1]),
                                 kl_divergence(cold.first_logits, b.first_logits), b.reused_tokens,
                                 holds_fact(b.text, prompt.answer)))
            progress(f"  {n_passages} passages: prompt {index + 1}/{n_prompts}")
        for (r, where), results in per_r.items():
            ttft = statistics.fmean(x[0] for x in results)
            kls = [x[3] for x in results]
            rows.append(CurveRow(n_passages, r, where if r else "-", len(results), statistics.fmean(colds), ttft,
                                 statistics.fmean(colds) / ttft if ttft else 0.0,
                                 sum(x[1] for x in results) / len(results), sum(x[2] for x in results) / len(results),
                                 statistics.fmean(kls), statistics.median(kls),
                                 statistics.fmean(x[4] for x in results), statistics.fmean(cold_facts),
                                 statistics.fmean(x[5] for x in results)))
    return rows


def measure_restore_cost(engine, n_prompts: int, seed: int = DEFAULT_SEED, n_passages: int = 4,
                         warm: str = "all", corpus_name: str = DEFAULT_CORPUS) -> dict:
    """Blended placement (recompute 0) against an exact prefix restore of the same cells, both + the question."""
    runner, store = engine._blend_runner(), engine.store
    ctx = runner.ctx
    corpus = load_corpus(corpus_name)
    sep = engine.settings.blend_separator
    prompts = build_prompts(corpus, sep, n_prompts=n_prompts, n_passages=n_passages, seed=seed,
                            completion=wants_completion(engine))
    warm_up(engine, runner, corpus, n_passages, seed, prompts, warm)
    blend_ms, exact_ms, n_bytes = [], [], []
    for prompt in prompts:
        p = engine.prepare(prompt.request)
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
                        chunk: int = 16, corpus_name: str = DEFAULT_CORPUS) -> dict:
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

        corpus = load_corpus(corpus_name)
        asked = build_prompts(corpus, s.blend_separator, n_prompts=n_prompts + 1, n_passages=n_passages, seed=seed,
                              completion=wants_completion(engine))
        prompts = [engine.prepare(p.request) for p in asked]
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


def relevant_passage(tokens: Sequence[int], spans: Sequence[tuple[int, int]], question: Sequence[int]) -> int:
    """Which passage (index into spans) shares the most rare token ids with the question: each id of the
    question found in a passage counts log(n / df), df the passages of this prompt that hold it (an id in
    every passage counts nothing). A lexical stand-in for a retriever's score: it names the answering
    passage of every RAG prompt here."""
    sets = [set(tokens[a:b]) for a, b in spans]
    def score(i: int) -> float:
        return sum(math.log(len(sets) / sum(t in s for s in sets)) for t in set(question) if t in sets[i])
    return max(range(len(spans)), key=score)


class WholePassageRunner(BlendRunner):
    """Blend with the passages in `whole` recomputed entirely in context, not reused (what keeping the one
    passage that answers exact is worth); everything else as BlendRunner."""

    whole: frozenset[tuple[int, ...]] = frozenset()

    def _fetch(self, passage, instruction, result):
        return None if tuple(passage) in self.whole else super()._fetch(passage, instruction, result)


def place_exact(runner: BlendRunner, tokens: list[int], starts: Sequence[int], cells, n_predict: int) -> BlendResult:
    """Cold's own cells of every passage (`cells`: its parsed state) placed by blend's placement (a scratch
    sequence, seq_cp into the answer) where they were computed, so nothing shifts: the placement alone,
    whose answers must be cold's token for token."""
    ctx, result, t0 = runner.ctx, BlendResult(), time.perf_counter()
    spans = segment_spans(starts, len(tokens))
    ctx.seq_rm(ANSWER)
    ctx.seq_rm(SCRATCH)
    runner._decode(ANSWER, tokens[:spans[1][0]], 0, want_logits=False)
    for a, b in spans[1:-1]:
        view = decode_chunk(encode_chunk(cells, a, b, tokens[a:b]), runner.geometry)
        runner._place(FoundPassage(view, "cold", 0), a, a, 0, b - a, result, ANSWER, SCRATCH)
    q0 = spans[-1][0]
    logits = runner._decode(ANSWER, tokens[q0:], q0, want_logits=True)
    result.first_logits = logits.copy()
    runner._generate(result, logits, len(tokens), n_predict, 0.0, None, None, t0)
    return result


def measure_ceiling(engine, n_prompts: int, n_predict: int, seed: int = DEFAULT_SEED, n_passages: int = 4,
                    warm: str = "all", corpus_name: str = DEFAULT_CORPUS) -> dict:
    """How far recomputing tokens can take blend: against cold, a pure shift, the default, the last half of
    every passage recomputed in context (one run per passage, its tokens seeing each other), the passage that
    answers (relevant_passage) recomputed whole, and cold's own KV placed by blend's placement (the
    mechanics without staleness: every answer must equal cold's). Each row as the curve's, plus whether the
    answers state the question's expected fact."""
    settings = engine.settings
    whole = WholePassageRunner(settings, engine.store, engine.namespace, n_cells=max(settings.ctx_size, 4096))
    runner = engine._blend_runner()
    try:
        corpus = load_corpus(corpus_name)
        sep = settings.blend_separator
        prompts = build_prompts(corpus, sep, n_prompts=n_prompts, n_passages=n_passages, seed=seed,
                                completion=wants_completion(engine))
        warm_up(engine, runner, corpus, n_passages, seed, prompts, warm)
        default = settings.blend_recompute_tokens
        names = ("pure shift", f"default ({default} at each passage's end)", "the last half of every passage",
                 "the passage that answers, whole", "cold's own KV placed by blend (no staleness)")
        rows: dict[str, list] = {name: [] for name in names}
        colds, cold_facts = [], []
        for prompt in prompts:
            p = engine.prepare(prompt.request)
            tokens, starts = [int(t) for t in p.tokens], list(p.segments)
            spans = segment_spans(starts, len(tokens))
            half = min(b - a for a, b in spans[1:-1]) // 2
            cold = runner.run(tokens, starts, recompute=0, n_predict=n_predict, reuse=False, store=False)
            colds.append(cold.ttft_ms)
            cold_facts.append(holds_fact(cold.text, prompt.answer))
            cells = parse_state(runner.ctx.save_seq(ANSWER))
            answering = spans[1:-1][relevant_passage(tokens, spans[1:-1], tokens[spans[-1][0]:])]
            whole.whole = frozenset({tuple(tokens[answering[0]:answering[1]])})
            results = [runner.run(tokens, starts, recompute=0, n_predict=n_predict, store=False),
                       runner.run(tokens, starts, recompute=default, n_predict=n_predict, store=False),
                       runner.run(tokens, starts, recompute=half, n_predict=n_predict, store=False),
                       whole.run(tokens, starts, recompute=default, n_predict=n_predict, store=False),
                       place_exact(runner, tokens, starts, cells, n_predict)]
            for name, b in zip(names, results):
                rows[name].append((b.ttft_ms, b.tokens == cold.tokens, b.tokens[:1] == cold.tokens[:1],
                                   kl_divergence(cold.first_logits, b.first_logits), holds_fact(b.text, prompt.answer)))
    finally:
        whole.close()
    return {"passages": n_passages, "prompts": n_prompts, "cold_ttft_ms": statistics.fmean(colds),
            "cold_fact": statistics.fmean(cold_facts),
            "rows": [{"variant": name, "ttft_ms": statistics.fmean(r[0] for r in rs),
                      "identical": sum(r[1] for r in rs) / len(rs), "same_first_token": sum(r[2] for r in rs) / len(rs),
                      "mean_kl": statistics.fmean(r[3] for r in rs), "fact": sum(r[4] for r in rs) / len(rs)}
                     for name, rs in rows.items()]}


def format_ceiling(ceiling: dict) -> str:
    lines = [f"\nhow far recomputing tokens can go, {ceiling['passages']} passages, {ceiling['prompts']} prompts "
             f"(cold {ceiling['cold_ttft_ms']:.0f} ms, its answers stating the expected fact {ceiling['cold_fact']:.0%}):"]
    for row in ceiling["rows"]:
        lines.append(f"  {row['variant']:46} {row['ttft_ms']:>7.0f} ms  same answer {row['identical']:>4.0%}  "
                     f"same first token {row['same_first_token']:>4.0%}  mean KL {row['mean_kl']:.4f}  "
                     f"expected fact {row['fact']:>4.0%}")
    return "\n".join(lines)


def format_curve(rows: list[CurveRow]) -> str:
    head = (f"{'passages':>8} {'recompute':>9} {'at':>5} {'cold ms':>8} {'blend ms':>8} {'speedup':>7} {'same answer':>11} "
            f"{'same 1st':>8} {'mean KL':>8} {'median KL':>9} {'reused':>6} {'fact: cold':>10} {'blend':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.passages:>8} {r.recompute:>9} {r.at:>5} {r.cold_ttft_ms:>8.1f} {r.blend_ttft_ms:>8.1f} "
                     f"{r.speedup:>6.1f}x {r.identical:>10.0%} {r.same_first_token:>8.0%} {r.mean_kl:>8.4f} "
                     f"{r.median_kl:>9.4f} {r.reused_tokens:>6.0f} {r.cold_fact:>10.0%} {r.fact:>5.0%}")
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
    parser = Parser(prog="python -m kvbridge.bench.probes.blend_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--passages", default="2,4,6,8", help="passages per prompt, comma-separated")
    parser.add_argument("--recompute", default="0,4,8,16,32", help="recomputed tokens per passage, comma-separated")
    parser.add_argument("--prompts", type=int, default=12, help="measured prompts per passage count")
    parser.add_argument("--at", default="end,start", help="which tokens of each passage are recomputed: end, start or both")
    parser.add_argument("--n-predict", type=int, default=16, help="greedy tokens per answer")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--corpus", default=DEFAULT_CORPUS,
                        help=f"the RAG corpus: {', '.join(CORPORA)}, or a path to one of the same schema")
    parser.add_argument("--no-restore-cost", action="store_true", help="skip the restore-cost measurement")
    parser.add_argument("--ceiling", action="store_true",
                        help="also measure how far recompute can go (the largest --passages): the last half of every passage, "
                             "the answering passage whole, and cold's own KV placed by blend (no staleness)")
    parser.add_argument("--cache-reuse", type=int, default=16, metavar="N",
                        help="also run llama-server --cache-reuse N on prompts of --cache-reuse-passages passages (0: skip)")
    parser.add_argument("--cache-reuse-passages", type=int, default=4, metavar="N",
                        help="passages per prompt for the llama-server --cache-reuse comparison")
    parser.add_argument("--warm-up", choices=WARM_UPS, default="all",
                        help="warm up with every passage of the corpus (all), or only with the warm-up prompts "
                             "holding a measured prompt's passage (measured: the same rows, a quicker run)")
    args = parser.parse_args(argv)
    try:
        load_corpus(args.corpus)    # a bad name or file fails before the model loads
    except BadSettings as exc:
        raise SystemExit(f"--corpus: {exc}") from None
    passages, recompute = _ints(args.passages, "passages"), _ints(args.recompute, "recompute")
    if args.cache_reuse_passages < 1:
        raise SystemExit(f"--cache-reuse-passages needs at least 1 passage, got {args.cache_reuse_passages}")
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
            rows = measure_curve(engine, passages, recompute, args.prompts, args.n_predict, args.seed, at=at,
                                 warm=args.warm_up, corpus_name=args.corpus)
            print(format_curve(rows))
            cost = (None if args.no_restore_cost
                    else measure_restore_cost(engine, min(args.prompts, 6), args.seed, warm=args.warm_up,
                                              corpus_name=args.corpus))
            if cost:
                print(f"\nrestore cost, {cost['passages']} passages, nothing recomputed: blended "
                      f"{cost['blend_restore_ms']:.1f} ms against an exact prefix restore of the same cells "
                      f"{cost['exact_restore_ms']:.1f} ms ({cost['restored_mb']:.1f} MB): {cost['ratio']:.2f}x "
                      f"(question decode {cost['question_decode_ms']:.1f} ms taken off both)")
            ceiling = (measure_ceiling(engine, args.prompts, args.n_predict, args.seed, n_passages=max(passages),
                                       warm=args.warm_up, corpus_name=args.corpus) if args.ceiling else None)
            if ceiling:
                print(format_ceiling(ceiling))
            peer = None
            if args.cache_reuse > 0:
                peer = measure_cache_reuse(engine, args.prompts, args.n_predict, args.seed,
                                           n_passages=args.cache_reuse_passages, chunk=args.cache_reuse,
                                           corpus_name=args.corpus)
                if "skipped" in peer:
                    print(f"\nllama-server --cache-reuse: skipped, {peer['skipped']}")
                else:
                    print(f"\nllama-server --cache-reuse {peer['chunk']}, {peer['passages']} passages, {peer['prompts']} "
                          f"prompts (the slot holding the previous prompt): same answer {peer['identical']:.0%}, same "
                          f"first token {peer['same_first_token']:.0%}, {peer['reused_tokens']:.0f} of "
                          f"{peer['prompt_tokens']:.0f} prompt tokens reused, prompt {peer['reuse_prompt_ms']:.0f} ms "
                          f"against {peer['cold_prompt_ms']:.0f} ms cold")
    result = {"command": "blend-bench", "settings": {"passages": passages, "recompute": recompute, "at": at,
                                                     "prompts": args.prompts, "n_predict": args.n_predict,
                                                     "warm_up": args.warm_up, "corpus": args.corpus},
              "curve": [asdict(r) for r in rows], "restore_cost": cost, "ceiling": ceiling,
              "llama_server_cache_reuse": peer}
    path = write_result_json(result, base.output_dir, "blend")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
