"""The miss oracle between tenants (issue 46): does what `serve` says of a miss tell one tenant whether another
holds the prompt? Measured as tenant_timing measures TTFT: a ROC AUC over documents held against documents not.

`python -m kvbridge.bench.probes.miss_oracle` starts `serve` with a tenants file of two: alice, who holds, and
bob, who probes. Of N documents of one shape (tenant_timing.make_documents) alice asks half, drawn at random.
Then bob asks every document once, in a seeded random order, each as a streamed chat request of one token
under a `cache_salt` of its own (a tenant may send one; it keeps bob's probes from sharing resident cells with
each other, so each probe is a first miss of its own namespace: the case where the explainer used to look
the prompt up under the other namespaces the store holds, alice's among them). Of each answer bob keeps what a
client can read: the response headers and the usage's `kvbridge` object (its text), and the TTFT he timed.

Two AUCs, each the probability a held document's probe scores above a free one's (ties half):
- text: the score of an answer is the share of held documents among all probes whose answer reads the same
  (every number as '#'; the Date header and the excerpt of bob's own prompt that a `diverged` detail quotes
  left out). It is what an attacker who knew the labels could do with the text at best: one reading for all
  is exactly 0.5, a reading that differs by holder is 1.0.
- ttft: -TTFT, as tenant_timing's; beside it the same AUC of TTFT less what the prompt's length explains (a
  least-squares line of TTFT on prompt tokens over all probes): the halves are drawn at random, but with seed 7
  and 160 documents the held half happens to be shorter (a held prompt is the shorter of a pair 57 % of the
  time), which alone moves the raw AUC above 0.5 when TTFT grows with length.
The target is at most 0.55 for each; the figures go to Docs/Research.md. tests/test_tenant_timing.py runs it
small. Left out: an attacker that is not a tenant of this server, and the operator's view (which names the
true cause on purpose).
"""
from __future__ import annotations

import json
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvbridge.bench.common.private_serve import OurServe, require_openai_sdk
from kvbridge.bench.probes.tenant_timing import CHUNK_TOKENS, auc_standard_error, key_digest, make_documents, \
    messages_for, roc_auc
from kvbridge.settings import Settings
from kvbridge.settings.cmdline import Parser

KEYS = {"alice": "oracle-key-alice", "bob": "oracle-key-bob"}
UNREAD_HEADERS = ("date",)   # differs on every answer whoever holds what


def reading(headers: dict[str, str], kvbridge: dict) -> str:
    """What one answer says beside its numbers and bob's own words: headers and usage.kvbridge as one text."""
    shown = {"headers": {k.lower(): v for k, v in sorted(headers.items()) if k.lower() not in UNREAD_HEADERS},
             "kvbridge": kvbridge}
    text = json.dumps(shown, sort_keys=True, ensure_ascii=False)
    text = re.sub(r"…[^…]*…", "…", text)        # a divergence quotes bob's own prompt: his, not news
    return re.sub(r"[0-9]+(\.[0-9]+)?", "#", text)


def text_auc(held: list[str], free: list[str]) -> float:
    """The best an attacker can do with the readings: each scored by the share of held documents among the probes
    that read the same (in-sample, so an upper bound), then the ROC AUC of that score."""
    share = {text: held.count(text) / (held.count(text) + free.count(text)) for text in set(held) | set(free)}
    # roc_auc ranks low scores first (it reads TTFTs): negate
    return roc_auc([-share[t] for t in held], [-share[t] for t in free])


@dataclass
class Answers:
    held_texts: list[str] = field(default_factory=list)
    free_texts: list[str] = field(default_factory=list)
    held_ttft: list[float] = field(default_factory=list)
    free_ttft: list[float] = field(default_factory=list)
    reused_held: list[int] = field(default_factory=list)
    held_tokens: list[int] = field(default_factory=list)
    free_tokens: list[int] = field(default_factory=list)

    def figures(self) -> dict:
        text = text_auc(self.held_texts, self.free_texts)
        ttft = roc_auc(self.held_ttft, self.free_ttft)
        held_rest, free_rest = length_residuals(self.held_ttft + self.free_ttft, self.held_tokens + self.free_tokens,
                                                len(self.held_ttft))
        adjusted = roc_auc(held_rest, free_rest)
        n_held, n_free = len(self.held_ttft), len(self.free_ttft)
        readings = sorted(set(self.held_texts) | set(self.free_texts))
        return {"text_auc": round(text, 3), "text_auc_se": round(auc_standard_error(text, n_held, n_free), 3),
                "ttft_auc": round(ttft, 3), "ttft_auc_se": round(auc_standard_error(ttft, n_held, n_free), 3),
                "ttft_auc_length_adjusted": round(adjusted, 3),
                "mean_tokens_held": round(statistics.fmean(self.held_tokens or [0]), 1),
                "mean_tokens_free": round(statistics.fmean(self.free_tokens or [0]), 1),
                "probes": n_held + n_free, "readings": len(readings), "examples": readings[:4],
                "median_held_ms": round(statistics.median(self.held_ttft), 1),
                "median_free_ms": round(statistics.median(self.free_ttft), 1),
                "reused_held_max": max(self.reused_held, default=0)}


def length_residuals(ttft: list[float], tokens: list[int], n_held: int) -> tuple[list[float], list[float]]:
    """TTFT less a least-squares line on prompt tokens (fitted over every probe), split back into the held
    (the first n_held) and the free."""
    mean_x, mean_y = statistics.fmean(tokens), statistics.fmean(ttft)
    var = sum((x - mean_x) ** 2 for x in tokens)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(tokens, ttft)) / var if var else 0.0
    rest = [y - mean_y - slope * (x - mean_x) for x, y in zip(tokens, ttft)]
    return rest[:n_held], rest[n_held:]


def ask(client, doc: str, salt: str) -> tuple[float, dict[str, str], dict, int, int]:
    """(client TTFT ms, response headers, usage.kvbridge, cached_tokens, prompt_tokens) of one streamed request
    of one token."""
    started = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model="x", messages=messages_for(doc), temperature=0, max_tokens=1, stream=True,
        stream_options={"include_usage": True}, extra_body={"cache_salt": salt} if salt else None)
    first, kvbridge, cached, prompt = None, {}, 0, 0
    for chunk in raw.parse():
        if first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
            kvbridge = usage.get("kvbridge") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            prompt = usage.get("prompt_tokens") or 0
    return ((first or time.perf_counter()) - started) * 1e3, dict(raw.headers), kvbridge, cached, prompt


def run_miss_oracle(settings: Settings, documents: int = 80, words: int = 40, seed: int = 7) -> dict:
    """{"bob": Answers.figures(), "setup": ...}."""
    require_openai_sdk()
    import openai

    docs = make_documents(documents, words, seed)
    rng = random.Random(seed + 1)
    held = set(rng.sample(range(len(docs)), len(docs) // 2))
    with tempfile.TemporaryDirectory(prefix="kvb-miss-oracle-") as tmp:
        tenants = Path(tmp) / "tenants.json"
        tenants.write_text(json.dumps({"tenants": [{"name": who, "key_sha256": key_digest(key)}
                                                   for who, key in KEYS.items()]}))
        serve = OurServe(settings.replace(serve_tenants_file=str(tenants), l2_dir=str(Path(tmp) / "l2"),
                                          serve_engine="scheduler", serve_api_key_env="", serve_api_key_file="",
                                          serve_admin_key_env="", explain_misses=True,
                                          sched_max_running=1, chunk_size=CHUNK_TOKENS), Path(tmp) / "serve.log")
        serve.start()
        try:
            clients = {who: openai.OpenAI(base_url=serve.url + "/v1", api_key=key, max_retries=0, timeout=300)
                       for who, key in KEYS.items()}
            for i in sorted(held):
                ask(clients["alice"], docs[i], "")
            time.sleep(1.0)   # alice's KV is stored behind her answers: let that settle first
            order = list(range(len(docs)))
            random.Random(seed + 2).shuffle(order)
            answers = Answers()
            for n, i in enumerate(order):
                ttft, headers, kvbridge, cached, prompt = ask(clients["bob"], docs[i], f"probe-{seed}-{n}")
                text = reading(headers, kvbridge)
                if i in held:
                    answers.held_texts.append(text)
                    answers.held_ttft.append(ttft)
                    answers.held_tokens.append(prompt)
                    answers.reused_held.append(cached)
                else:
                    answers.free_texts.append(text)
                    answers.free_ttft.append(ttft)
                    answers.free_tokens.append(prompt)
        finally:
            serve.stop()
    return {"bob": answers.figures(), "setup": {"documents": len(docs), "words": words, "seed": seed,
                                                "held": len(held)}}


def format_report(result: dict) -> str:
    f = result["bob"]
    return "\n".join([
        "| prober | probes | distinct readings | text ROC AUC (± SE) | TTFT ROC AUC (± SE) | the same, length "
        "adjusted | median TTFT held / free | mean prompt tokens held / free | most tokens reused, held half |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| bob (another tenant) | {f['probes']} | {f['readings']} | {f['text_auc']:.3f} ± {f['text_auc_se']:.3f} | "
        f"{f['ttft_auc']:.3f} ± {f['ttft_auc_se']:.3f} | {f['ttft_auc_length_adjusted']:.3f} | "
        f"{f['median_held_ms']:.1f} / {f['median_free_ms']:.1f} ms | {f['mean_tokens_held']:.1f} / "
        f"{f['mean_tokens_free']:.1f} | {f['reused_held_max']} |"])


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m kvbridge.bench.probes.miss_oracle", description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=80, help="documents probed (half held by alice)")
    parser.add_argument("--words", type=int, default=40, help="words per document")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    if args.documents < 4 or args.words < 8:
        parser.error("--documents must be at least 4 and --words at least 8")
    result = run_miss_oracle(Settings.from_env(), args.documents, args.words, args.seed)
    print(format_report(result))
    print(json.dumps(result, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
