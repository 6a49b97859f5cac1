"""What a PD hand-off costs, stage by stage, and where PD pays (issue 47, deliverable 5).

    python -m kvbridge.bench.probes.pd_probe                 # stages: warm prefix, 4 trials
    python -m kvbridge.bench.probes.pd_probe --cold          # stages: a cold prompt (the prefill leg computes it)
    python -m kvbridge.bench.probes.pd_probe --decoders 3    # 3 decoders at once on one long (~2k-token) prefix

Place in the flow: beside kvbridge.bench.fleet_bench, whose fleets it starts the same way (its sizing and
settings: exact mode at serve's defaults unless --mode-off), a PD pair (one prefill and one decode worker through
the shared cache server) and a colocated instance, both up, requests alternating between them (which goes first
swaps every trial). Each trial uses a fresh cache_salt, so every trial finds the store as the first did.

Stages, per trial, on a prompt of a document whose first question was asked first (warm) or not (--cold):
- colocated: the streamed request through its router, TTFT.
- PD through its router: the client's TTFT (the router's prefill leg, then its decode leg).
- the same two legs sent by hand to the workers (a fresh salt, warmed the same way): the prefill leg's HTTP
  time and what it says it spent (its kv_transfer_params.kvbridge.timings_ms: queue, first token, finished;
  answered - finished = the wait for its store write and the lookup after it), then the decode leg's TTFT.
  router = PD TTFT - (prefill leg + decode leg TTFT), roughly (the two were not the same request).
Every answer is compared with the colocated instance's own answer to the same question under a fresh salt sent
first and alone on a cold store (the oracle); a differing answer is printed and makes the exit non-zero.
"""
from __future__ import annotations

import contextlib
import json
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvbridge.bench.fleet_bench import FleetRun, fleet_settings, sizing, started
from kvbridge.bench.fleet_workload import QUESTIONS, Question, ask, client, documents, messages
from kvbridge.bench.common.streamed_chat import stream_chat
from kvbridge.settings import Settings
from kvbridge.settings.cmdline import Parser


def post_json(url: str, body: dict, timeout_s: float = 600.0) -> tuple[dict, float]:
    """(the JSON answer, ms) of one POST."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    began = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        answer = json.loads(response.read())
    return answer, (time.perf_counter() - began) * 1e3


def by_hand(pd_fleet, model: str, docs, question: Question, max_tokens: int, salt: str) -> dict:
    """The two legs of one PD request sent by hand, as vllm-router sends them."""
    prefill = next(w for w in pd_fleet.workers if w.role == "prefill")
    decode = next(w for w in pd_fleet.workers if w.role == "decode")
    msgs = messages(docs[question.doc], question.number)
    body = {"model": model, "messages": msgs, "max_tokens": 1, "min_tokens": 1, "stream": False, "temperature": 0,
            "cache_salt": salt, "kv_transfer_params": {"do_remote_decode": True}}
    answer, prefill_ms = post_json(f"{prefill.url}/v1/chat/completions", body)
    params = answer.get("kv_transfer_params") or {}
    decoded = stream_chat(client(decode.url), model, msgs, max_tokens,
                          extra_body={"cache_salt": salt, "kv_transfer_params": params})
    return {"prefill_leg_ms": prefill_ms, "prefill": params.get("kvbridge", {}),
            "decode_ttft_ms": decoded.ttft_ms, "decode_cached": decoded.cached_tokens,
            "decode_prompt": decoded.prompt_tokens, "decode_text": decoded.text, "error": decoded.error}


def stages(settings: Settings, trials: int, cold: bool, max_tokens: int, document_chars: int) -> int:
    docs = documents(1, document_chars)
    size = sizing(settings, docs, max_tokens, 3, len(QUESTIONS))
    model = settings.resolved_model_path().stem
    rows, wrong = [], 0
    with tempfile.TemporaryDirectory(prefix="kvb-pd-probe-") as temp:
        colocated = FleetRun("colocated", "round_robin", 1, True, cells=size.worker_cells)
        pd_run = FleetRun("pd", "round_robin", 2, True, pd=True, cells=size.worker_cells)
        with started(colocated, fleet_settings(settings, size, Path(temp) / "colo", exact=EXACT[0]),
                     policy="round_robin") as colo, \
                started(pd_run, fleet_settings(settings, size, Path(temp) / "pd", scale=2, exact=EXACT[0]),
                        policy="round_robin") as pd:
            sdk = {"colocated": client(colo.url), "pd": client(pd.url)}
            for trial in range(trials):
                question = Question(0, 1 + trial % (len(QUESTIONS) - 1))
                oracle = ask(sdk["colocated"], model, docs, question, max_tokens, cache_salt=_salt())
                salt, hand_salt = _salt(), _salt()
                if not cold:
                    for name in ("colocated", "pd"):
                        ask(sdk[name], model, docs, Question(0, 0), max_tokens, cache_salt=salt)
                    ask(sdk["pd"], model, docs, Question(0, 0), max_tokens, cache_salt=hand_salt)
                    time.sleep(1.0)   # the warm prompts' writes land before the measured requests
                order = ("colocated", "pd") if trial % 2 == 0 else ("pd", "colocated")
                got = {name: ask(sdk[name], model, docs, question, max_tokens, cache_salt=salt) for name in order}
                hand = by_hand(pd, model, docs, question, max_tokens, hand_salt)
                row = {"trial": trial, "colocated_ttft_ms": got["colocated"].ttft_ms, "pd_ttft_ms": got["pd"].ttft_ms,
                       "pd_cached": got["pd"].cached_tokens, "colocated_cached": got["colocated"].cached_tokens,
                       "prompt": got["pd"].prompt_tokens, **{k: v for k, v in hand.items() if k != "decode_text"}}
                rows.append(row)
                for name, text in (("colocated", got["colocated"].text), ("pd", got["pd"].text),
                                   ("pd by hand", hand["decode_text"])):
                    if text != oracle.text:
                        wrong += 1
                        print(f"trial {trial} {name}: {text!r} differs from cold {oracle.text!r}", flush=True)
                t = row["prefill"].get("timings_ms", {})
                print(f"trial {trial}: colocated {row['colocated_ttft_ms']:.0f} ms, PD {row['pd_ttft_ms']:.0f} ms "
                      f"({row['pd_ttft_ms'] / row['colocated_ttft_ms']:.2f}x); by hand: prefill leg "
                      f"{row['prefill_leg_ms']:.0f} ms (queue {t.get('queue')}, first token {t.get('first_token')}, "
                      f"finished {t.get('finished')}), decode leg TTFT {row['decode_ttft_ms']:.0f} ms "
                      f"(cached {row['decode_cached']}/{row['decode_prompt']}); colocated cached "
                      f"{row['colocated_cached']}", flush=True)
    summary(rows)
    return wrong


def summary(rows: list[dict]) -> None:
    def med(key, inner=None):
        values = [r[key][inner] if inner else r[key] for r in rows]
        return statistics.median(v for v in values if v is not None)

    colo, pd = med("colocated_ttft_ms"), med("pd_ttft_ms")
    prefill_leg, decode = med("prefill_leg_ms"), med("decode_ttft_ms")
    timings = [r["prefill"].get("timings_ms", {}) for r in rows]
    first = statistics.median(t.get("first_token", 0) for t in timings)
    finished = statistics.median(t.get("finished", t.get("first_token", 0)) for t in timings)
    print(f"medians of {len(rows)}: colocated TTFT {colo:.0f} ms; PD TTFT {pd:.0f} ms ({pd / colo:.2f}x, "
          f"{statistics.median(r['pd_ttft_ms'] / r['colocated_ttft_ms'] for r in rows):.2f}x per trial)")
    print(f"  prefill leg {prefill_leg:.0f} ms: first token at {first:.0f}, finished at {finished:.0f}, answered "
          f"{prefill_leg - finished:.0f} ms later (its store write and the lookup after it; HTTP)")
    print(f"  decode leg TTFT {decode:.0f} ms; router and the rest {pd - prefill_leg - decode:.0f} ms")


def decoders(settings: Settings, count: int, max_tokens: int, document_chars: int, repeats: int) -> int:
    """`count` requests at once on one long prefix (warm: its first question asked first), PD against colocated
    (one instance, and two instances behind round_robin with the shared cache: PD's worker count)."""
    docs = documents(1, document_chars)
    size = sizing(settings, docs, max_tokens, 3, len(QUESTIONS))
    model = settings.resolved_model_path().stem
    questions = [Question(0, 1 + n % (len(QUESTIONS) - 1)) for n in range(count)]
    results: dict[str, list] = {}
    wrong = 0
    with tempfile.TemporaryDirectory(prefix="kvb-pd-probe-") as temp:
        fleets = {"colocated x1": (1, False, 1), "colocated x2": (2, False, 2), "pd 1+1": (2, True, 2)}
        runs = {name: FleetRun(name, "round_robin", n, True, pd=is_pd, cells=size.worker_cells)
                for name, (n, is_pd, _) in fleets.items()}
        with contextlib.ExitStack() as stack:
            urls = {}
            for name, (n, is_pd, scale) in fleets.items():
                fleet = stack.enter_context(started(runs[name], fleet_settings(
                    settings, size, Path(temp) / name.replace(" ", "-"), scale=scale, exact=EXACT[0]),
                    policy="round_robin"))
                urls[name] = fleet.url
            oracle = {q.key: ask(client(urls["colocated x1"]), model, docs, q, max_tokens, cache_salt=_salt()).text
                      for q in questions}
            for rep in range(repeats):
                order = list(fleets) if rep % 2 == 0 else list(reversed(fleets))
                for name in order:
                    salt = _salt()
                    ask(client(urls[name]), model, docs, Question(0, 0), max_tokens, cache_salt=salt)
                    time.sleep(WRITE_WAIT_S)   # the prefix's write lands (a follow-up sent at once would recompute it)
                    began = time.perf_counter()
                    with ThreadPoolExecutor(count) as pool:
                        answers = list(pool.map(lambda q: ask(client(urls[name]), model, docs, q, max_tokens,
                                                              cache_salt=salt), questions))
                    wall = (time.perf_counter() - began) * 1e3
                    for a in answers:
                        if a.error or a.text != oracle[a.key]:
                            wrong += 1
                            print(f"{name} {a.key}: {a.error or repr(a.text)} differs from cold {oracle[a.key]!r}")
                    tpots = [a.time_per_output_token_ms for a in answers if a.time_per_output_token_ms]
                    cached = [a.cached_tokens for a in answers]
                    results.setdefault(name, []).append({"cached": cached,
                        "mean_ttft_ms": statistics.fmean(a.ttft_ms for a in answers if a.ttft_ms),
                        "max_ttft_ms": max(a.ttft_ms for a in answers if a.ttft_ms),
                        "tpot_ms": statistics.median(tpots) if tpots else None, "wall_ms": wall,
                        "prompt": answers[0].prompt_tokens})
                    r = results[name][-1]
                    print(f"rep {rep} {name}: mean TTFT {r['mean_ttft_ms']:.0f} ms, last first token "
                          f"{r['max_ttft_ms']:.0f} ms, TPOT {r['tpot_ms'] or 0:.1f} ms, all answered "
                          f"{r['wall_ms']:.0f} ms ({r['prompt']} prompt tokens, cached {r['cached']})", flush=True)
    base = results["colocated x1"]
    for name, rs in results.items():
        ratio = {k: statistics.median(r[k] / b[k] for r, b in zip(rs, base) if r[k] and b[k])
                 for k in ("mean_ttft_ms", "max_ttft_ms", "tpot_ms", "wall_ms")}
        print(f"{name} / colocated x1 (median of {len(rs)}): mean TTFT {ratio['mean_ttft_ms']:.2f}x, last first "
              f"token {ratio['max_ttft_ms']:.2f}x, TPOT {ratio['tpot_ms']:.2f}x, wall {ratio['wall_ms']:.2f}x")
    return wrong


EXACT = [True]
WRITE_WAIT_S = 3.0   # --decoders: after warming the prefix, before the requests (as bench-fleet's --think-s)


def _salt() -> str:
    return f"pd-probe-{uuid.uuid4().hex}"


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m kvbridge.bench.probes.pd_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--cold", action="store_true", help="the measured prompt's document was never asked before")
    parser.add_argument("--decoders", type=int, default=0, help="N requests at once on one long prefix (0: stages)")
    parser.add_argument("--document-chars", type=int, default=0,
                        help="characters of the document (default 2400, ~560 tokens; --decoders: 9000, ~2.1k)")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--mode-off", action="store_true", help="f32 K/V, one running sequence, exact mode off "
                                                                "(bench-fleet's PD pair without --exact)")
    parser.add_argument("--no-prove", action="store_true", help="do not prove the workers' cut first (measure "
                                                                "exact mode on its fixed grid of 32 where unproven)")
    args = parser.parse_args(argv)
    EXACT[0] = None if args.mode_off else True
    settings = Settings.from_env()
    if not args.mode_off and not args.no_prove:   # as bench-fleet --exact does: the workers' cut, proven once
        from kvbridge.fleet.fleet import prove_cut

        docs = documents(1, args.document_chars or (9000 if args.decoders else 2400))
        size = sizing(settings, docs, args.max_tokens, 3, len(QUESTIONS))
        with tempfile.TemporaryDirectory(prefix="kvb-pd-probe-") as temp:
            print(f"exact mode's cut for the workers' settings: "
                  f"{prove_cut(fleet_settings(settings, size, Path(temp), exact=True))}", flush=True)
    with contextlib.redirect_stderr(sys.stderr):
        if args.decoders:
            wrong = decoders(settings, args.decoders, args.max_tokens, args.document_chars or 9000, args.trials)
        else:
            wrong = stages(settings, args.trials, args.cold, args.max_tokens, args.document_chars or 2400)
    if wrong:
        print(f"{wrong} answers differ from their cold runs", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
