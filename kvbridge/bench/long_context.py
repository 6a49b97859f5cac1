"""Long-context bench: how the win grows with the prompt, from ~512 to ~8k tokens (issue 9, section 3).

Place in the flow: `bench --scenario long-context` (or the GUI's scenario list) -> run_scenario ->
**run_long_context** -> CachedEngine.infer per request -> LongContextRecord -> length_rows() -> the
printed table, the curve (kvbridge.gui.charts) and the exports (kvbridge.gui.export).

The prompt at each length is the first N tokens' worth of a manual written for the project
(kvbridge/data/cold_store_manual.md, ~9k tokens) plus a ~15-token question, cut at a token
boundary with the engine's own tokenizer. Per length, modes side by side in one run:

  fill  lmcache, question 0: stores the document prefix (restoring what shorter lengths stored);
  warm  for questions 1..R: native (the engine's own context holds the document), then lmcache
        (restored from our store), then a plain copy of the bytes that restore loaded;
  cold  question 1, once: a full prefill. Its answer is the oracle for lmcache's answer to question 1.

Each warm prompt differs from the one the engine saw last only in its question, so native and
lmcache both prefill the question alone: native is the floor lmcache is compared with.
Left out on purpose: repeated cold runs (an 8k cold prefill costs over a minute on two cores).
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from kvbridge.bench.common.report import fmt, is_warm, median_or_none, plain_copy_ms, ratio
from kvbridge.engine.records import RequestRecord
from kvbridge.errors import BadSettings
from kvbridge.formats.llama_chunks import assembled_size
from kvbridge.settings import Settings

DOCUMENT_PATH = Path(__file__).resolve().parents[1] / "data" / "cold_store_manual.md"
DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192)
DEFAULT_WARM_REPEATS = 3
LONGEST_CONTEXT = 8192      # SmolLM2's trained context: the bench never raises the context beyond it
CONTEXT_STEP = 256
FIT_MARGIN = 8              # tokens: re-tokenising a cut document can move its length by a token or two
SYSTEM = "You answer questions about the document you are given. Answer briefly, using only the document."

# ~15 tokens each; question 0 only fills the store, question 1 is asked in every mode.
QUESTIONS = (
    "What does the controller display when the oxygen level is below 18 percent?",
    "How much room air does the sample pump draw through the line each minute?",
    "Which program number in the manual is meant for Ruddock Pippin apples?",
    "What is the factory protection code before the installer changes it?",
    "Which alarm code means that the sample flow has dropped too low?",
    "How long must a room take to fall from 250 to 125 pascals?",
    "Which relay output is wired to the door interlock of the room?",
    "How often should the diaphragm of the sample pump be replaced?",
)

ProgressFn = Callable[[int, int, str], None]


@dataclass
class LongContextRecord(RequestRecord):
    """A RequestRecord with where it sits in the long-context run, and the copy it was measured against."""

    target_tokens: int = 0
    phase: str = ""                   # "fill", "warm" or "cold"
    question: int = 0                 # index into QUESTIONS
    restored_bytes: int = 0           # bytes of the engine state the restore loaded (lmcache)
    plain_copy_ms: float | None = None  # a plain copy of restored_bytes into a fresh buffer, right after


@dataclass(frozen=True)
class LengthRow:
    """One row of the table: medians of one length's warm requests, and the cold request."""

    target_tokens: int
    prompt_tokens: int
    cold_ttft_ms: float | None
    native_warm_ttft_ms: float | None
    lmcache_warm_ttft_ms: float | None
    warm_requests: int                # per mode
    lmcache_hits: int
    restored_tokens: int
    restored_bytes: int
    restore_ms: float | None          # lookup + fetch + assemble + set (what bench-restore times), median
    plain_copy_ms: float | None       # median plain copy of the same bytes, in the same run
    lmcache_matches_cold: bool | None  # lmcache's answer to question 1 equals the cold answer (greedy)

    @property
    def lmcache_vs_native(self) -> float | None:
        return ratio(self.lmcache_warm_ttft_ms, self.native_warm_ttft_ms)

    @property
    def native_speedup(self) -> float | None:
        return ratio(self.cold_ttft_ms, self.native_warm_ttft_ms)

    @property
    def lmcache_speedup(self) -> float | None:
        return ratio(self.cold_ttft_ms, self.lmcache_warm_ttft_ms)

    @property
    def restore_vs_copy(self) -> float | None:
        return ratio(self.restore_ms, self.plain_copy_ms)

    def to_dict(self) -> dict:
        row = asdict(self)
        row.update(lmcache_vs_native=self.lmcache_vs_native, native_speedup=self.native_speedup,
                   lmcache_speedup=self.lmcache_speedup, restore_vs_copy=self.restore_vs_copy)
        return row


# -- settings and prompts -----------------------------------------------------------------
def parse_lengths(text: str | Sequence[int] | None) -> tuple[int, ...]:
    """"512,1024" -> (512, 1024); None -> the default lengths."""
    if text is None:
        return DEFAULT_LENGTHS
    items = text.split(",") if isinstance(text, str) else list(text)
    try:
        lengths = tuple(sorted({int(str(item).strip()) for item in items if str(item).strip()}))
    except ValueError:
        raise BadSettings(f"Prompt lengths must be whole numbers separated by commas, e.g. 512,1024; got {text!r}.") from None
    if not lengths or lengths[0] < 48:
        raise BadSettings(f"Prompt lengths must be at least 48 tokens (the question and template need ~45); got {text!r}.")
    return lengths


def context_needed(lengths: Sequence[int] | None, n_predict: int) -> int:
    """The context the longest prompt plus its answer needs, capped at what the model was trained for.

    Rounded up to llama.cpp's own granularity of 256 cells (it pads the context to that anyway).
    """
    needed = max(parse_lengths(lengths)) + n_predict + FIT_MARGIN
    return min(LONGEST_CONTEXT, -(-needed // CONTEXT_STEP) * CONTEXT_STEP)


def settings_for(settings: Settings, lengths: Sequence[int] | None, n_predict: int | None = None) -> Settings:
    """`settings` with the context raised to what the run needs (never lowered): no KVB_CTX_SIZE needed."""
    needed = context_needed(lengths, settings.n_predict if n_predict is None else n_predict)
    return settings.replace(ctx_size=needed) if needed > settings.ctx_size else settings


def long_context_document() -> str:
    return DOCUMENT_PATH.read_text(encoding="utf-8")


def _messages(document: str, question: str) -> tuple[dict, ...]:
    return ({"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Document:\n{document}\n\nQuestion: {question}"})


def build_prompts(engine, lengths: Sequence[int], n_questions: int, n_predict: int,
                  document: str | None = None) -> dict[int, list[tuple[dict, ...]]]:
    """target length -> chat messages for questions 0..n_questions-1, the document cut at a token boundary.

    Lengths that do not fit the engine's context are clipped to it (and merged when two clip alike).
    """
    backend = engine.backend
    text = document or long_context_document()
    ids = backend.tokenize(text)
    bos = backend.tokenize("")
    if bos and ids[:len(bos)] == bos:
        ids = ids[len(bos):]
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(n_questions)]
    overhead = max(len(engine.prepare(_messages("", q)).tokens) for q in questions)
    fits = engine.settings.ctx_size - n_predict - FIT_MARGIN
    prompts: dict[int, list[tuple[dict, ...]]] = {}
    for target in lengths:
        target = min(target, fits)
        if target in prompts:
            continue
        keep = target - overhead
        if keep < 1:
            raise BadSettings(f"A {target}-token prompt leaves no room for the document: the question and "
                              f"template take {overhead} tokens. Use longer lengths.")
        part = backend.detokenize(ids[:keep])
        prompts[target] = [_messages(part, q) for q in questions]
    return prompts


# -- the run ------------------------------------------------------------------------------
def run_long_context(engine, modes: Sequence[str], lengths: Sequence[int] | None = None,
                     warm_repeats: int | None = None, n_predict: int | None = None, document: str | None = None,
                     progress: ProgressFn | None = None,
                     stop_event: threading.Event | None = None) -> Iterator[LongContextRecord]:
    """Yield one LongContextRecord per request, length after length (fill, warm pairs, cold)."""
    repeats = warm_repeats or DEFAULT_WARM_REPEATS
    n_predict = engine.settings.n_predict if n_predict is None else n_predict
    engine.start()
    prompts = build_prompts(engine, parse_lengths(lengths), repeats + 1, n_predict, document)
    fill_mode = "lmcache" if "lmcache" in modes else ("native" if "native" in modes else None)
    warm_modes = [m for m in ("native", "lmcache") if m in modes]
    steps = []   # (target, phase, mode, question)
    for target in prompts:
        if fill_mode:
            steps.append((target, "fill", fill_mode, 0))
        steps += [(target, "warm", mode, q) for q in range(1, repeats + 1) for mode in warm_modes]
        if "cold" in modes:
            steps.append((target, "cold", "cold", 1))
    engine.reset_native_cache()
    copy_source: np.ndarray | None = None
    for done, (target, phase, mode, question) in enumerate(steps):
        if stop_event is not None and stop_event.is_set():
            return
        what = f"{target} tokens: {phase} {mode}"
        if progress is not None:
            progress(done, len(steps), what)
        record = engine.infer(list(prompts[target][question]), mode=mode, n_predict=n_predict,
                              scenario="long-context", label=f"{what} (Q{question})",
                              request_index=list(prompts).index(target) + 1)
        extra = LongContextRecord(**record.to_dict(), target_tokens=target, phase=phase, question=question)
        if phase == "warm" and mode == "lmcache" and record.matched_tokens and engine.geometry is not None:
            extra.restored_bytes = assembled_size(engine.geometry, record.matched_tokens)
            if copy_source is None or len(copy_source) < extra.restored_bytes:
                copy_source = np.ones(extra.restored_bytes, dtype=np.uint8)   # touched once, outside the timing
            extra.plain_copy_ms = plain_copy_ms(copy_source[:extra.restored_bytes])
        yield extra
    if progress is not None:
        progress(len(steps), len(steps), "done")


# -- the report ---------------------------------------------------------------------------
def length_rows(records: Sequence[RequestRecord]) -> list[LengthRow]:
    """The table, from the records of one run (other records are ignored); failed requests are left out."""
    mine = [r for r in records if isinstance(r, LongContextRecord) and not r.error]
    rows = []
    for target in sorted({r.target_tokens for r in mine}):
        at = [r for r in mine if r.target_tokens == target]
        cold = [r for r in at if r.phase == "cold"]
        native = [r for r in at if r.phase == "warm" and r.mode == "native" and is_warm(r)]
        lmcache = [r for r in at if r.phase == "warm" and r.mode == "lmcache"]
        hits = [r for r in lmcache if r.matched_tokens]
        copies = [r for r in hits if r.plain_copy_ms is not None]
        oracle = [r for r in hits if r.question == 1]
        prompt_tokens = (cold or lmcache or native or at)[0].prompt_tokens
        rows.append(LengthRow(
            target_tokens=target,
            prompt_tokens=prompt_tokens,
            cold_ttft_ms=median_or_none([r.ttft_ms for r in cold]),
            native_warm_ttft_ms=median_or_none([r.ttft_ms for r in native]),
            lmcache_warm_ttft_ms=median_or_none([r.ttft_ms for r in hits]),
            warm_requests=max(len(lmcache), len([r for r in at if r.phase == "warm" and r.mode == "native"])),
            lmcache_hits=len(hits),
            restored_tokens=int(median_or_none([r.matched_tokens for r in hits]) or 0),
            restored_bytes=int(median_or_none([r.restored_bytes for r in copies]) or 0),
            restore_ms=median_or_none([r.lookup_ms + r.fetch_ms + r.restore_ms for r in hits]),
            plain_copy_ms=median_or_none([r.plain_copy_ms for r in copies]),
            lmcache_matches_cold=(oracle[0].text == cold[0].text) if oracle and cold else None,
        ))
    return rows


def format_rows(rows: Sequence[LengthRow]) -> str:
    """The table the CLI prints (and Docs/Research.md shows)."""
    head = (f"{'tokens':>6} {'cold ms':>9} {'native ms':>9} {'lmcache ms':>10} {'lm/nat':>6} {'cold/nat':>8} "
            f"{'cold/lm':>7} {'hits':>5} {'restored':>8} {'MB':>6} {'restore ms':>10} {'copy ms':>7} "
            f"{'rst/copy':>8}  oracle")
    lines = ["", "long context: per prompt length (warm: medians; restore = lookup+fetch+assemble+set; "
                 "copy = plain memory copy of the same bytes into a fresh buffer, right after each restore)",
             head, "-" * len(head)]
    for r in rows:
        oracle = {True: "lmcache == cold", False: "DIFFERS", None: "-"}[r.lmcache_matches_cold]
        lines.append(
            f"{r.prompt_tokens:>6} {fmt(r.cold_ttft_ms, ',.0f'):>9} {fmt(r.native_warm_ttft_ms, '.1f'):>9} "
            f"{fmt(r.lmcache_warm_ttft_ms, '.1f'):>10} {fmt(r.lmcache_vs_native, '.2f'):>6} "
            f"{fmt(r.native_speedup, '.0f'):>8} {fmt(r.lmcache_speedup, '.0f'):>7} "
            f"{r.lmcache_hits:>2}/{r.warm_requests:<2} {r.restored_tokens:>8} {r.restored_bytes / 1e6:>6.1f} "
            f"{fmt(r.restore_ms, '.1f'):>10} {fmt(r.plain_copy_ms, '.1f'):>7} {fmt(r.restore_vs_copy, '.2f'):>8}  {oracle}")
    return "\n".join(lines)
