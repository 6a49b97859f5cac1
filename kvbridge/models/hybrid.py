"""Builders of the hybrid and recurrent architectures: attention layers beside recurrent state.

Place in the flow: catalog.ZOO_ARCHITECTURES names a builder here -> **build(z, d)** writes the keys
and tensors through a ZooWriter -> a GGUF llama.cpp loads with a recurrent (or hybrid) memory.

Every hybrid has at least two attention and two recurrent layers, so a restore must carry both
kinds. Which layer is which follows each architecture's own rule: lfm2 and granitehybrid mark
attention layers by a per-layer `head_count_kv` (0 = recurrent), qwen35 and qwen3next by
`full_attention_interval`, falcon-h1 runs attention and Mamba-2 side by side in every layer.
Tensors that enter element-wise or convolution ops (conv kernels, A, D, dt biases) stay F32.
What llama.cpp insists on: granitehybrid's d_inner is 2 * n_embd; qwen35 needs
`rope.dimension_sections`; qwen3next is MoE only (a tiny one here, with a shared expert); rwkv7
needs its four lora ranks and `time_mix_lerp_fused`. Pure recurrent models (mamba2, rwkv7) are here
too: their builders share the same pieces.
"""
from __future__ import annotations

from kvbridge.models.attention import N_EXPERT, N_EXPERT_USED, ffn, head_and_embedding
from kvbridge.models.dims import Dims
from kvbridge.models.writer import ZooWriter

D_CONV = 4           # Mamba-2 / gated delta net convolution width
SSM_HEAD_DIM = 64    # Mamba-2 head width (d_inner / heads)


def _attention_layers(n_layer: int, every: int = 3) -> list[int]:
    """Every `every`-th layer (the last of each group) is attention; the rest are recurrent."""
    return [i for i in range(n_layer) if (i + 1) % every == 0]


def _ssm_keys(z: ZooWriter, d_inner: int, d_state: int, n_head: int, n_group: int) -> None:
    z.u32("ssm.conv_kernel", D_CONV)
    z.u32("ssm.inner_size", d_inner)
    z.u32("ssm.state_size", d_state)
    z.u32("ssm.time_step_rank", n_head)
    z.u32("ssm.group_count", n_group)


def _mamba2_mixer(z: ZooWriter, p: str, e: int, d_inner: int, d_state: int, n_head: int, norm: bool = True) -> None:
    conv_dim = d_inner + 2 * d_state          # one group
    z.matrix(p + "ssm_in.weight", (e, d_inner + conv_dim + n_head))
    z.normal(p + "ssm_conv1d.weight", (D_CONV, conv_dim), std=0.5)
    z.normal(p + "ssm_conv1d.bias", (conv_dim,), std=0.1)
    z.uniform(p + "ssm_dt.bias", (n_head,), -4.0, -1.0)
    z.uniform(p + "ssm_a", (1, n_head), -8.0, -1.0)
    z.const(p + "ssm_d", (1, n_head), 1.0)
    if norm:
        z.norm(p + "ssm_norm.weight", (d_inner, 1))
    z.matrix(p + "ssm_out.weight", (d_inner, e))


def _attn(z: ZooWriter, p: str, d: Dims, q_gate: bool = False) -> None:
    hd = d.head_dim
    z.matrix(p + "attn_q.weight", (d.n_embd, d.n_head * hd * (2 if q_gate else 1)))
    z.matrix(p + "attn_k.weight", (d.n_embd, d.n_head_kv * hd))
    z.matrix(p + "attn_v.weight", (d.n_embd, d.n_head_kv * hd))
    z.matrix(p + "attn_output.weight", (d.n_head * hd, d.n_embd))


def _base(z: ZooWriter, d: Dims, n_layer: int, n_ff: int, head_count_kv: int | list[int]) -> None:
    z.u32("context_length", d.n_ctx_train)
    z.u32("embedding_length", d.n_embd)
    z.u32("block_count", n_layer)
    z.u32("feed_forward_length", n_ff)
    z.u32("attention.head_count", d.n_head)
    if isinstance(head_count_kv, list):
        z.u32s("attention.head_count_kv", head_count_kv)
    else:
        z.u32("attention.head_count_kv", head_count_kv)
    z.f32("attention.layer_norm_rms_epsilon", 1e-5)
    z.f32("rope.freq_base", 10000.0)


def build_lfm2(z: ZooWriter, d: Dims) -> None:
    n_layer, l_cache = max(d.n_layer, 6), 3
    attn = _attention_layers(n_layer)
    _base(z, d, n_layer, d.n_ff, [d.n_head_kv if i in attn else 0 for i in range(n_layer)])
    z.u32("shortconv.l_cache", l_cache)
    z.normal("token_embd.weight", (d.n_embd, z.n_vocab), f16=True)
    z.norm("token_embd_norm.weight", (d.n_embd,))          # LFM2's final norm goes by this name
    z.head("output.weight", d.n_embd, d.head_gain, d.head_tail)
    for i in range(n_layer):
        p = f"blk.{i}."
        z.norm(p + "attn_norm.weight", (d.n_embd,))
        z.norm(p + "ffn_norm.weight", (d.n_embd,))
        ffn(z, i, d)
        if i in attn:
            z.norm(p + "attn_q_norm.weight", (d.head_dim,))
            z.norm(p + "attn_k_norm.weight", (d.head_dim,))
            _attn(z, p, d)
        else:
            z.normal(p + "shortconv.conv.weight", (l_cache, d.n_embd), std=0.5)
            z.matrix(p + "shortconv.in_proj.weight", (d.n_embd, 3 * d.n_embd))
            z.matrix(p + "shortconv.out_proj.weight", (d.n_embd, d.n_embd))


def build_granitehybrid(z: ZooWriter, d: Dims) -> None:
    n_layer, d_inner, d_state = max(d.n_layer, 6), 2 * d.n_embd, 64
    attn = _attention_layers(n_layer)
    _base(z, d, n_layer, d.n_ff, [d.n_head_kv if i in attn else 0 for i in range(n_layer)])
    _ssm_keys(z, d_inner, d_state, d_inner // SSM_HEAD_DIM, 1)
    head_and_embedding(z, d)
    for i in range(n_layer):
        p = f"blk.{i}."
        z.norm(p + "attn_norm.weight", (d.n_embd,))
        z.norm(p + "ffn_norm.weight", (d.n_embd,))
        ffn(z, i, d)
        if i in attn:
            _attn(z, p, d)
        else:
            _mamba2_mixer(z, p, d.n_embd, d_inner, d_state, d_inner // SSM_HEAD_DIM)


def build_falcon_h1(z: ZooWriter, d: Dims) -> None:
    d_inner, d_state = 2 * d.n_embd, 64
    _base(z, d, d.n_layer, d.n_ff, d.n_head_kv)
    z.u32("attention.key_length", d.head_dim)
    z.u32("attention.value_length", d.head_dim)
    _ssm_keys(z, d_inner, d_state, d_inner // SSM_HEAD_DIM, 1)
    head_and_embedding(z, d)
    for i in range(d.n_layer):                              # attention and Mamba-2 side by side in each layer
        p = f"blk.{i}."
        z.norm(p + "attn_norm.weight", (d.n_embd,))
        z.norm(p + "ffn_norm", (d.n_embd,))                  # llama.cpp's name for it has no .weight
        ffn(z, i, d)
        _attn(z, p, d)
        _mamba2_mixer(z, p, d.n_embd, d_inner, d_state, d_inner // SSM_HEAD_DIM, norm=False)


def _delta_net(z: ZooWriter, d: Dims, moe: bool) -> None:
    """qwen35 (dense) and qwen3next (MoE): gated delta net layers, every 4th layer gated attention."""
    n_layer, hd = max(d.n_layer, 8), d.head_dim
    d_state, n_k_heads, n_v_heads = hd, d.n_head_kv, d.n_head      # head_k_dim = head_v_dim = d_state
    key_dim, value_dim = d_state * n_k_heads, d_state * n_v_heads
    conv_dim = 2 * key_dim + value_dim
    _base(z, d, n_layer, d.n_ff, d.n_head_kv)
    z.u32("attention.key_length", hd)
    z.u32("attention.value_length", hd)
    z.u32("rope.dimension_count", hd)
    quarter = hd // 2 // 3
    z.i32s("rope.dimension_sections", [quarter, quarter, hd // 2 - 2 * quarter, 0])
    _ssm_keys(z, value_dim, d_state, n_v_heads, n_k_heads)
    z.u32("full_attention_interval", 4)
    if moe:
        z.u32("expert_count", N_EXPERT)
        z.u32("expert_used_count", N_EXPERT_USED)
        z.u32("expert_feed_forward_length", d.n_ff // 2)
        z.u32("expert_shared_feed_forward_length", d.n_ff // 2)
    head_and_embedding(z, d)
    for i in range(n_layer):
        p = f"blk.{i}."
        z.norm(p + "attn_norm.weight", (d.n_embd,))
        z.norm(p + "post_attention_norm.weight", (d.n_embd,))
        if (i + 1) % 4 == 0:
            _attn(z, p, d, q_gate=True)
            z.norm(p + "attn_q_norm.weight", (hd,))
            z.norm(p + "attn_k_norm.weight", (hd,))
        else:
            z.matrix(p + "attn_qkv.weight", (d.n_embd, conv_dim))
            z.matrix(p + "attn_gate.weight", (d.n_embd, value_dim))
            z.normal(p + "ssm_conv1d.weight", (D_CONV, conv_dim), std=0.5)
            z.uniform(p + "ssm_dt.bias", (n_v_heads,), -4.0, -1.0)
            z.uniform(p + "ssm_a", (n_v_heads,), -8.0, -1.0)
            if moe:
                z.matrix(p + "ssm_ba.weight", (d.n_embd, 2 * n_v_heads))
            else:
                z.matrix(p + "ssm_beta.weight", (d.n_embd, n_v_heads))
                z.matrix(p + "ssm_alpha.weight", (d.n_embd, n_v_heads))
            z.norm(p + "ssm_norm.weight", (d_state,))
            z.matrix(p + "ssm_out.weight", (value_dim, d.n_embd))
        if moe:
            n_ff_exp = d.n_ff // 2
            z.matrix(p + "ffn_gate_inp.weight", (d.n_embd, N_EXPERT))
            z.matrix(p + "ffn_gate_exps.weight", (d.n_embd, n_ff_exp, N_EXPERT))
            z.matrix(p + "ffn_up_exps.weight", (d.n_embd, n_ff_exp, N_EXPERT))
            z.matrix(p + "ffn_down_exps.weight", (n_ff_exp, d.n_embd, N_EXPERT))
            z.matrix(p + "ffn_gate_inp_shexp.weight", (d.n_embd, 1))
            z.matrix(p + "ffn_gate_shexp.weight", (d.n_embd, n_ff_exp))
            z.matrix(p + "ffn_up_shexp.weight", (d.n_embd, n_ff_exp))
            z.matrix(p + "ffn_down_shexp.weight", (n_ff_exp, d.n_embd))
        else:
            ffn(z, i, d)


def build_qwen35(z: ZooWriter, d: Dims) -> None:
    _delta_net(z, d, moe=False)


def build_qwen3next(z: ZooWriter, d: Dims) -> None:
    _delta_net(z, d, moe=True)


def build_mamba2(z: ZooWriter, d: Dims) -> None:
    d_inner, d_state = 2 * d.n_embd, 64
    z.u32("context_length", d.n_ctx_train)
    z.u32("embedding_length", d.n_embd)
    z.u32("block_count", d.n_layer)
    z.u32("feed_forward_length", 0)
    z.u32("attention.head_count", 0)
    z.f32("attention.layer_norm_rms_epsilon", 1e-5)
    _ssm_keys(z, d_inner, d_state, d_inner // SSM_HEAD_DIM, 1)
    head_and_embedding(z, d)
    for i in range(d.n_layer):
        z.norm(f"blk.{i}.attn_norm.weight", (d.n_embd,))
        _mamba2_mixer(z, f"blk.{i}.", d.n_embd, d_inner, d_state, d_inner // SSM_HEAD_DIM)


RWKV7_HEAD_SIZE = 64
RWKV7_LORA = {"decay_lora_rank": 32, "iclr_lora_rank": 32, "value_residual_mix_lora_rank": 16, "gate_lora_rank": 64}


def build_rwkv7(z: ZooWriter, d: Dims) -> None:
    e, n_ff = d.n_embd, 4 * d.n_embd
    rd, ri, rv, rg = RWKV7_LORA.values()
    z.u32("context_length", d.n_ctx_train)
    z.u32("embedding_length", e)
    z.u32("block_count", d.n_layer)
    z.u32("feed_forward_length", n_ff)
    z.u32("attention.head_count", 0)
    z.f32("attention.layer_norm_epsilon", 1e-5)
    z.u32("wkv.head_size", RWKV7_HEAD_SIZE)
    for key, rank in RWKV7_LORA.items():
        z.u32(f"attention.{key}", rank)
    z.u32("token_shift_count", 2)
    z.normal("token_embd.weight", (e, z.n_vocab), f16=True)
    for name in ("token_embd_norm", "output_norm"):
        z.norm(f"{name}.weight", (e,))
        z.normal(f"{name}.bias", (e,), std=0.01)
    z.head("output.weight", e, d.head_gain, d.head_tail)
    for i in range(d.n_layer):
        p = f"blk.{i}."
        for name in ("attn_norm", "attn_norm_2", "time_mix_ln"):
            z.norm(p + name + ".weight", (e,))
            z.normal(p + name + ".bias", (e,), std=0.01)
        z.uniform(p + "time_mix_w0.weight", (e,), -3.0, -0.5)
        z.matrix(p + "time_mix_w1.weight", (e, rd))
        z.matrix(p + "time_mix_w2.weight", (rd, e), 0.5)
        z.normal(p + "time_mix_a0.weight", (e,), std=0.5)
        z.matrix(p + "time_mix_a1.weight", (e, ri))
        z.matrix(p + "time_mix_a2.weight", (ri, e), 0.5)
        rv_i = ri if i == 0 else rv                          # layer 0 has no value residual: its lora is iclr-sized
        z.normal(p + "time_mix_v0.weight", (e,), std=0.5)
        z.matrix(p + "time_mix_v1.weight", (e, rv_i))
        z.matrix(p + "time_mix_v2.weight", (rv_i, e), 0.5)
        z.matrix(p + "time_mix_g1.weight", (e, rg))
        z.matrix(p + "time_mix_g2.weight", (rg, e))
        z.uniform(p + "time_mix_lerp_fused.weight", (e, 1, 1, 6), 0.0, 1.0)
        z.uniform(p + "time_mix_k_k.weight", (e,), 0.5, 1.0)
        z.uniform(p + "time_mix_k_a.weight", (e,), 0.5, 1.0)
        z.normal(p + "time_mix_r_k.weight", (e,), std=0.1)
        for name in ("key", "value", "receptance", "output"):
            z.matrix(p + f"time_mix_{name}.weight", (e, e))
        z.uniform(p + "channel_mix_lerp_k.weight", (e, 1, 1), 0.0, 1.0)
        z.matrix(p + "channel_mix_key.weight", (e, n_ff))
        z.matrix(p + "channel_mix_value.weight", (n_ff, e))
