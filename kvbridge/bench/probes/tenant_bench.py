"""Tenants' TTFTs: what one tenant's cache does for it, and that it does nothing for another tenant.

`python -m kvbridge.bench.probes.tenant_bench` starts `serve` with a tenants file (alice; bob; carol in
alice's cache group) on the embedded model and asks, through the openai SDK, each of N documents:
alice cold, alice again (warm), bob (another tenant: must be cold), carol (alice's group: warm).
It prints the median client TTFTs side by side and the cached-token counts that explain them; the
figures go to Docs/Research.md §14. Tests run it with one small document (tests/test_serve_tenants.py).
"""
from __future__ import annotations

import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvbridge.bench.common.scenarios import builtin_document
from kvbridge.bench.common.private_serve import OurServe, require_openai_sdk
from kvbridge.settings import Settings
from kvbridge.settings.cmdline import Parser

KEYS = {"alice": "bench-key-alice", "bob": "bench-key-bob", "carol": "bench-key-carol"}
def key_digest(key: str) -> str:
    """What the tenants file holds for a key (kvbridge.serve.tenants does the same; the bench layer runs
    serve as a process and does not import it)."""
    return hashlib.sha256(key.encode()).hexdigest()


ORDER = ("alice cold", "alice warm", "bob (other tenant)", "carol (alice's group)")


def run_tenant_bench(settings: Settings, documents: int = 4, doc_chars: int = 4000) -> dict:
    require_openai_sdk()
    import openai

    text = builtin_document()
    docs = [text[i * doc_chars // 2:(i * doc_chars // 2) + doc_chars] for i in range(documents)]
    with tempfile.TemporaryDirectory(prefix="kvb-tenant-bench-") as tmp:
        tenants = Path(tmp) / "tenants.json"
        tenants.write_text(json.dumps({"tenants": [
            {"name": "alice", "key_sha256": key_digest(KEYS["alice"])},
            {"name": "bob", "key_sha256": key_digest(KEYS["bob"])},
            {"name": "carol", "key_sha256": key_digest(KEYS["carol"]), "cache_group": "alice"}]}))
        serve = OurServe(settings.replace(serve_tenants_file=str(tenants), l2_dir=str(Path(tmp) / "l2"),
                                          serve_engine="scheduler"), Path(tmp) / "serve.log")
        serve.start()
        try:
            clients = {who: openai.OpenAI(base_url=serve.url + "/v1", api_key=key, max_retries=0, timeout=300)
                       for who, key in KEYS.items()}
            rows: dict[str, list[tuple[float, int, int]]] = {name: [] for name in ORDER}
            for doc in docs:
                messages = [{"role": "user", "content": f"Document:\n{doc}\n\nQuestion: What is this about?"}]
                for name, who in zip(ORDER, ("alice", "alice", "bob", "carol")):
                    rows[name].append(_ttft(clients[who], messages))
        finally:
            serve.stop()
    return {name: {"median_ttft_ms": round(statistics.median(t for t, _, _ in r), 1),
                   "cached_tokens": [c for _, c, _ in r], "prompt_tokens": [p for _, _, p in r]}
            for name, r in rows.items()}


def _ttft(client, messages) -> tuple[float, int, int]:
    """(client TTFT ms, cached_tokens, prompt_tokens) of one streamed, greedy request."""
    started = time.perf_counter()
    first = None
    usage = None
    for chunk in client.chat.completions.create(model="x", messages=messages, temperature=0, max_tokens=8,
                                                stream=True, stream_options={"include_usage": True}):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
    first = first or time.perf_counter()
    return (first - started) * 1e3, usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens


def format_report(result: dict) -> str:
    cold = result["alice cold"]["median_ttft_ms"]
    lines = ["| request | median client TTFT | ÷ alice cold | cached tokens / prompt tokens |", "| --- | --- | --- | --- |"]
    for name in ORDER:
        r = result[name]
        cached = ", ".join(f"{c}/{p}" for c, p in zip(r["cached_tokens"], r["prompt_tokens"]))
        lines.append(f"| {name} | {r['median_ttft_ms']:.1f} ms | {r['median_ttft_ms'] / cold:.2f} | {cached} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m kvbridge.bench.probes.tenant_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--doc-chars", type=int, default=4000)
    args = parser.parse_args(argv)
    result = run_tenant_bench(Settings.from_env(), args.documents, args.doc_chars)
    print(format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
