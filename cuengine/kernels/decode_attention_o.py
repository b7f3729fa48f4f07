"""The attention of one decode row and its output projection in one launch (raw_kernels/decode_attention_o.cu):
the attention half of a layer on the "ksplit" arm.

At batch 1 the attention (with its RoPE and cache append) and the output-projection GEMV were two
dependent launches of a few µs each, for 0.8-4.7 MB of weights. Here the output projection is split
over the q heads: block (c, h) computes head h's attention itself (decode_attention's device code) and
multiplies it straight into its slice of W_o's columns for that head, rows c C / NC onwards; the heads'
partial outputs meet in a fixed-point accumulator (kernels/gemv.py: acc_shape), which the MLP launch
after it adds to the residual. Each block's W_o slice is copied into shared memory before the kernel
waits for the one before it. A row longer than LONG_LEN positions spreads its positions over the
head's blocks instead of having each of them read all of them.
"""

from __future__ import annotations

import math

import numpy as np

from .._checks import check_aligned, expect, overlaps, same_device
from ..dtypes import BF16, FP8_E4M3, FP16, FP32, INT32, INT64
from ._build import launch
from .decode_attention import (
    FLOATS,
    _check_caches,
    _check_heads,
    _check_qkv,
    _counter_rows,
    _layout,
    decode_attention_np,
    rope_kv_append_np,
)
from .gemv import acc_shape, acc_sum_np, check_row_scales

FAMILY = "decode_attention_o"
_THREADS = 128  # THREADS in decode_attention_o.cu
# Positions past which a row's attention is split over its head's blocks (each reads a chunk, then they
# meet and merge) rather than run whole by every block: a block walks 64 positions a step at head size 64.
LONG_LEN = 256
_LAYOUT = {"v8": (8, 1, 8), "v16": (8, 1, 16), "v32": (8, 1, 32), "gen": (2, 4, 32)}  # bf16 (VN, NV, LP)
_LAYOUT_F32 = {"v8": (4, 1, 8), "v16": (4, 1, 16), "v32": (4, 1, 32), "v32x2": (4, 2, 32), "gen": (2, 4, 32)}
_CTYPE = {"bf16": "__nv_bfloat16", "fp32": "float", "e4m3": "__nv_fp8_e4m3"}


# ---- NumPy twin ---------------------------------------------------------------------------
def decode_attention_o_np(qkv, k_cache, v_cache, lengths, freqs, n_q_heads, n_kv_heads, w_o, o_scale=None):
    """(att, acc_delta): the attention of each row (rounded to qkv's dtype, as decode_attention writes it,
    after appending the row's k and v to the caches in place) and what the launch adds to its accumulator:
    sum over heads h of round(2^ACC_SHIFT * o_scale * att_h . W_o[:, h]) (flag words set where a head's
    partial could overflow)."""
    b, hs = qkv.shape[0], k_cache.shape[-1]
    q = qkv.copy()
    ln = np.asarray(lengths)
    rope_kv_append_np(q, k_cache, v_cache, np.arange(b), ln - 1, freqs, n_q_heads, n_kv_heads)
    att = decode_attention_np(q, k_cache, v_cache, ln, n_q_heads, n_kv_heads).astype(qkv.dtype)
    C = w_o.shape[0]
    heads = att.astype(np.float32).reshape(b, n_q_heads, hs)
    wo = w_o.astype(np.float32).reshape(C, n_q_heads, hs)
    parts = np.einsum("nhe,bhe->bhn", wo, heads, dtype=np.float64).astype(np.float32)
    return att, acc_sum_np(parts, o_scale)


# ---- sizes --------------------------------------------------------------------------------
def blocks_per_head(n_q_heads: int, C: int, n_sms: int) -> int:
    """Row slices of W_o per head (NC): the grid is one wave of one block per SM, since a long row's
    blocks of a head wait for each other."""
    return max(1, min(C, n_sms // n_q_heads))


def unsupported(hs: int, x_dtype, w_dtype) -> str | None:
    """Why decode_attention_o cannot run this head size and these dtypes (None when it can)."""
    vw = 16 // w_dtype.itemsize
    if w_dtype not in (x_dtype, FP8_E4M3):
        return f"decode_attention_o runs over model-dtype or e4m3 weights, got {w_dtype} for {x_dtype} rows"
    lanes = hs // vw
    if hs % vw or lanes & (lanes - 1) or lanes > 32:
        return f"the head size {hs} is not a power-of-two number (at most 32) of {vw}-weight vectors"
    return None


# ---- launcher -----------------------------------------------------------------------------
def decode_attention_o(acc, att, qkv, k_cache, v_cache, lengths, n_q_heads: int, n_kv_heads: int, scratch, freqs,
                       w_o, *, o_scale=None, stream=None) -> None:  # fmt: skip
    """att = the attention of one new token over the cache (with RoPE and the cache append), and
    acc += att · W_oᵀ, split over the q heads.

    Args:
        acc: (1, C + ACC_PAD) int64 fixed-point accumulator (gemv.acc_shape); += (zero it first).
        att: (1, Hq*hs) qkv's dtype; written (=), rounded once, as decode_attention writes it.
        qkv, k_cache, v_cache, lengths, scratch, freqs: as decode_attention with freqs, for one row
            (qkv (1, ...), lengths (1,)); the scratch's counters must be zero (every launch leaves them so).
        w_o: (C, Hq*hs) the output projection in qkv's dtype, or e4m3 with o_scale (C,) fp32 row scales.
    Raises ValueError for dtypes, shapes, aliasing and sizes the kernel does not take.
    NumPy equivalent: decode_attention_o_np (acc += its delta).
    """
    what = "decode_attention_o"
    _check_heads(what, n_q_heads, n_kv_heads)
    expect(qkv, f"{what} qkv", FLOATS)
    max_batch, max_seq, hs = _check_caches(what, k_cache, v_cache, qkv.dtype, n_kv_heads)
    _check_qkv(what, qkv, 1, n_q_heads, n_kv_heads, hs)
    A = n_q_heads * hs
    expect(att, f"{what} att", qkv.dtype, (1, A))
    expect(lengths, f"{what} lengths", INT32, (1,))
    expect(scratch, f"{what} scratch", FP32, (None, n_q_heads, hs + 2))
    expect(freqs, f"{what} freqs", FP16 if qkv.dtype == BF16 else FP32, (None, hs))
    expect(w_o, f"{what} w_o", (qkv.dtype, FP8_E4M3), (None, A))
    C = w_o.shape[0]
    expect(acc, f"{what} acc", INT64, acc_shape(1, C))
    check_row_scales(what, "o_scale", w_o, o_scale)
    why = unsupported(hs, qkv.dtype, w_o.dtype)
    if why:
        raise ValueError(f"{what}: {why}")
    counter_rows = _counter_rows(hs)
    if scratch.shape[0] < counter_rows + 1:
        raise ValueError(f"{what} scratch: expected at least {counter_rows + 1} rows, got tensor {scratch.name!r}")
    for out in (acc, att):
        for t in (qkv, k_cache, v_cache, lengths, scratch, freqs, w_o, o_scale, acc if out is att else att):
            if overlaps(out, t):
                raise ValueError(f"{what}: tensor {out.name!r} overlaps {t.name!r}")
    dev = same_device(acc, att, qkv, k_cache, v_cache, lengths, scratch, freqs, w_o, o_scale)
    if dev.is_cpu:
        ln = lengths.array()
        limit = min(max_seq, freqs.shape[0])
        if not 1 <= ln[0] <= limit:
            raise ValueError(f"{what} lengths: length {ln[0]} is outside [1, {limit}]")
        a, delta = decode_attention_o_np(qkv.array(), k_cache.array(), v_cache.array(), ln, freqs.array(),
                                         n_q_heads, n_kv_heads, w_o.array(),
                                         None if o_scale is None else o_scale.array())  # fmt: skip
        att.array()[...] = a
        dst = acc.array()
        dst[:, :C] += delta[:, :C]
        dst[:, C] |= delta[:, C]
        return
    layout = _layout(qkv.dtype, hs)
    check_aligned(what, acc, att, qkv, k_cache, v_cache, w_o)
    vn, nv, lp = (_LAYOUT if qkv.dtype.itemsize == 2 else _LAYOUT_F32)[layout]
    nc = blocks_per_head(n_q_heads, C, dev.num_sms)
    splits = min(nc, scratch.shape[0] - counter_rows)
    rows = -(-C // nc)
    smem = (rows * hs * w_o.dtype.itemsize + 15) // 16 * 16 + 4 * (rows + splits)
    name = f"decode_attention_o<{_CTYPE[qkv.dtype.name]}, {_CTYPE[w_o.dtype.name]}, {vn}, {nv}, {lp}>"
    args = (acc, scratch, att, qkv, k_cache, v_cache, lengths, freqs, w_o, o_scale, np.int32(n_q_heads),
            np.int32(n_kv_heads), np.int32(hs), np.int32(max_seq), np.int32(freqs.shape[0]), np.int32(C),
            np.int32(splits), np.int32(LONG_LEN), np.float32(math.log2(math.e) / math.sqrt(hs)),
            np.int64(counter_rows * n_q_heads * (hs + 2)))  # fmt: skip
    launch(FAMILY, name, (nc, n_q_heads), _THREADS, args, dev, stream, shared_mem=smem, dependent=True)
