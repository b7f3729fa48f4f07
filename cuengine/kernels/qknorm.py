"""Qwen3's QK-norm: RMSNorm over each query and key head of packed qkv (raw_kernels/qknorm.cu).

Qwen3 normalises q and k per head after the projection and before RoPE, with one weight vector of
head_size shared by all query heads (q_norm) and one shared by all key heads (k_norm). Value heads
pass through. The backward needs the pre-norm qkv, so a model that normalises in place must keep
(or recompute) the projection's output.
"""

from __future__ import annotations

import numpy as np

from .._checks import expect, same_device
from ..dtypes import BF16, FP32
from ._build import ceil_div, launch

FAMILY = "qknorm"
FLOATS = (FP32, BF16)
_SUFFIX = {"fp32": "f32", "bf16": "bf16"}
_WARPS = 8  # (row, head) pairs per block, matches qknorm.cu
_MAX_PARTIALS = 256  # blocks of the backward = rows of the scratch


# ---- NumPy twins --------------------------------------------------------------------------
def _heads(qkv: np.ndarray, hs: int) -> np.ndarray:
    return qkv.reshape(-1, qkv.shape[-1] // hs, hs)


def qknorm_forward_np(qkv, weight_q, weight_k, n_q_heads: int, n_kv_heads: int, eps: float):
    """(out, rstd): out = qkv with each q and k head RMSNormed (fp32 math, rounded once), v heads
    copied; rstd (N, Hq + Hkv) fp32. NumPy equivalent of the forward kernel."""
    hs = weight_q.shape[0]
    x = _heads(qkv, hs).astype(np.float32)
    nrm = n_q_heads + n_kv_heads
    xn = x[:, :nrm]
    rstd = (np.float32(1) / np.sqrt(np.mean(xn * xn, axis=-1, dtype=np.float32) + np.float32(eps))).astype(np.float32)
    w = np.concatenate([np.broadcast_to(weight_q.astype(np.float32), (n_q_heads, hs)),
                        np.broadcast_to(weight_k.astype(np.float32), (n_kv_heads, hs))])  # fmt: skip
    y = x.copy()
    y[:, :nrm] = xn * rstd[..., None] * w
    return y.astype(qkv.dtype).reshape(qkv.shape), rstd.reshape(*qkv.shape[:-1], nrm)


def qknorm_backward_np(dout, qkv, weight_q, weight_k, rstd, n_q_heads: int, n_kv_heads: int):
    """(dinp, dweight_q, dweight_k): dinp rounded to qkv's dtype (v heads: dout copied); the weight
    gradients summed in float64 (the exact reference for the kernel's fixed-order fp32 sums)."""
    hs = weight_q.shape[0]
    nrm = n_q_heads + n_kv_heads
    x, g = _heads(qkv, hs).astype(np.float32), _heads(dout, hs).astype(np.float32)
    r = rstd.reshape(-1, nrm)[..., None].astype(np.float32)
    w = np.concatenate([np.broadcast_to(weight_q.astype(np.float32), (n_q_heads, hs)),
                        np.broadcast_to(weight_k.astype(np.float32), (n_kv_heads, hs))])  # fmt: skip
    xh = x[:, :nrm] * r
    gn = g[:, :nrm]
    coef = np.sum(w * gn * x[:, :nrm], axis=-1, keepdims=True, dtype=np.float32) * r / np.float32(hs)
    d = g.copy()
    d[:, :nrm] = r * (w * gn - xh * coef)
    prod = (gn * xh).astype(np.float64)
    dwq = prod[:, :n_q_heads].sum(axis=(0, 1)).astype(np.float32)
    dwk = prod[:, n_q_heads:].sum(axis=(0, 1)).astype(np.float32)
    return d.astype(qkv.dtype).reshape(qkv.shape), dwq, dwk


# ---- sizes --------------------------------------------------------------------------------
def qknorm_scratch_shape(N: int, n_q_heads: int, n_kv_heads: int, head_size: int) -> tuple[int, int, int]:
    """Shape (P, 2, head_size) of the fp32 scratch qknorm_backward needs for N rows; P, the
    backward's block count, depends only on the sizes, which keeps the weight gradients' bits fixed."""
    pairs = N * (n_q_heads + 2 * n_kv_heads)
    return (max(1, min(_MAX_PARTIALS, ceil_div(pairs, _WARPS))), 2, head_size)


# ---- launchers ----------------------------------------------------------------------------
def _check(what, qkv, weight_q, weight_k, n_q_heads, n_kv_heads):
    """(N, hs) after the shared checks."""
    expect(qkv, f"{what} qkv", FLOATS)
    expect(weight_q, f"{what} weight_q", qkv.dtype)
    if weight_q.ndim != 1:
        raise ValueError(f"{what} weight_q: expected shape (head_size,), got {weight_q.shape}")
    hs = weight_q.shape[0]
    expect(weight_k, f"{what} weight_k", qkv.dtype, (hs,))
    if n_q_heads < 1 or n_kv_heads < 1:
        raise ValueError(f"{what}: n_q_heads={n_q_heads} and n_kv_heads={n_kv_heads} must be >= 1")
    vn = 16 // qkv.dtype.itemsize
    if hs == 0 or hs % vn:
        raise ValueError(f"{what}: head_size = {hs} must be a positive multiple of {vn} for 16-byte vectors")
    Q = (n_q_heads + 2 * n_kv_heads) * hs
    if qkv.ndim < 1 or qkv.shape[-1] != Q:
        raise ValueError(f"{what} qkv: expected last dim (Hq + 2*Hkv) * head_size = {Q}, got {qkv.shape}")
    return qkv.nelem // Q, hs


def _check_aligned(dev, *tensors) -> None:
    if dev.is_cuda:
        for t in tensors:
            if t.ptr % 16:
                raise ValueError(f"tensor {t.name!r}: device address {t.ptr:#x} is not 16-byte aligned")


def qknorm_forward(out, rstd, qkv, weight_q, weight_k, n_q_heads: int, n_kv_heads: int, eps: float,
                   stream=None) -> None:  # fmt: skip
    """Per-head RMSNorm of the q and k heads of packed qkv; v heads copied.

    Args:
        out: (N, (Hq + 2*Hkv) * hs) (any leading dims), qkv's dtype; written (=); may alias qkv.
        rstd: (N, Hq + Hkv) fp32 (qkv's leading dims); written, for the backward.
        qkv: packed q | k | v heads, fp32 or bf16; hs a multiple of 16 bytes' worth of elements.
        weight_q, weight_k: (hs,) qkv's dtype: q_norm and k_norm.
    NumPy equivalent: qknorm_forward_np.
    """
    N, hs = _check("qknorm_forward", qkv, weight_q, weight_k, n_q_heads, n_kv_heads)
    expect(out, "qknorm_forward out", qkv.dtype, qkv.shape)
    expect(rstd, "qknorm_forward rstd", FP32, (*qkv.shape[:-1], n_q_heads + n_kv_heads))
    dev = same_device(out, rstd, qkv, weight_q, weight_k)
    if dev.is_cpu:
        y, r = qknorm_forward_np(qkv.array(), weight_q.array(), weight_k.array(), n_q_heads, n_kv_heads, eps)
        out.array()[...] = y
        rstd.array()[...] = r
        return
    if N == 0:
        return
    _check_aligned(dev, out, qkv, weight_q, weight_k)
    pairs = N * (n_q_heads + 2 * n_kv_heads)
    args = (out, rstd, qkv, weight_q, weight_k, np.float32(eps), np.int32(N), np.int32(n_q_heads),
            np.int32(n_kv_heads), np.int32(hs))  # fmt: skip
    blocks = min(ceil_div(pairs, _WARPS), dev.num_sms * 16)
    launch(FAMILY, f"qknorm_forward_{_SUFFIX[qkv.dtype.name]}", blocks, 32 * _WARPS, args, dev, stream)


def qknorm_backward(dinp, dweight_q, dweight_k, scratch, dout, qkv, weight_q, weight_k, rstd, n_q_heads: int,
                    n_kv_heads: int, stream=None) -> None:  # fmt: skip
    """QK-norm backward: dinp = ∂out/∂qkv · dout (v heads: dout copied); the weight gradients +=.

    Args:
        dinp: like qkv; written (=); may alias dout (in place).
        dweight_q, dweight_k: (hs,); accumulated (+=), deterministically, rounded once.
        scratch: fp32 of shape qknorm_scratch_shape(N, Hq, Hkv, hs); overwritten.
        dout: gradient of the forward's out; qkv: the forward's (pre-norm) input; rstd from the forward.
    NumPy equivalent: qknorm_backward_np.
    """
    N, hs = _check("qknorm_backward", qkv, weight_q, weight_k, n_q_heads, n_kv_heads)
    for name, t in (("dinp", dinp), ("dout", dout)):
        expect(t, f"qknorm_backward {name}", qkv.dtype, qkv.shape)
    expect(dweight_q, "qknorm_backward dweight_q", qkv.dtype, (hs,))
    expect(dweight_k, "qknorm_backward dweight_k", qkv.dtype, (hs,))
    expect(rstd, "qknorm_backward rstd", FP32, (*qkv.shape[:-1], n_q_heads + n_kv_heads))
    expect(scratch, "qknorm_backward scratch", FP32, qknorm_scratch_shape(N, n_q_heads, n_kv_heads, hs))
    dev = same_device(dinp, dweight_q, dweight_k, scratch, dout, qkv, weight_q, weight_k, rstd)
    if dev.is_cpu:
        d, dwq, dwk = qknorm_backward_np(dout.array(), qkv.array(), weight_q.array(), weight_k.array(),
                                         rstd.array(), n_q_heads, n_kv_heads)  # fmt: skip
        dinp.array()[...] = d
        for t, g in ((dweight_q, dwq), (dweight_k, dwk)):
            t.array()[...] = (t.array().astype(np.float32) + g).astype(t.dtype.np)
        return
    if N == 0:
        return
    _check_aligned(dev, dinp, dout, qkv, weight_q, weight_k)
    suffix, P = _SUFFIX[qkv.dtype.name], scratch.shape[0]
    args = (dinp, scratch, dout, qkv, weight_q, weight_k, rstd, np.int32(N), np.int32(n_q_heads),
            np.int32(n_kv_heads), np.int32(hs))  # fmt: skip
    launch(FAMILY, f"qknorm_backward_{suffix}", P, 32 * _WARPS, args, dev, stream, shared_mem=4 * _WARPS * 2 * hs)
    args = (dweight_q, dweight_k, scratch, np.int32(P), np.int32(hs))
    launch(FAMILY, f"qknorm_backward_dweight_{suffix}", ceil_div(2 * hs, 256), 256, args, dev, stream)
