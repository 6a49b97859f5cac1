"""Does a sequence's output depend on where its cells lie in llama.cpp's unified KV cache, or on
what else shares its batch?

`python -m kvbridge.bench.probes.layout_probe` decodes the same document question greedily on one
scheduler context (kvbridge.backends.llama_context) and prints whether the answers agree and how
far the logits move against decoding it alone:

- alone: the prompt in one sequence, cells 0..n-1 (the layout a solo cold run has);
- gap: the same prompt prefilled in two parts with another sequence's 15 cells in between;
- shared: the first 312 tokens shared (seq_cp) from a sequence that holds the whole prompt;
- batched: every decode step in one batch with N tokens of another sequence (continuous batching).

Run it with KVB_CACHE_TYPE_K=f32 KVB_CACHE_TYPE_V=f32 to see the layout effect vanish while the
batching effect stays.

No store and no scheduler logic is involved: it isolates llama.cpp's own numerics, which decide
whether the scheduler's answers can equal solo runs token for token (Research.md, §11).
"""
from __future__ import annotations

import numpy as np

from kvbridge.bench.common.scenarios import HANDBOOK_QUESTIONS, builtin_document
from kvbridge.settings import Settings

N_GENERATE = 24
SHARED = 312


def main() -> None:
    from kvbridge.backends.llama_context import LlamaContext

    ctx = LlamaContext(Settings.from_env().replace(l2_enabled=False), 1024, 4)
    doc = builtin_document()
    messages = [{"role": "system", "content": "Answer from the document."},
                {"role": "user", "content": f"Document:\n{doc[:1200]}\n\nQuestion: {HANDBOOK_QUESTIONS[1]}"}]
    tokens = ctx.tokenize(ctx.render(messages))
    filler = ctx.tokenize(doc[5000:6000])[:15]
    n = len(tokens)

    def prefill(seq: int, start: int, stop: int):
        feed = tokens[start:stop]
        ctx.decode([(t, start + i, seq, stop == n and i == len(feed) - 1) for i, t in enumerate(feed)])
        return ctx.logits(len(feed) - 1) if stop == n else None

    def generate(seq: int, logits) -> tuple[list[int], np.ndarray]:
        out, pos, first_step = [], n, None
        for _ in range(N_GENERATE):
            token = int(logits.argmax())
            out.append(token)
            ctx.decode([(token, pos, seq, True)])
            pos += 1
            logits = ctx.logits(0)
            first_step = logits.copy() if first_step is None else first_step
        return out, first_step

    alone, alone_step = generate(0, prefill(0, 0, n))
    ctx.seq_rm(0)
    prefill(0, 0, SHARED)
    ctx.decode([(t, i, 3, False) for i, t in enumerate(filler)])
    gap, gap_step = generate(0, prefill(0, SHARED, n))
    ctx.seq_rm(0)
    ctx.seq_rm(3)
    prefill(1, 0, n)
    ctx.seq_cp(1, 2, SHARED)
    shared, shared_step = generate(2, prefill(2, SHARED, n))
    ctx.seq_rm(1)
    ctx.seq_rm(2)
    other = ctx.tokenize(doc[4000:9000])
    batched = []
    for companions in (1, 8):
        logits = prefill(0, 0, n)
        out, pos, used, last = [], n, 0, None
        for _ in range(N_GENERATE):
            token = int(logits.argmax())
            out.append(token)
            ctx.decode([(token, pos, 0, True)] + [(other[used + j], used + j, 1, False) for j in range(companions)])
            used += companions
            pos += 1
            logits = ctx.logits(0)
            last = logits if last is None else last
        batched.append((f"batch+{companions}", out, last.copy()))
        ctx.seq_rm(0)
        ctx.seq_rm(1)
    ctx.close()
    top = np.sort(alone_step)[-2:]
    print(f"prompt {n} tokens; alone's top-2 logit gap at the first decode step: {top[1] - top[0]:.4f}")
    for name, out, step in (("gap", gap, gap_step), ("shared", shared, shared_step), *batched):
        first = next((i for i, (a, b) in enumerate(zip(alone, out)) if a != b), None)
        print(f"{name:8s} same answer: {out == alone}  first differing token: {first}  "
              f"max |logit change| at the first decode step: {np.abs(step - alone_step).max():.4f}")


if __name__ == "__main__":
    main()
