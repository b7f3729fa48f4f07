"""Prefill: each prompt through the training forward kernels, K and V into the cache.

One prompt at a time (lengths may differ) runs on scratch sized for max_seq rows: the embedding,
then per block RMSNorm, the qkv GEMM (cuBLASLt, bias on Qwen2), RoPE, the K/V append to the
cache (`rope_kv_append`, rotate=False: rope_forward already rotated, bitwise the decode rotation),
causal attention (the raw flash kernel: no per-length cuDNN graph to build), the output GEMM,
the fused residual + RMSNorm, the MLP GEMMs and SwiGLU. The rounding points are the training
forward's, so the cache holds exactly what a full forward computes. Only the prompt's last row
continues: its final residual goes to the decode residual buffer, where the LM head reads it.
"""

from __future__ import annotations

from .. import blas
from ..kernels import activations, attention, decode_attention, encoder, rmsnorm, rope


def prefill_prompt(st, slot: int, T: int) -> None:
    """Run prompt `slot` (its T tokens already in st.prompt[slot, :T]) into the cache and leave its
    last row's final residual in st.residual[slot]. Enqueued only."""
    cfg, W = st.cfg, st.model.weights
    Hq, Hkv, eps = cfg.num_q_heads, cfg.num_kv_heads, cfg.rms_norm_eps
    res, res_att, ln, rstd = st.p_res.rows(0, T), st.p_res_att.rows(0, T), st.p_ln.rows(0, T), st.p_rstd.rows(0, T)
    qkv, att, out = st.p_qkv.rows(0, T), st.p_att.rows(0, T), st.p_out.rows(0, T)
    up, act = st.p_up.rows(0, T), st.p_act.rows(0, T)
    lse = st.p_lse.rows(0, Hq * T).reshape(1, Hq, T)
    slots, positions = st.p_slots[slot].rows(0, T), st.p_positions.rows(0, T)
    encoder.encoder_forward(res, st.prompt[slot].rows(0, T), W["wte"])  # (T, C)
    for i in range(cfg.num_layers):
        w = W.block(i)
        if i == 0:
            rmsnorm.rmsnorm_forward(ln, rstd, res, w["ln1_w"], eps)
        else:  # res_ffn[i-1] = res_att[i-1] + mlp_down[i-1]
            rmsnorm.fused_residual_rmsnorm_forward(res, ln, rstd, res_att, out, w["ln1_w"], eps)
        blas.matmul(qkv, ln, w["qkv_w"], w.get("qkv_b"))  # (T, Q)
        rope.rope_forward(qkv.reshape(1, T, -1), qkv.reshape(1, T, -1), st.freqs, Hq, Hkv)
        decode_attention.rope_kv_append(qkv, st.k_cache[i], st.v_cache[i], slots, positions, st.freqs, Hq, Hkv,
                                        rotate=False)  # fmt: skip
        attention.attention_forward(att.reshape(1, T, -1), lse, qkv.reshape(1, T, -1), Hq, Hkv, backend="raw",
                                    workspace=st.p_workspace)  # fmt: skip
        blas.matmul(out, att, w["atto_w"])  # att_o (T, C)
        rmsnorm.fused_residual_rmsnorm_forward(res_att, ln, rstd, res, out, w["ln2_w"], eps)
        blas.matmul(up, ln, w["up_w"])  # (T, 2H)
        activations.swiglu_forward(act, up)  # (T, H)
        blas.matmul(out, act, w["down_w"])  # mlp_down (T, C)
    # the last row's res_ffn[L-1]; its normalised copy (into ln) is the decode LM head's to redo
    last = slice(T - 1, T)
    rmsnorm.fused_residual_rmsnorm_forward(st.residual.rows(slot, slot + 1), ln.rows(0, 1), rstd.rows(0, 1),
                                           res_att[last], out[last], W["lnf_w"], eps)  # fmt: skip
