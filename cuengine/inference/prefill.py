"""Prefill: prompts through the training forward kernels, K and V into the cache.

A group of n prompts, right-padded to T tokens (n * T <= max_seq rows of scratch), runs as one
(n, T) batch: the embedding, then per block RMSNorm, the qkv GEMM (cuBLASLt, bias on Qwen2),
QK-norm (Qwen3), RoPE, the K/V append to the cache (`rope_kv_append`, rotate=False: rope_forward
already rotated, bitwise the decode rotation), causal attention (the raw flash kernel: no
per-shape cuDNN graph to build), the output GEMM, the fused residual + RMSNorm, the MLP GEMMs and
SwiGLU. The rounding points are the training forward's, so the cache holds what a full forward
computes. Only each prompt's last row continues: its final residual goes to the decode residual
buffer, where the LM head reads it.
"""

from __future__ import annotations

from .. import blas
from ..kernels import activations, attention, decode_attention, encoder, qknorm, rmsnorm, rope


def prefill_group(st, first: int, n: int, T: int, off: int) -> None:
    """Prompts first..first+n-1 (tokens, slots and positions packed at `off` in st.p_index) into
    the cache; each one's last-row final residual into st.residual[slot]. Enqueued only, and read
    from the host: only the group layout (first, n, T, off), so it can be captured and replayed."""
    cfg, W = st.cfg, st.model_weights
    Hq, Hkv, eps = cfg.num_q_heads, cfg.num_kv_heads, cfg.rms_norm_eps
    N = n * T
    res, res_att, ln, rstd = st.p_res.rows(0, N), st.p_res_att.rows(0, N), st.p_ln.rows(0, N), st.p_rstd.rows(0, N)
    qkv, att, out = st.p_qkv.rows(0, N), st.p_att.rows(0, N), st.p_out.rows(0, N)
    up, act = st.p_up.rows(0, N), st.p_act.rows(0, N)
    qkv3, lse = qkv.reshape(n, T, -1), st.p_lse.rows(0, Hq * N).reshape(n, Hq, T)
    tokens, slots, positions = (st.p_index[k].rows(off, off + N) for k in range(3))
    encoder.encoder_forward(res, tokens, W["wte"])  # (N, C)
    for i in range(cfg.num_layers):
        w = W.block(i)
        if i == 0:
            rmsnorm.rmsnorm_forward(ln, rstd, res, w["ln1_w"], eps)
        else:  # res_ffn[i-1] = res_att[i-1] + mlp_down[i-1]
            rmsnorm.fused_residual_rmsnorm_forward(res, ln, rstd, res_att, out, w["ln1_w"], eps)
        blas.matmul(qkv, ln, w["qkv_w"], w.get("qkv_b"))  # (N, Q)
        if cfg.qk_norm:  # in place: prefill keeps nothing for a backward
            qknorm.qknorm_forward(qkv, st.qk_rstd.rows(0, N), qkv, w["q_norm_w"], w["k_norm_w"], Hq, Hkv, eps)
        rope.rope_forward(qkv3, qkv3, st.freqs, Hq, Hkv)
        decode_attention.rope_kv_append(qkv, st.k_cache[i], st.v_cache[i], slots, positions, None, Hq, Hkv,
                                        rotate=False)  # fmt: skip
        attention.attention_forward(att.reshape(n, T, -1), lse, qkv3, Hq, Hkv, backend="raw")  # no workspace
        blas.matmul(out, att, w["atto_w"])  # att_o (N, C)
        rmsnorm.fused_residual_rmsnorm_forward(res_att, ln, rstd, res, out, w["ln2_w"], eps)
        blas.matmul(up, ln, w["up_w"])  # (N, 2H)
        activations.swiglu_forward(act, up)  # (N, H)
        blas.matmul(out, act, w["down_w"])  # mlp_down (N, C)
    # each prompt's last row (st.p_last, gathered by the embedding lookup's kernel): res_ffn[L-1] into
    # the decode residual (the normalised copy, in decode scratch, is the decode LM head's to redo)
    last, res_last, out_last = st.p_last.rows(first, first + n), st.p_last_res.rows(0, n), st.p_last_out.rows(0, n)
    encoder.encoder_forward(res_last, last, res_att)
    encoder.encoder_forward(out_last, last, out)
    rmsnorm.fused_residual_rmsnorm_forward(st.residual.rows(first, first + n), st.ln.rows(0, n), st.rstd.rows(0, n),
                                           res_last, out_last, W["lnf_w"], eps)  # fmt: skip
