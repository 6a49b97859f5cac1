"""Codecs on Document Q&A KV: what raw, zstd and int8 cost, save and change, each against raw in one run.

Place in the flow: ... store_prompt -> **TierCodec.encode** -> an L2 file or L3 value; a hit in L2 or
L3 -> **TierCodec.decode** -> assemble -> restore. `bench-l3` part (e):

- doc_qa_objects: the chunk and tail objects of one doc-qa prompt, split as the engine stores them;
- codec_throughput: compression ratio, encode and decode MB/s of those objects (raw is a copy);
- codec_restores: a restore (lookup + get_many + assemble) from L2 and from L3 per codec;
- int8_quality: per question, the greedy answer and the first token's logits after a cold prefill,
  after restoring that prompt's KV through int8, and (the control) after restoring it raw.

Deliberately left out: int8 on a quantised cache type (the codec stores those losslessly and says
so) and any threshold; the figures go to Docs/Research.md with the command.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from kvbridge.bench.common.scenarios import build_requests
from kvbridge.bench.store_bench import _paired_median_ms
from kvbridge.engine.chunks import common_prefix_length
from kvbridge.settings import Settings
from kvbridge.store import DiskTier, MemoryTier, TieredStore

CODECS = ("raw", "zstd", "int8")
MB = 1e6


def _kv(engine, store):
    from kvbridge.engine.chunks import ChunkKV

    kv = ChunkKV(store, engine.namespace, getattr(engine.hasher, "seed", b""), engine.settings.chunk_size,
                 engine.geometry)
    kv.hot_restores = False   # each restore reads and decodes its objects: that is what the codecs are timed on
    kv.cold_cut = engine._kv is not None and engine._kv.cold_cut   # and restores what the engine's restores do
    kv.cut_rule = engine.cut_rule
    return kv


def doc_qa_objects(engine, messages) -> tuple[list[int], list[bytes], list[tuple]]:
    """A cold prefill of one doc-qa prompt, split into its chunk and tail objects: (tokens, hashes, objects)."""
    engine.infer(list(messages), mode="cold", n_predict=1)
    tokens = list(engine.prepare(list(messages)).tokens)
    hashes = engine.hasher.chunk_hashes(tokens)
    store = TieredStore([MemoryTier(1 << 40)], namespace=engine.namespace)
    kv = _kv(engine, store)
    try:
        kv.store_prompt(engine.backend.save_state(), tokens, hashes)
        tier = store.tiers[0]
        objects = [(key, *tier.get(key)) for key in tier.keys()]
    finally:
        kv.close()
        store.close()
    return tokens, hashes, objects


def codec_throughput(objects: Sequence[tuple], zstd_level: int = 3, repeats: int = 5) -> dict:
    """Per codec: stored bytes, raw ÷ stored, encode and decode ms of every object (interleaved, medians).

    raw is no work at all (a tier stores the payload as it is), so the yardstick beside the codecs
    is a plain copy of the same objects into fresh memory, timed in the same rounds.
    """
    from kvbridge.store.serde import CodecMeta, CodecOptions, get_codec

    codecs = {name: get_codec(name, CodecOptions(zstd_level=zstd_level)) for name in CODECS}
    raw_bytes = sum(len(blob) for _, blob, _ in objects)
    encoded = {name: [codec.encode(blob, CodecMeta(kind=meta.kind)) for _, blob, meta in objects]
               for name, codec in codecs.items()}

    def copy(_: int) -> list:
        return [bytearray(blob) for _, blob, _ in objects]

    def encode(codec):
        return lambda _: [codec.encode(blob, CodecMeta(kind=meta.kind)) for _, blob, meta in objects]

    def decode(codec, stored):
        return lambda _: [codec.decode(data, CodecMeta(kind=meta.kind)) for data, (_, _, meta) in zip(stored, objects)]

    timed = [name for name in CODECS if name != "raw"]
    encode_ms = _paired_median_ms({"copy": copy, **{name: encode(codecs[name]) for name in timed}}, repeats)
    decode_ms = _paired_median_ms({"copy": copy, **{name: decode(codecs[name], encoded[name]) for name in timed}},
                                  repeats)
    rows = {}
    for name, codec in codecs.items():
        decoded = [codec.decode(data, CodecMeta(kind=meta.kind)) for data, (_, _, meta) in zip(encoded[name], objects)]
        stored = sum(len(data) for data in encoded[name])
        rows[name] = {"stored_bytes": stored, "ratio": raw_bytes / stored,
                      "declined": sum(codec.declined(data) is not None for data in encoded[name]),
                      "round_trip_exact": all(bytes(d) == bytes(blob) for d, (_, blob, _) in zip(decoded, objects))}
        if name in timed:
            rows[name].update({
                "encode_ms": encode_ms[name], "decode_ms": decode_ms[name],
                "encode_mb_s": raw_bytes / MB / (encode_ms[name] / 1e3),
                "decode_mb_s": raw_bytes / MB / (decode_ms[name] / 1e3),
                "encode_vs_copy": encode_ms[name] / encode_ms["copy"], "decode_vs_copy": decode_ms[name] / decode_ms["copy"]})
    copy_ms = statistics.median([encode_ms["copy"], decode_ms["copy"]])
    return {"objects": len(objects), "raw_bytes": raw_bytes, "kinds": sorted({meta.kind for _, _, meta in objects}),
            "copy_ms": copy_ms, "copy_mb_s": raw_bytes / MB / (copy_ms / 1e3), "codecs": rows}


def codec_restores(engine, settings: Settings, url: str, prefix: str, tokens: Sequence[int], hashes: Sequence[bytes],
                   objects: Sequence[tuple], directory: Path, repeats: int = 5) -> dict:
    """A restore (lookup + get_many + assemble) from L2 and from L3, per codec, the same objects in each.

    One store per codec: L1, L2 and L3 (its own key prefix) all writing with that codec. The L2
    rounds run first (L1 emptied before each restore), then the L3 rounds (L1 and L2 emptied, the
    write-behind drained first: an L3 hit is promoted into L2 behind the request). Per round the
    codecs take turns, the order rotating every round; one untimed round first. Medians.
    """
    from kvbridge.store.redis_tier import RedisTier
    from kvbridge.store.serde import TierCodec

    def codec(name: str) -> TierCodec:
        return TierCodec.named(name, settings.zstd_level)

    stores = {name: TieredStore([MemoryTier(settings.l1_bytes), DiskTier(directory / name, settings.l2_bytes, codec=codec(name)),
                                 RedisTier(url, prefix=f"{prefix}-{name}", timeout=settings.l3_timeout, codec=codec(name))],
                                namespace=engine.namespace, write_queue=settings.l3_write_queue)
              for name in CODECS}
    kvs = {name: _kv(engine, store) for name, store in stores.items()}
    times = {tier: {name: [] for name in CODECS} for tier in ("L2", "L3")}
    seen = {tier: {name: set() for name in CODECS} for tier in ("L2", "L3")}
    restored = {}
    try:
        for store in stores.values():
            for key, blob, meta in objects:
                store.put(key, blob, meta)
            store.drain()
        for tier, emptied in (("L2", ("L1",)), ("L3", ("L1", "L2"))):
            for i in range(-1, repeats):
                shift = i % len(CODECS)
                for name in CODECS[shift:] + CODECS[:shift]:
                    store = stores[name]
                    store.drain()
                    for each in emptied:
                        store.clear(each)
                    start = time.perf_counter()
                    plan = kvs[name].plan_restore(tokens, hashes)
                    elapsed = (time.perf_counter() - start) * 1e3
                    if i >= 0:
                        times[tier][name].append(elapsed)
                        seen[tier][name].add(plan.tier)
                    restored[name] = plan.matched_tokens
                    store.drain()
        stats = {name: store.stats() for name, store in stores.items()}
    finally:
        for name, store in stores.items():
            kvs[name].close()
            store.drain()
            store.tiers[2].clear()
            store.close()
    ms = {tier: {name: statistics.median(values) for name, values in rows.items()} for tier, rows in times.items()}
    return {"repeats": repeats, "restored_tokens": restored,
            "ms": ms, "vs_raw": {tier: {name: ms[tier][name] / ms[tier]["raw"] for name in CODECS} for tier in ms},
            "tiers": {tier: {name: sorted(s) for name, s in rows.items()} for tier, rows in seen.items()},
            "l2_bytes": {name: s["tiers"]["L2"]["bytes"] for name, s in stats.items()},
            "behind_dropped": {name: s["behind_dropped"] for name, s in stats.items()}}


def _greedy(llm, tokens: Sequence[int], n_predict: int) -> tuple[list[int], np.ndarray]:
    """Greedy generation as LlamaCppBackend.generate runs it; (token ids, logits for the first of them).

    The first token's logits are read when it is yielded: the last decode was the prompt's, and
    llama.cpp keeps only the last position's output row (logits_all is off).
    """
    import llama_cpp

    from kvbridge.backends.base import Sampling

    sampling = Sampling.for_temperature(0.0)
    vocab = llm._model.vocab
    ids: list[int] = []
    first = None
    for token in llm.generate(list(tokens), temp=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                              min_p=sampling.min_p, repeat_penalty=sampling.repeat_penalty, reset=True):
        if first is None:
            row = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
            first = np.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).astype(np.float32)
        if llama_cpp.llama_vocab_is_eog(vocab, token):
            break
        ids.append(int(token))
        if len(ids) >= n_predict:
            break
    return ids, first


def int8_quality(engine, settings: Settings, directory: Path, questions: int = 12, document: str | None = None,
                 cold_texts: Sequence[str] | None = None) -> dict:
    """Per doc-qa question: cold greedy answer and first-token logits, then the same after restoring the
    prompt's own KV (all but its last token) through int8 (an L2 written int8) and raw (L1: the control).

    Both restores load what the cold prefill just computed, so any difference is the codec's (raw: the
    suffix decoded in a batch of its own, which the oracle says changes no token).
    """
    llm = getattr(engine.backend, "llm", None)
    if llm is None:
        return {"skipped": "logits are read from the in-process llama.cpp engine only"}
    from kvbridge.store.serde import TierCodec

    backend, n_predict = engine.backend, settings.n_predict
    stores = {"int8": TieredStore([DiskTier(directory / "int8-quality", settings.l2_bytes,
                                            codec=TierCodec.named("int8"))], namespace=engine.namespace),
              "raw": TieredStore([MemoryTier(settings.l1_bytes)], namespace=engine.namespace)}
    kvs = {name: _kv(engine, store) for name, store in stores.items()}
    rows = []
    try:
        for i, request in enumerate(build_requests("doc-qa", questions, document)):
            tokens = list(engine.prepare(list(request.messages)).tokens)
            hashes = engine.hasher.chunk_hashes(tokens)
            backend.reset_native_cache()
            cold_ids, cold_logits = _greedy(llm, tokens, n_predict)
            state = backend.save_state()
            for kv in kvs.values():
                kv.store_prompt(state, tokens, hashes)
            row = {"question": i + 1, "cold_tokens": len(cold_ids), "cold_logit_absmax": float(np.abs(cold_logits).max())}
            if cold_texts is not None and i < len(cold_texts):
                row["cold_equals_bench_cold"] = llm.detokenize(cold_ids, special=False).decode("utf-8", "replace") == cold_texts[i]
            for name, kv in kvs.items():
                plan = kv.plan_restore(tokens, hashes, buffer_for=backend.state_buffer)
                backend.restore_state(plan.state, plan.tokens)
                ids, logits = _greedy(llm, tokens, n_predict)
                diff = np.abs(logits - cold_logits)
                row[name] = {"restored_tokens": plan.matched_tokens, "tier": plan.tier, "lossy": sorted(plan.lossy),
                             "tokens": len(ids), "equal_positions": sum(a == b for a, b in zip(cold_ids, ids)),
                             "common_prefix": common_prefix_length(cold_ids, ids), "identical": ids == cold_ids,
                             "max_abs_logit_diff": float(diff.max()), "mean_abs_logit_diff": float(diff.mean()),
                             "same_first_token": int(np.argmax(logits)) == int(np.argmax(cold_logits))}
            rows.append(row)
            backend.reset_native_cache()
    finally:
        for name, store in stores.items():
            kvs[name].close()
            store.close()
    cold_total = sum(row["cold_tokens"] for row in rows)
    summary = {}
    for name in stores:
        summary[name] = {
            "questions": len(rows), "identical": sum(row[name]["identical"] for row in rows),
            "equal_positions_fraction": sum(row[name]["equal_positions"] for row in rows) / max(cold_total, 1),
            "common_prefix_fraction": sum(row[name]["common_prefix"] for row in rows) / max(cold_total, 1),
            "max_abs_logit_diff": max(row[name]["max_abs_logit_diff"] for row in rows),
            "median_max_abs_logit_diff": statistics.median(row[name]["max_abs_logit_diff"] for row in rows),
            "same_first_token": sum(row[name]["same_first_token"] for row in rows)}
    checks = [row["cold_equals_bench_cold"] for row in rows if "cold_equals_bench_cold" in row]
    return {"rows": rows, "summary": summary, "cold_tokens": cold_total,
            "cold_logit_absmax": max(row["cold_logit_absmax"] for row in rows),
            "cold_equals_bench_cold": (sum(checks), len(checks)) if checks else None}


def bench_codecs(engine, settings: Settings, url: str, repeats: int = 5, quality_questions: int = 12,
                 document: str | None = None, cold_texts: Sequence[str] | None = None) -> dict:
    """Part (e) of bench-l3: throughput, restores from L2 and L3, and int8's quality, on doc-qa KV."""
    from kvbridge.store.serde import remember_geometry

    if engine.geometry is not None:
        remember_geometry(engine.geometry)   # CachedEngine registers it at start; int8 finds K and V rows by it
    messages = build_requests("doc-qa", 1, document)[0].messages
    with tempfile.TemporaryDirectory(prefix="kvb-bench-codecs-") as temp:
        tokens, hashes, objects = doc_qa_objects(engine, messages)
        result = {"prompt_tokens": len(tokens), "zstd_level": settings.zstd_level,
                  "throughput": codec_throughput(objects, settings.zstd_level, repeats)}
        result["restores"] = codec_restores(engine, settings, url, f"{settings.l3_prefix}-codec", tokens, hashes,
                                            objects, Path(temp), repeats)
        result["quality"] = (int8_quality(engine, settings, Path(temp), quality_questions, document, cold_texts)
                             if quality_questions else {"skipped": "--quality-questions 0"})
    return result


def format_codecs(result: dict) -> str:
    t, r = result["throughput"], result["restores"]
    lines = [f"(e) codecs on Document Q&A KV: the {t['objects']} objects ({', '.join(t['kinds'])}) of one "
             f"{result['prompt_tokens']}-token prompt, {t['raw_bytes'] / MB:.1f} MB raw; zstd level "
             f"{result['zstd_level']}; medians, interleaved, each against raw in this run "
             f"({r['repeats']} restores per codec and tier)",
             f"  {'codec':6} {'stored MB':>9} {'raw÷stored':>10} {'encode MB/s':>16} {'decode MB/s':>16} "
             f"{'restore L2 (÷raw)':>18} {'restore L3 (÷raw)':>18}  notes",
             f"  {'copy':6} {'':>9} {'':>10} {t['copy_mb_s']:>7,.0f} (  1.0x) {t['copy_mb_s']:>7,.0f} (  1.0x) "
             f"{'':>18} {'':>18}  a plain copy of the objects into fresh memory: the yardstick"]
    for name in CODECS:
        c = t["codecs"][name]
        notes = [] if c["declined"] == 0 else [f"{c['declined']} object(s) stored losslessly"]
        if name != "int8" and not c["round_trip_exact"]:
            notes.append("DECODE DIFFERS from the payload")
        if r["tiers"]["L2"][name] != ["L2"] or r["tiers"]["L3"][name] != ["L3"]:
            notes.append(f"restored from {r['tiers']['L2'][name]} / {r['tiers']['L3'][name]}")
        if name == "raw":
            speed = f"{'stored as is':>16} {'read as is':>16}"
        else:
            speed = (f"{c['encode_mb_s']:>7,.0f} ({c['encode_vs_copy']:>5.1f}x) "
                     f"{c['decode_mb_s']:>7,.0f} ({c['decode_vs_copy']:>5.1f}x)")
        lines.append(
            f"  {name:6} {c['stored_bytes'] / MB:>9.1f} {c['ratio']:>9.2f}x {speed} "
            f"{r['ms']['L2'][name]:>8.1f} ms {r['vs_raw']['L2'][name]:>5.2f}x "
            f"{r['ms']['L3'][name]:>8.1f} ms {r['vs_raw']['L3'][name]:>5.2f}x  {'; '.join(notes)}")
    lines.append("  (encode/decode: MB of raw KV per second, and the time as a multiple of the plain copy; "
                 "restore = lookup + get_many + assemble)")
    q = result["quality"]
    if "skipped" in q:
        lines.append(f"  int8 quality: skipped ({q['skipped']})")
        return "\n".join(lines)
    lines.append(f"  quality over {q['summary']['int8']['questions']} doc-qa questions, {q['cold_tokens']} cold "
                 f"tokens; each restore loads the question's own cold KV (all but the last prompt token):")
    for name, label in (("int8", "int8"), ("raw", "raw (control)")):
        s = q["summary"][name]
        lines.append(
            f"    {label:14} answers identical to cold {s['identical']}/{s['questions']}; generated tokens equal "
            f"position by position {s['equal_positions_fraction']:.1%}, before the first difference "
            f"{s['common_prefix_fraction']:.1%}; first token's logits: max |diff| {s['max_abs_logit_diff']:.4f} "
            f"(median over questions {s['median_max_abs_logit_diff']:.4f}), same first token {s['same_first_token']}/"
            f"{s['questions']}")
    lines.append(f"    (largest |logit| of a cold first token: {q['cold_logit_absmax']:.1f})")
    if q["cold_equals_bench_cold"] is not None:
        same, total = q["cold_equals_bench_cold"]
        lines.append(f"    this loop's cold answers equal part (a)'s cold answers: {same}/{total}")
    return "\n".join(lines)
