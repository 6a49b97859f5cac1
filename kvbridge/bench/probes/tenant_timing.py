"""The timing side channel between tenants, measured as the literature measures it (vLLM's CVE-2025-46570).

`python -m kvbridge.bench.probes.tenant_timing` starts `serve` with a tenants file: a victim, an attacker (a
tenant of its own) and an insider (in the victim's cache group, where reuse is on purpose: the control
that shows what a leaking cache looks like). It makes N documents of one shape and length (seeded
random words, no two opening with the same four) and draws half of them, at random, as
"cached": the victim asks each of those once. Then the attacker probes every document once, in a
seeded random order, and the insider does the same; a probe is a streamed chat request with
max_tokens 1, timed by the client from the call to the first chunk (TTFT). Before its probes each
prober asks one document of neither half, so its own cache holds the chat template's head either way.
The bench's serve runs the caller's settings except: a private L2, one running sequence (the probes
are sequential), and chunks of CHUNK_TOKENS (the documents are short; with the default 256 a whole
document would be a tail, found only while its prefix stays resident, and the insider would see
nothing to reuse either).

The attacker guesses "cached" when a probe is fast. How well that separates the halves is the ROC
AUC of -TTFT: the probability that a cached document's probe is faster than an uncached one's (ties
count half; the Mann-Whitney statistic), with its standard error (Hanley and McNeil); 0.5 is chance,
1.0 (or 0.0) a perfect guess. Beside it, the two-sample Kolmogorov-Smirnov D and its asymptotic
p-value. The target is an attacker AUC of at most 0.55; the figures go to Docs/Research.md §17.
tests/test_tenant_timing.py runs it with few probes. Left out: concurrent victims (the probe would
then also time the victim's batch), and any attacker that is not a tenant of this server.
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvbridge.bench.common.private_serve import OurServe, require_openai_sdk
from kvbridge.settings import Settings
from kvbridge.settings.cmdline import Parser

CHUNK_TOKENS = 32   # KVB_CHUNK_SIZE of the bench's serve: short documents are stored as whole chunks, not a tail
KEYS = {"victim": "timing-key-victim", "attacker": "timing-key-attacker", "insider": "timing-key-insider"}
WORDS = ("amber", "basalt", "cedar", "delta", "ember", "fjord", "granite", "harbor", "indigo", "juniper", "kelp",
         "lagoon", "meadow", "nickel", "orchid", "pewter", "quartz", "russet", "saffron", "tundra", "umber",
         "violet", "willow", "xenon", "yarrow", "zinc", "canal", "ledger", "mill", "quarry", "signal", "vault")


def key_digest(key: str) -> str:
    """What the tenants file holds for a key (the bench layer runs serve as a process and does not import it)."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class Probes:
    """One prober's TTFTs (ms), per half."""

    cached: list[float] = field(default_factory=list)
    uncached: list[float] = field(default_factory=list)
    reused_cached: list[int] = field(default_factory=list)     # cached_tokens serve reported, cached half
    reused_uncached: list[int] = field(default_factory=list)   # ... and uncached half (the prober's own head)
    prompt_tokens: list[int] = field(default_factory=list)

    def figures(self) -> dict:
        auc = roc_auc(self.cached, self.uncached)
        d, p = ks_test(self.cached, self.uncached)
        return {"auc": round(auc, 3), "auc_se": round(auc_standard_error(auc, len(self.cached), len(self.uncached)), 3),
                "ks_d": round(d, 3), "ks_p": round(p, 4), "probes": len(self.cached) + len(self.uncached),
                "median_cached_ms": round(statistics.median(self.cached), 1),
                "median_uncached_ms": round(statistics.median(self.uncached), 1),
                "reused_cached_max": max(self.reused_cached, default=0),
                "reused_uncached_max": max(self.reused_uncached, default=0),
                "prompt_tokens_min": min(self.prompt_tokens, default=0)}


# -- the statistics -----------------------------------------------------------------------------------
def roc_auc(cached: list[float], uncached: list[float]) -> float:
    """P(a cached probe is faster than an uncached one), ties half: the AUC of the score -TTFT."""
    wins = sum(1.0 if c < u else 0.5 if c == u else 0.0 for c in cached for u in uncached)
    return wins / (len(cached) * len(uncached))


def auc_standard_error(auc: float, n_pos: int, n_neg: int) -> float:
    """Hanley and McNeil (1982): the standard error of an AUC from n_pos and n_neg samples."""
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    var = (auc * (1 - auc) + (n_pos - 1) * (q1 - auc * auc) + (n_neg - 1) * (q2 - auc * auc)) / (n_pos * n_neg)
    return math.sqrt(max(var, 0.0))


def ks_test(a: list[float], b: list[float]) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov: D (the largest gap between the empirical CDFs) and its asymptotic
    p-value (Kolmogorov's series with Stephens' small-sample correction)."""
    xs = sorted(set(a) | set(b))
    sa, sb = sorted(a), sorted(b)
    d, ia, ib = 0.0, 0, 0
    for x in xs:
        while ia < len(sa) and sa[ia] <= x:
            ia += 1
        while ib < len(sb) and sb[ib] <= x:
            ib += 1
        d = max(d, abs(ia / len(sa) - ib / len(sb)))
    n = len(a) * len(b) / (len(a) + len(b))
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    if lam < 1e-3:
        return d, 1.0
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, min(1.0, max(0.0, p))


# -- the run ------------------------------------------------------------------------------------------
def make_documents(n: int, words: int, seed: int) -> list[str]:
    """n documents of `words` words each, seeded, each opening with a word sequence of its own."""
    rng = random.Random(seed)
    docs, openings = [], set()
    while len(docs) < n:
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        opening = tuple(text.split()[:4])
        if opening not in openings:
            openings.add(opening)
            docs.append(text.capitalize() + ".")
    return docs


def messages_for(doc: str) -> list[dict]:
    return [{"role": "user", "content": f"Notes: {doc}\n\nQuestion: Which word comes first?"}]


def probe(client, doc: str) -> tuple[float, int, int]:
    """(client TTFT ms: the call to the first chunk, cached_tokens, prompt_tokens) of one streamed
    request of one token."""
    started = time.perf_counter()
    first, cached, prompt = None, 0, 0
    for chunk in client.chat.completions.create(model="x", messages=messages_for(doc), temperature=0, max_tokens=1,
                                                stream=True, stream_options={"include_usage": True}):
        if first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            prompt = chunk.usage.prompt_tokens
            if chunk.usage.prompt_tokens_details is not None:
                cached = chunk.usage.prompt_tokens_details.cached_tokens
    return ((first or time.perf_counter()) - started) * 1e3, cached, prompt


def run_tenant_timing(settings: Settings, documents: int = 80, words: int = 60, seed: int = 7) -> dict:
    """{"attacker": figures, "insider": figures, "setup": ...}; figures as Probes.figures()."""
    require_openai_sdk()
    import openai

    docs = make_documents(documents + 2, words, seed)
    warmups, docs = docs[:2], docs[2:]
    rng = random.Random(seed + 1)
    cached = set(rng.sample(range(len(docs)), len(docs) // 2))
    with tempfile.TemporaryDirectory(prefix="kvb-tenant-timing-") as tmp:
        tenants = Path(tmp) / "tenants.json"
        tenants.write_text(json.dumps({"tenants": [
            {"name": "victim", "key_sha256": key_digest(KEYS["victim"])},
            {"name": "attacker", "key_sha256": key_digest(KEYS["attacker"])},
            {"name": "insider", "key_sha256": key_digest(KEYS["insider"]), "cache_group": "victim"}]}))
        serve = OurServe(settings.replace(serve_tenants_file=str(tenants), l2_dir=str(Path(tmp) / "l2"),
                                          serve_engine="scheduler", serve_api_key_env="", serve_api_key_file="",
                                          serve_admin_key_env="",
                                          sched_max_running=1, chunk_size=CHUNK_TOKENS), Path(tmp) / "serve.log")
        serve.start()
        try:
            clients = {who: openai.OpenAI(base_url=serve.url + "/v1", api_key=key, max_retries=0, timeout=300)
                       for who, key in KEYS.items()}
            for i in sorted(cached):
                probe(clients["victim"], docs[i])
            time.sleep(1.0)   # the victim's KV is stored behind its answers: let that settle first
            results = {}
            for prober, warmup in (("attacker", warmups[0]), ("insider", warmups[1])):
                probe(clients[prober], warmup)
                order = list(range(len(docs)))
                random.Random(seed + 2).shuffle(order)
                probes = Probes()
                for i in order:
                    ttft, reused, prompt = probe(clients[prober], docs[i])
                    probes.prompt_tokens.append(prompt)
                    if i in cached:
                        probes.cached.append(ttft)
                        probes.reused_cached.append(reused)
                    else:
                        probes.uncached.append(ttft)
                        probes.reused_uncached.append(reused)
                results[prober] = probes.figures()
        finally:
            serve.stop()
    results["setup"] = {"documents": len(docs), "words": words, "seed": seed, "cached": len(cached)}
    return results


def format_report(result: dict) -> str:
    lines = ["| prober | probes | ROC AUC (± SE) | KS D | KS p | median TTFT cached / uncached | most tokens reused, "
             "cached / uncached half (of at least N prompt tokens) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for who, label in (("attacker", "attacker (another tenant)"), ("insider", "insider (the victim's cache group)")):
        f = result[who]
        lines.append(f"| {label} | {f['probes']} | {f['auc']:.3f} ± {f['auc_se']:.3f} | {f['ks_d']:.3f} | "
                     f"{f['ks_p']:.4f} | {f['median_cached_ms']:.1f} / {f['median_uncached_ms']:.1f} ms | "
                     f"{f['reused_cached_max']} / {f['reused_uncached_max']} (of {f['prompt_tokens_min']}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m kvbridge.bench.probes.tenant_timing", description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=80, help="documents probed (half cached by the victim)")
    parser.add_argument("--words", type=int, default=60, help="words per document")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    if args.documents < 4 or args.words < 8:
        parser.error("--documents must be at least 4 and --words at least 8")
    result = run_tenant_timing(Settings.from_env(), args.documents, args.words, args.seed)
    print(format_report(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
