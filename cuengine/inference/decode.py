"""The decode step: one token for each of b rows, every kernel fused as far as the GEMVs allow.

Per layer on the GEMV arms ("fused": 5 launches; the attention adds a combine pass when it splits
the sequence more than 32 ways):
    qkv  = gemv(residual, qkv_w, norm_weight=ln1, bias)        RMSNorm in the prologue   (b, Q)
    qkv  = qknorm(qkv)                                         Qwen3 only: one more launch
    att  = decode_attention(qkv, cache[0, lengths), freqs)     rotate q, k at lengths - 1, append k, v,
                                                               then split-KV attention, GQA (b, Hq*hs)
    residual = gemv(att, atto_w, residual=residual)            residual add in the epilogue
    FFN arm (ln2 in the first GEMV's prologue, the residual add in the down GEMV's epilogue):
      "fused": up = gemv_dual(residual, up_w, norm_weight=ln2); residual = gemv(up, down_w, act="swiglu")
      "fused_up": act = gemv_dual(residual, up_w, norm_weight=ln2, act="swiglu"); residual = gemv(act, down_w,
                residual=residual): SiLU·mul once per output in the epilogue, where "fused" has every
                block of the down GEMV recompute all of it (the same values, so the same bits)
      "split": up = gemv_dual(...); act = swiglu_forward(up); residual = gemv(act, down_w, residual=...)
The "persistent" arm runs every layer of a batch-1 step in one launch (kernels/decode_layers.py): the
"fused" arm's phases meeting at counters, with each block's weights streamed into shared memory ahead
of them, bit-identical to it. The "ksplit" arm (batch 1, 3 launches a layer) splits the output
projection over the q heads and the down projection over the hidden units, so that the attention
and its output projection are one launch (kernels/decode_attention_o.py) and the whole MLP another
(kernels/decode_mlp.py); each sums its blocks' partial outputs in a fixed-point accumulator that the
launch after it adds to the residual in its RMSNorm prologue:
    qkv  = gemv(res + acc_mlp[i-1], qkv_w, norm_weight=ln1, bias); res_in = res + acc_mlp[i-1]
    acc_o[i] = decode_attention_o(qkv, cache, o_w)                (att · o_wᵀ, split over heads)
    acc_mlp[i] = decode_mlp(res_in + acc_o[i], ln2, up_w, down_w); res = res_in + acc_o[i]
(layer 0 reads the embedding from res_in; the LM head adds the last acc_mlp). Its sums differ from
the other arms' only in the order of the two split projections (exact integer sums of per-head and
per-chunk partials each rounded at 2^-28), so its logits match them to rounding. The "gemm" arm (8
launches) runs every linear layer through cuBLASLt's M = b GEMMs instead,
which read each weight once for all rows where a GEMV re-reads it per group of 8: RMSNorm then the qkv
GEMM with its bias, the output projection and the down projection accumulated into the residual.
Then the final RMSNorm and the LM head give fp32 logits: for bf16/fp32 weights at two rows or more
an RMSNorm launch and a cuBLASLt GEMM (it streams the (V, C) head faster than the GEMV there), at one
row and for FP8 decode weights the GEMV with its RMSNorm prologue (a dependent launch, and no
RMSNorm of its own: 1.5B bf16 1.200 -> 1.190 ms/token at batch 1, 0.5B unchanged; BENCHMARKS
twenty-first session, call 4); sample_tokens writes the next input tokens and advance_positions
moves every row on: nothing is read from or written by the host, so the step is captured once per
(b, arm) as a CUDA graph and replayed. The GEMVs, the append and the attention go out as
programmatic dependent launches, so each one's launch and weight prefetch overlap the tail of
the kernel before it.

The rounding points are the training forward's (see the contract in gemv.py), so decode logits
equal the full forward's. The "gemm" arm adds the output and down projections with cuBLASLt's
accumulate (one rounding of residual + product instead of two): equal in fp32, within one bf16
step in bf16.
"""

from __future__ import annotations

from .. import blas
from ..kernels import (
    activations,
    decode_attention,
    decode_attention_o,
    decode_layers,
    decode_mlp,
    decode_step,
    encoder,
    gemv,
    qknorm,
    rmsnorm,
    sampling,
)


def _gemv(st, out, x, name, **kw) -> None:
    lin = st.linears[name]
    gemv.gemv(out, x, lin.w, w_scale=lin.scale, **kw)


def ffn(st, i: int, b: int, arm: str) -> None:
    """residual[:b] += the MLP of layer i on RMSNorm(residual[:b]), through `arm`."""
    eps, p = st.cfg.rms_norm_eps, f"layers.{i}."
    ln2 = st.model_weights.block(i)["ln2_w"]
    res, up, act = st.residual.rows(0, b), st.up.rows(0, b), st.act.rows(0, b)
    if arm == "gemm":
        W = st.model_weights
        ln = st.ln.rows(0, b)
        rmsnorm.rmsnorm_forward(ln, st.rstd.rows(0, b), res, ln2, eps)
        blas.matmul(up, ln, W[p + "up_w"])
        activations.swiglu_forward(act, up)
        blas.matmul(res, act, W[p + "down_w"], accumulate=True)
        return
    lin = st.linears[p + "up_w"]
    if arm == "fused_up":
        gemv.gemv_dual(act, res, lin.w, w_scale=lin.scale, norm_weight=ln2, eps=eps, act="swiglu")
        _gemv(st, res, act, p + "down_w", residual=res)
        return
    gemv.gemv_dual(up, res, lin.w, w_scale=lin.scale, norm_weight=ln2, eps=eps)
    if arm == "fused":
        _gemv(st, res, up, p + "down_w", residual=res, act="swiglu")
    else:
        activations.swiglu_forward(act, up)
        _gemv(st, res, act, p + "down_w", residual=res)


def attention(st, i: int, b: int, arm: str, x_acc=None, x_out=None) -> None:
    """st.att[:b] = the attention of block i over RMSNorm(st.residual[:b] [+ x_acc]), appending each row's
    k and v at its position (x_out: where the qkv GEMV writes the residual plus x_acc)."""
    cfg = st.cfg
    Hq, Hkv, eps = cfg.num_q_heads, cfg.num_kv_heads, cfg.rms_norm_eps
    W, p = st.model_weights, f"layers.{i}."
    w = W.block(i)
    res, qkv, att = st.residual.rows(0, b), st.qkv.rows(0, b), st.att.rows(0, b)
    if arm == "gemm":
        ln = st.ln.rows(0, b)
        rmsnorm.rmsnorm_forward(ln, st.rstd.rows(0, b), res, w["ln1_w"], eps)
        blas.matmul(qkv, ln, W[p + "qkv_w"], w.get("qkv_b"))
    else:
        _gemv(st, qkv, res, p + "qkv_w", bias=w.get("qkv_b"), norm_weight=w["ln1_w"], eps=eps, x_acc=x_acc,
              x_out=x_out)  # fmt: skip
    if cfg.qk_norm:  # in place, before RoPE, as the training forward
        qknorm.qknorm_forward(qkv, st.qk_rstd.rows(0, b), qkv, w["q_norm_w"], w["k_norm_w"], Hq, Hkv, eps)
    # RoPE at each row's position and the cache append run inside the attention launch (row r is slot r)
    decode_attention.decode_attention(att, qkv, st.k_cache[i], st.v_cache[i], st.lengths.rows(0, b), Hq, Hkv,
                                      st.att_scratch, freqs=st.freqs)  # fmt: skip


def layer(st, i: int, b: int, arm: str) -> None:
    """Block i on the b rows of st.residual, appending each row's k and v at its position."""
    W, p = st.model_weights, f"layers.{i}."
    res, att = st.residual.rows(0, b), st.att.rows(0, b)
    attention(st, i, b, arm)
    if arm == "gemm":
        blas.matmul(res, att, W[p + "atto_w"], accumulate=True)
    else:
        _gemv(st, res, att, p + "atto_w", residual=res)
    ffn(st, i, b, arm)


def ksplit_layers(st):
    """Every layer of a batch-1 step on the "ksplit" arm (the module's docstring), from the embedding in
    st.res_in; returns the last layer's MLP accumulator, which the LM head adds to st.residual."""
    cfg, W, eps = st.cfg, st.model_weights, st.cfg.rms_norm_eps
    Hq, Hkv = cfg.num_q_heads, cfg.num_kv_heads
    res, res_in, qkv, att = st.residual.rows(0, 1), st.res_in, st.qkv.rows(0, 1), st.att.rows(0, 1)
    st.acc_o.fill_zero()
    st.acc_mlp.fill_zero()
    acc = None  # the MLP output that res misses (none before the first layer, whose input is res_in)
    for i in range(cfg.num_layers):
        w, p = W.block(i), f"layers.{i}."
        _gemv(st, qkv, res_in if acc is None else res, p + "qkv_w", bias=w.get("qkv_b"), norm_weight=w["ln1_w"],
              eps=eps, x_acc=acc, x_out=None if acc is None else res_in)  # fmt: skip
        if cfg.qk_norm:  # in place, before RoPE, as the training forward
            qknorm.qknorm_forward(qkv, st.qk_rstd.rows(0, 1), qkv, w["q_norm_w"], w["k_norm_w"], Hq, Hkv, eps)
        o, up, down = st.linears[p + "atto_w"], st.linears[p + "up_w"], st.linears[p + "down_w"]
        acc_o, acc = st.acc_o.rows(i, i + 1), st.acc_mlp.rows(i, i + 1)
        decode_attention_o.decode_attention_o(acc_o, att, qkv, st.k_cache[i], st.v_cache[i], st.lengths.rows(0, 1),
                                              Hq, Hkv, st.att_scratch, st.freqs, o.w, o_scale=o.scale)  # fmt: skip
        decode_mlp.decode_mlp(acc, res_in, w["ln2_w"], up.w, down.w, eps=eps, up_scale=up.scale,
                              down_scale=down.scale, x_acc=acc_o, x_out=res)  # fmt: skip
    return acc


def head_and_sample(st, b: int, x_acc=None) -> None:
    """Final RMSNorm + LM head (fp32 logits) of st.residual[:b] (plus the accumulator x_acc of the "ksplit"
    arm), sample into st.tokens[:b], and move every row one position on."""
    W, eps = st.model_weights, st.cfg.rms_norm_eps
    logits, res = st.logits.rows(0, b), st.residual.rows(0, b)
    if st.head_by_gemm and b > 1:  # one row: the GEMV (the module's docstring)
        ln = st.ln.rows(0, b)
        rmsnorm.rmsnorm_forward(ln, st.rstd.rows(0, b), res, W["lnf_w"], eps)
        blas.matmul(logits, ln, W.lm_head)
    else:
        _gemv(st, logits, res, "lm_head", norm_weight=W["lnf_w"], eps=eps, x_acc=x_acc)
    sampling.sample_tokens(st.tokens.rows(0, b), st.logits.rows(0, b), st.params)
    decode_step.advance_positions(st.positions.rows(0, b), st.lengths.rows(0, b))


def persistent_layers(st) -> None:
    """Every layer of a batch-1 step in one launch (kernels/decode_layers.py): the "fused" arm's
    phases, bit for bit, meeting at counters instead of kernel boundaries."""
    cfg = st.cfg
    decode_layers.decode_layers(st.residual.rows(0, 1), st.qkv.rows(0, 1), st.att.rows(0, 1), st.up.rows(0, 1),
                                st.att_scratch, st.layer_sync, st.layer_table, st.layer_weights,
                                st.lengths.rows(0, 1), st.freqs, cfg.num_q_heads, cfg.num_kv_heads,
                                cfg.rms_norm_eps)  # fmt: skip


def decode_step_rows(st, b: int, arm: str) -> None:
    """One decode step of rows 0..b-1 from their input tokens st.tokens[:b]. Enqueued only."""
    emb = st.res_in if arm == "ksplit" else st.residual.rows(0, b)
    encoder.encoder_forward(emb, st.tokens.rows(0, b), st.model_weights["wte"])
    acc = None
    if arm == "persistent":
        persistent_layers(st)
    elif arm == "ksplit":
        acc = ksplit_layers(st)
    else:
        for i in range(st.cfg.num_layers):
            layer(st, i, b, arm)
    head_and_sample(st, b, acc)


def step(st, b: int, arm: str) -> None:
    """decode_step_rows through the state's graph of (b, arm): captured once, then replayed.
    Raises ValueError when arm="persistent" cannot run this model or batch, saying why."""
    if arm == "persistent":
        why = st.persistent_why or decode_layers.unsupported(st.cfg, st.dtype, st.device, b)
        if why:
            raise ValueError(f"ffn_arm='persistent' cannot run: {why}; use 'fused' or 'auto'")
    if arm == "ksplit":
        why = st.ksplit_why or (None if b == 1 else f"it runs batch 1 only, got {b} rows")
        if why:
            raise ValueError(f"ffn_arm='ksplit' cannot run: {why}; use 'fused_up' or 'auto'")
    st.run(("decode", b, arm), lambda: decode_step_rows(st, b, arm))
