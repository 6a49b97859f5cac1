"""Probe a zoo model in llama.cpp: does it load, what it answers greedily, how clear its choices are, how fast it prefills.

Place in the flow: `zoo make` writes a file -> **probe** loads it in-process (llama-cpp-python) ->
greedy tokens with the top-1 to top-2 logit margin at each step, and optionally a cold prefill
timed. `probe_in_child` runs the same in a child process (`python -m kvbridge.models.probe PATH`),
so a model that crashes llama.cpp fails one call, not the caller; its error is llama.cpp's log tail.

The margin is what makes a zoo model useful to an exactness oracle: with random weights the top two
logits can sit within float noise of each other, and then two exact-enough runs may pick different
tokens. The zoo's head gains are chosen so the median margin is well above that noise.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvbridge.settings.cmdline import Parser

PROMPTS = (
    "The quick brown fox jumps over the lazy dog. Once upon a time",
    "Question: what is the capital of France? Answer:",
    " ".join(f"In chapter {i} the travellers crossed river number {i * 7 % 13}, counted {i * 3} stones "
             f"and wrote a letter to the keeper of the {['north', 'south', 'east', 'west'][i % 4]} gate."
             for i in range(1, 9)),   # ~250 tokens: longer than every test-size sliding window
)
PREFILL_TEXT = " ".join(PROMPTS)


def _llama(path: Path, n_ctx: int, n_threads: int):
    import llama_cpp  # only where a model is probed: the zoo itself needs no llama.cpp

    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=n_threads,
                           n_threads_batch=n_threads, seed=0, verbose=False)


def greedy(llm, prompt: str, n_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens after `prompt` and the top-1 minus top-2 logit at each step."""
    import llama_cpp
    import numpy as np

    llm.reset()
    tokens, margins = [], []
    llm.eval(llm.tokenize(prompt.encode(), add_bos=True))
    for _ in range(n_tokens):
        row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)   # llm.scores holds logits only with logits_all
        logits = np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).astype(np.float64)
        top2 = np.partition(logits, -2)[-2:]
        margins.append(float(top2[1] - top2[0]))
        tokens.append(int(np.argmax(logits)))
        llm.eval([tokens[-1]])
    return tokens, margins


def cold_prefill_s(llm, n_tokens: int) -> float:
    """Seconds to prefill `n_tokens` tokens into an empty cache (the model already loaded)."""
    text_tokens = llm.tokenize(PREFILL_TEXT.encode(), add_bos=False)
    tokens = (text_tokens * (n_tokens // len(text_tokens) + 1))[:n_tokens]
    llm.reset()
    started = time.perf_counter()
    llm.eval(tokens)
    return time.perf_counter() - started


def probe(path: Path, n_tokens: int = 8, n_ctx: int = 1024, prefill: int = 0, n_threads: int = 2) -> dict:
    """Load `path`, answer PROMPTS greedily twice (fresh contexts), and time a cold prefill if asked."""
    runs = []
    for _ in range(2):
        llm = _llama(path, max(n_ctx, prefill + 64), n_threads)
        runs.append([greedy(llm, prompt, n_tokens) for prompt in PROMPTS])
        del llm
    margins = [m for _, step_margins in runs[0] for m in step_margins]
    result = {"tokens": [t for t, _ in runs[0]], "repeat_tokens": [t for t, _ in runs[1]],
              "median_margin": statistics.median(margins), "min_margin": min(margins)}
    if prefill:
        result["prefill_s"] = cold_prefill_s(_llama(path, prefill + 64, n_threads), prefill)
    return result


class ProbeFailed(RuntimeError):
    """llama.cpp would not load or run the model; the message ends with its log."""


def probe_in_child(path: Path, n_tokens: int = 8, prefill: int = 0, timeout_s: float = 600) -> dict:
    """probe() in a child process: a crash in llama.cpp raises ProbeFailed with the child's last log lines."""
    cmd = [sys.executable, "-m", "kvbridge.models.probe", str(path), "--tokens", str(n_tokens), "--prefill", str(prefill)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
        raise ProbeFailed(f"llama.cpp could not run {path} (exit {done.returncode}):\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m kvbridge.models.probe", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--tokens", type=int, default=8, help="greedy tokens per prompt")
    parser.add_argument("--prefill", type=int, default=0, help="also time a cold prefill of this many tokens")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    print(json.dumps(probe(args.path, args.tokens, prefill=args.prefill, n_threads=args.threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
