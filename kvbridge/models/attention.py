"""Builders of the attention architectures: plain (llama), sliding windows of each shape, chunked.

Place in the flow: catalog.ZOO_ARCHITECTURES names a builder here -> **build(z, d)** writes the keys
and tensors through a ZooWriter -> a GGUF llama.cpp loads as that architecture.

What each needs beyond llama is what llama.cpp's loader requires (src/models/<arch>.cpp), kept to
the minimum: gemma2 and gemma3 tie the head to the embedding (scaled by sqrt(n_embd) on input, so
their post-norms carry a large gain, else the tied head just echoes the input token); cohere2 ties
too and needs `layer_norm_epsilon` and `logit_scale`; gpt-oss needs attention sinks, biases,
experts and its own output head; llama4 is chunked attention (llama.cpp fixes the chunk at 8192
tokens whatever the file says) with MoE on every second layer; gemma3n shares KV from the
hard-coded layer 20, so it has 22 layers, and its per-layer token table is Q4_0 to stay small.
"""
from __future__ import annotations

from kvbridge.models.dims import Dims
from kvbridge.models.writer import ZooWriter

N_EXPERT, N_EXPERT_USED = 4, 2


def common_keys(z: ZooWriter, d: Dims, n_layer: int | None = None, n_ff: int | None = None,
                rms_eps: bool = True, rope_base: float = 10000.0) -> None:
    z.u32("context_length", d.n_ctx_train)
    z.u32("embedding_length", d.n_embd)
    z.u32("block_count", n_layer or d.n_layer)
    if n_ff is not None:
        z.u32("feed_forward_length", n_ff)
    z.u32("attention.head_count", d.n_head)
    z.u32("attention.head_count_kv", d.n_head_kv)
    z.f32("rope.freq_base", rope_base)
    if rms_eps:
        z.f32("attention.layer_norm_rms_epsilon", 1e-6)


def head_and_embedding(z: ZooWriter, d: Dims, tied: bool = False) -> None:
    """token_embd (and output unless tied) plus output_norm; a tied head is the embedding itself."""
    if tied:
        z.head("token_embd.weight", d.n_embd, d.head_gain, d.head_tail)
    else:
        z.normal("token_embd.weight", (d.n_embd, z.n_vocab), f16=True)
        z.head("output.weight", d.n_embd, d.head_gain, d.head_tail)
    z.const("output_norm.weight", (d.n_embd,), 1.0)


def qkvo(z: ZooWriter, i: int, d: Dims, out_gain: float = 1.0) -> None:
    hd = d.head_dim
    z.matrix(f"blk.{i}.attn_q.weight", (d.n_embd, d.n_head * hd))
    z.matrix(f"blk.{i}.attn_k.weight", (d.n_embd, d.n_head_kv * hd))
    z.matrix(f"blk.{i}.attn_v.weight", (d.n_embd, d.n_head_kv * hd))
    z.matrix(f"blk.{i}.attn_output.weight", (d.n_head * hd, d.n_embd), out_gain)


def ffn(z: ZooWriter, i: int, d: Dims, down_gain: float = 1.0) -> None:
    z.matrix(f"blk.{i}.ffn_gate.weight", (d.n_embd, d.n_ff))
    z.matrix(f"blk.{i}.ffn_up.weight", (d.n_embd, d.n_ff))
    z.matrix(f"blk.{i}.ffn_down.weight", (d.n_ff, d.n_embd), down_gain)


def experts(z: ZooWriter, i: int, d: Dims, n_ff_exp: int, biases: bool = False) -> None:
    p, e = f"blk.{i}.", d.n_embd
    z.matrix(p + "ffn_gate_inp.weight", (e, N_EXPERT))
    z.matrix(p + "ffn_gate_exps.weight", (e, n_ff_exp, N_EXPERT))
    z.matrix(p + "ffn_up_exps.weight", (e, n_ff_exp, N_EXPERT))
    z.matrix(p + "ffn_down_exps.weight", (n_ff_exp, e, N_EXPERT))
    if biases:
        z.const(p + "ffn_gate_inp.bias", (N_EXPERT,), 0.0)
        z.const(p + "ffn_gate_exps.bias", (n_ff_exp, N_EXPERT), 0.0)
        z.const(p + "ffn_up_exps.bias", (n_ff_exp, N_EXPERT), 0.0)
        z.const(p + "ffn_down_exps.bias", (e, N_EXPERT), 0.0)


def build_llama(z: ZooWriter, d: Dims) -> None:
    common_keys(z, d, n_ff=d.n_ff)
    z.u32("rope.dimension_count", d.head_dim)
    head_and_embedding(z, d)
    for i in range(d.n_layer):
        z.norm(f"blk.{i}.attn_norm.weight", (d.n_embd,))
        qkvo(z, i, d)
        z.norm(f"blk.{i}.ffn_norm.weight", (d.n_embd,))
        ffn(z, i, d)


def _gemma(z: ZooWriter, d: Dims, gemma3: bool) -> None:
    common_keys(z, d, n_ff=d.n_ff, rope_base=1000000.0 if gemma3 else 10000.0)
    z.u32("attention.key_length", d.head_dim)
    z.u32("attention.value_length", d.head_dim)
    z.u32("attention.sliding_window", d.n_swa)
    if gemma3:
        z.u32("attention.sliding_window_pattern", 3)   # 2 windowed : 1 global, so 4 layers show both kinds
        z.f32("rope.freq_base_swa", 10000.0)
    else:                                              # pattern 2 (llama.cpp's default): alternate
        z.f32("attn_logit_softcapping", 50.0)
        z.f32("final_logit_softcapping", 1000.0)       # the real 30 would flatten the random head into ties
    head_and_embedding(z, d, tied=True)
    post_gain = float(d.n_embd) ** 0.5 * 2.0            # match the sqrt(n_embd)-scaled input embedding
    for i in range(d.n_layer):
        z.norm(f"blk.{i}.attn_norm.weight", (d.n_embd,))
        qkvo(z, i, d)
        if gemma3:
            z.norm(f"blk.{i}.attn_q_norm.weight", (d.head_dim,))
            z.norm(f"blk.{i}.attn_k_norm.weight", (d.head_dim,))
        z.const(f"blk.{i}.post_attention_norm.weight", (d.n_embd,), post_gain)
        z.norm(f"blk.{i}.ffn_norm.weight", (d.n_embd,))
        ffn(z, i, d)
        z.const(f"blk.{i}.post_ffw_norm.weight", (d.n_embd,), post_gain)


def build_gemma2(z: ZooWriter, d: Dims) -> None:
    _gemma(z, d, gemma3=False)


def build_gemma3(z: ZooWriter, d: Dims) -> None:
    _gemma(z, d, gemma3=True)


def build_gpt_oss(z: ZooWriter, d: Dims) -> None:
    hd = d.head_dim
    common_keys(z, d)
    z.u32("rope.dimension_count", hd)
    z.u32("attention.key_length", hd)
    z.u32("attention.value_length", hd)
    z.u32("attention.sliding_window", d.n_swa)           # pattern 2 (default): even layers windowed
    z.u32("expert_count", N_EXPERT)
    z.u32("expert_used_count", N_EXPERT_USED)
    z.u32("expert_feed_forward_length", d.n_ff // 2)
    head_and_embedding(z, d)                               # gpt-oss requires its own output.weight
    for i in range(d.n_layer):
        p = f"blk.{i}."
        z.norm(p + "attn_norm.weight", (d.n_embd,))
        z.norm(p + "post_attention_norm.weight", (d.n_embd,))
        qkvo(z, i, d)
        z.const(p + "attn_q.bias", (d.n_head * hd,), 0.0)
        z.const(p + "attn_k.bias", (d.n_head_kv * hd,), 0.0)
        z.const(p + "attn_v.bias", (d.n_head_kv * hd,), 0.0)
        z.const(p + "attn_output.bias", (d.n_embd,), 0.0)
        z.normal(p + "attn_sinks.weight", (d.n_head,))
        experts(z, i, d, d.n_ff // 2, biases=True)


def build_cohere2(z: ZooWriter, d: Dims) -> None:
    common_keys(z, d, n_ff=d.n_ff, rms_eps=False)
    z.f32("attention.layer_norm_epsilon", 1e-5)
    z.f32("logit_scale", 1.0)
    z.u32("attention.sliding_window", d.n_swa)           # pattern 4 (default): 3 windowed : 1 global
    z.u32("rope.dimension_count", d.head_dim)
    head_and_embedding(z, d, tied=True)                    # cohere2 always ties the head
    for i in range(d.n_layer):
        z.norm(f"blk.{i}.attn_norm.weight", (d.n_embd,))
        # parallel attention + FFN added to the residual: gain 8 so the blocks, not the input token's own
        # embedding, decide what the tied head reads
        qkvo(z, i, d, out_gain=8.0)
        ffn(z, i, d, down_gain=8.0)


def build_llama4(z: ZooWriter, d: Dims) -> None:
    common_keys(z, d, n_ff=d.n_ff)
    z.u32("rope.dimension_count", d.head_dim)
    z.u32("expert_count", N_EXPERT)                        # llama.cpp refuses zero experts
    z.u32("expert_used_count", 1)
    z.u32("expert_feed_forward_length", d.n_ff // 2)
    z.u32("interleave_moe_layer_step", 2)
    # no sliding_window key: chunked attention, chunk 8192 (llama.cpp's constant), 3 chunked : 1 global
    head_and_embedding(z, d)
    for i in range(d.n_layer):
        p = f"blk.{i}."
        z.norm(p + "attn_norm.weight", (d.n_embd,))
        qkvo(z, i, d)
        z.norm(p + "ffn_norm.weight", (d.n_embd,))
        if (i + 1) % 2 == 0:
            experts(z, i, d, d.n_ff // 2)
            z.matrix(p + "ffn_gate_shexp.weight", (d.n_embd, d.n_ff // 2))
            z.matrix(p + "ffn_up_shexp.weight", (d.n_embd, d.n_ff // 2))
            z.matrix(p + "ffn_down_shexp.weight", (d.n_ff // 2, d.n_embd))
        else:
            ffn(z, i, d)


GEMMA3N_LAYERS = 22           # KV sharing starts at layer 20 (llama.cpp's constant): 2 sharing layers
GEMMA3N_ALTUP = 4             # altup streams, fixed in llama.cpp
GEMMA3N_LAUREL_RANK = 64      # fixed in llama.cpp
GEMMA3N_PER_LAYER_INPUT = 256 # fixed in llama.cpp: the per-layer token table is 22 * 256 wide (Q4_0: ~150 MB)


def build_gemma3n(z: ZooWriter, d: Dims) -> None:
    n_layer, e, ea, na = GEMMA3N_LAYERS, d.n_embd, GEMMA3N_PER_LAYER_INPUT, GEMMA3N_ALTUP
    common_keys(z, d, n_layer=n_layer, n_ff=d.n_ff)
    z.u32("attention.key_length", d.head_dim)
    z.u32("attention.value_length", d.head_dim)
    z.u32("attention.sliding_window", d.n_swa)
    z.u32("embedding_length_per_layer_input", ea)
    z.u32("attention.sliding_window_pattern", 2)    # layer 20 (windowed) reuses 18's KV, 21 (global) 19's
    head_and_embedding(z, d)
    z.q4_0("per_layer_token_embd.weight", (ea * n_layer, z.n_vocab), scale=0.125)
    z.matrix("per_layer_model_proj.weight", (e, ea * n_layer))
    z.norm("per_layer_proj_norm.weight", (ea,))
    z.matrix("altup_proj.weight", (e, e, na - 1))
    z.matrix("altup_unembd_proj.weight", (e, e, na - 1))
    for i in range(n_layer):
        p = f"blk.{i}."
        z.norm(p + "attn_norm.weight", (e,))
        qkvo(z, i, d)
        z.norm(p + "attn_q_norm.weight", (d.head_dim,))
        z.norm(p + "attn_k_norm.weight", (d.head_dim,))
        z.norm(p + "post_attention_norm.weight", (e,))
        z.norm(p + "ffn_norm.weight", (e,))
        ffn(z, i, d)
        z.norm(p + "post_ffw_norm.weight", (e,))
        z.matrix(p + "inp_gate.weight", (e, ea))
        z.matrix(p + "proj.weight", (ea, e))
        z.norm(p + "post_norm.weight", (e,))
        z.normal(p + "altup_correct_coef.weight", (na, na), std=0.1, f16=True)
        z.const(p + "altup_correct_scale.weight", (e,), 1.0)
        z.normal(p + "altup_predict_coef.weight", (na, na * na), std=0.1, f16=True)
        z.matrix(p + "altup_router.weight", (e, na))
        z.norm(p + "altup_router_norm.weight", (e,))
        z.matrix(p + "laurel_l.weight", (e, GEMMA3N_LAUREL_RANK))
        z.matrix(p + "laurel_r.weight", (GEMMA3N_LAUREL_RANK, e))
        z.norm(p + "laurel_post_norm.weight", (e,))
