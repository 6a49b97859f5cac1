"""Blend as an engine mode: how CachedEngine runs a request in mode "blend" (registered with the engine's modes).

Place in the flow: CachedEngine.infer(mode="blend") -> prepare (segments) -> **run_blend**: a prompt of
instruction, passages and question is placed by the engine's BlendRunner (kvbridge.blend.runner, a second
llama.cpp context of the same model, made on first use), and its record filled from the result; a prompt
without passages runs as lmcache and its record says so. The runner is imported only when a blend request
needs one, so listing the modes (GUI, CLI) loads no llama.cpp code.
"""
from __future__ import annotations

from kvbridge.engine.modes import ModeRequest, ModeSpec, register_mode
from kvbridge.engine.segments import no_passages_note
from kvbridge.errors import BadSettings


def make_blend_runner(engine):
    """The blend runner of an engine (a second llama.cpp context of the same model); refused where blend cannot run."""
    from kvbridge.blend.runner import BlendRunner   # llama.cpp's door: loaded by the first blend request, not by listing modes

    if engine.backend.key != "llamacpp":
        raise BadSettings(f"blend mode runs on the in-process engine (KVB_ENGINE=llamacpp), not on {engine.backend.key}; "
                          "through serve, send X-KVBridge-Blend: on to the scheduler")
    if engine.kv_refusal:
        raise BadSettings(f"blend mode needs exact KV access, and this model's is refused: {engine.kv_refusal}")
    return BlendRunner(engine.settings, engine.store, engine.namespace)


def run_blend(engine, request: ModeRequest) -> None:
    """Place the passages and answer (three segments or more), else run the prompt as lmcache and say why."""
    p, record = request.prompt, request.record
    if len(p.segments) < 3:
        record.mode = "lmcache"
        record.add_note(no_passages_note(engine.settings.blend_separator))
        engine.run_exact_prefix(request)
        return
    settings, timer = engine.settings, request.timer
    runner = engine.mode_runner("blend")
    recompute = settings.blend_recompute_tokens
    result = runner.run(p.tokens, p.segments, recompute=recompute, n_predict=request.n_predict,
                        temperature=request.temperature, on_text=request.on_text, t0=request.t0,
                        recompute_at=settings.blend_recompute_at, ratio=settings.blend_recompute_ratio,
                        gate=settings.blend_gate)
    result.fill_record(record, len(p.segments), recompute, settings.blend_recompute_at,
                       settings.blend_recompute_ratio)
    record.ttft_ms = result.ttft_ms
    record.text = result.text
    record.gen_tokens = len(result.tokens)
    record.prefill_tokens = result.recomputed_tokens
    record.tier = result.tier
    record.stored_objects = result.stored_segments
    record.tokenize_ms = timer.ms["tokenize"]
    record.hash_ms = timer.ms["hash"]
    record.prefill_ms = result.prefill_ms
    record.first_token_ms = max(0.0, result.ttft_ms - record.tokenize_ms - record.hash_ms - result.fetch_ms
                                - result.assemble_ms - result.handoff_ms - result.prefill_ms)


register_mode(ModeSpec(
    "blend",
    "retrieved passages' stored KV reused wherever they stand in the prompt, a few tokens of each recomputed in "
    "context (approximate: its own namespace; prompts cut by KVB_BLEND_SEPARATOR)",
    run_blend,
    default=False,
    make_runner=make_blend_runner,
))
