"""RMSNorm: forward, fused residual-add forward, backward (raw_kernels/rmsnorm.cu).

Rows are normalised independently (any leading dims flatten to N rows of C channels). rstd is kept
in fp32 for the backward. The weight gradient accumulates deterministically through per-block
partial sums in a caller-provided fp32 scratch; the number of blocks depends only on (N, C, dtype),
so results do not depend on which GPU runs them.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_aligned, check_vector_width, expect, same_device
from ..dtypes import BF16, FP16, FP32
from ..dtypes import dtype as _dtype
from ._build import ceil_div, grid_size, kernel_name, launch, write_twin_results

FAMILY = "rmsnorm"
FLOATS = (FP32, BF16, FP16)

_FWD_WARPS = 8  # rows per forward block, matches rmsnorm.cu
_BWD_SMEM = 96 * 1024  # the looping backward's per-warp dweight partials: warps * C * 4 bytes at most
_BWD_WARPS = 8  # the backward's warps per block at most (__launch_bounds__(256) in .cu)
_MAX_PARTIALS = 132  # blocks of the register backward (rows up to _REG_ROW_BYTES): one per SM of the H200
_MAX_PARTIALS_LOOPING = 264  # blocks of the looping backward (wider rows): two per SM of the H200
_REG_VECTORS = (1, 2, 4, 6, 8)  # rmsnorm_backward_v<V>: V 16-byte vectors per lane at most
_REG_ROW_BYTES = 16 * 32 * _REG_VECTORS[-1]  # widest row of the register variants; fixed, sets the block cap
_BWD_STAGES = 2  # rows (x, dout, dresidual) a warp of rmsnorm_backward_v<V> holds in shared memory (BWD_STAGES)
_DW_COLS, _DW_THREADS = 32, 1024  # rmsnorm_backward_dweight: columns and threads per block (DW_WARPS in .cu)


# ---- NumPy twins --------------------------------------------------------------------------
def rmsnorm_forward_np(inp: np.ndarray, weight: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(out, rstd) for inp (..., C) and weight (C,): fp32 math, out rounded to inp's dtype.

    NumPy equivalent: `rstd = 1 / sqrt(mean(x**2, -1) + eps); out = x * rstd[..., None] * weight`.
    """
    x = inp.astype(np.float32)
    ms = np.mean(x * x, axis=-1, dtype=np.float32)
    rstd = (np.float32(1) / np.sqrt(ms + np.float32(eps))).astype(np.float32)
    out = (x * rstd[..., None] * weight.astype(np.float32)).astype(inp.dtype)
    return out, rstd


def fused_residual_rmsnorm_forward_np(inp1, inp2, weight, eps) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(residual, out, rstd): residual = inp1 + inp2 rounded to inp1's dtype, then its RMSNorm."""
    residual = (inp1.astype(np.float32) + inp2.astype(np.float32)).astype(inp1.dtype)
    out, rstd = rmsnorm_forward_np(residual, weight, eps)
    return residual, out, rstd


def rmsnorm_backward_np(dresidual, dout, inp, weight, rstd) -> tuple[np.ndarray, np.ndarray]:
    """(dinp, dweight_sum) for RMSNorm's backward.

    dinp = dresidual + rstd * (weight * dout - x * rstd * sum(weight * dout * x) * rstd / C), rounded
    to inp's dtype; dweight_sum (C,) fp32 = sum over rows of dout * x * rstd (accumulated in float64,
    the exact reference for the kernel's fixed-order fp32 sums). Shapes: (..., C), weight (C,), rstd (...).
    """
    C = inp.shape[-1]
    x, g = inp.astype(np.float32), dout.astype(np.float32)
    w, r = weight.astype(np.float32), rstd.astype(np.float32)[..., None]
    dot = np.sum(w * g * x, axis=-1, keepdims=True, dtype=np.float32)
    coef = dot * r / np.float32(C)
    xh = x * r
    dinp = (dresidual.astype(np.float32) + r * (w * g - xh * coef)).astype(inp.dtype)
    dweight = np.sum((g * xh).reshape(-1, C), axis=0, dtype=np.float64).astype(np.float32)
    return dinp, dweight


def rmsnorm_backward_partials_np(dout, inp, rstd) -> np.ndarray:
    """The scratch rmsnorm_backward leaves, (P, C) fp32 (rmsnorm_scratch_shape): how dweight's sum is grouped.

    Row (k * P + b) * warps + w belongs to warp w of block b; a warp adds dout * (x * rstd) over its rows
    in order of k, and block b's partial is its warps' sums added in warp order. dweight is then
    dweight + the partials added in order of b, rounded once. fp32 without fused multiply-adds: the host
    emulation's bits; the GPU may fuse a product into its add, an ulp apart. Shapes: (..., C), rstd (...).
    """
    C = inp.shape[-1]
    x, g = inp.reshape(-1, C).astype(np.float32), dout.reshape(-1, C).astype(np.float32)
    N, warps = x.shape[0], _backward_warps(C)
    P = _backward_blocks(N, C, inp.dtype.itemsize)
    terms = g * (x * rstd.reshape(-1, 1).astype(np.float32))
    rounds = ceil_div(N, P * warps)
    terms = np.concatenate(
        [terms, np.zeros((rounds * P * warps - N, C), np.float32)]
    )  # no row: +0, which keeps a sum's bits
    per_warp = np.zeros((P, warps, C), np.float32)
    for k in range(rounds):
        per_warp += terms[k * P * warps : (k + 1) * P * warps].reshape(P, warps, C)
    partials = per_warp[:, 0].copy()
    for w in range(1, warps):
        partials += per_warp[:, w]
    return partials


# ---- sizes --------------------------------------------------------------------------------
def _backward_warps(C: int) -> int:
    warps = min(_BWD_WARPS, _BWD_SMEM // (4 * C)) if C > 0 else _BWD_WARPS
    if warps < 1:
        raise ValueError(f"rmsnorm_backward: C = {C} is too large (at most {_BWD_SMEM // 4} channels)")
    return warps


def _backward_blocks(N: int, C: int, itemsize: int) -> int:
    """P = min(cap, ceil(N / warps)), the backward's block count = the scratch rows it writes.

    warps = min(8, 24576 // C) rows a block works on at once; cap = 132 for rows of at most 4096 bytes
    (the register variants: one block per SM of the H200, each living for many rows, a warp's next row
    loading while its current one computes; with 264 the H200 ran them 1-14% slower), 264 for wider rows
    (the looping kernel, which reads each row twice from global memory and needs two blocks per SM to
    hide that: with 132 it ran 45-75% slower). A function of (N, C, itemsize) only, not of the GPU
    (nor of which variants are compiled), which keeps dweight's bits fixed.
    """
    cap = _MAX_PARTIALS if C * itemsize <= _REG_ROW_BYTES else _MAX_PARTIALS_LOOPING
    return max(1, min(cap, ceil_div(N, _backward_warps(C))))


def rmsnorm_scratch_shape(N: int, C: int, dtype=None) -> tuple[int, int]:
    """Shape (P, C) of the fp32 scratch rmsnorm_backward needs for N rows of C channels of `dtype`.

    P is the backward's block count (_backward_blocks); without a dtype, the most any dtype needs
    (fp32's, the widest rows), enough for every call of that (N, C). rmsnorm_backward accepts a scratch
    of at least its P rows and writes only those.
    """
    itemsize = max(d.itemsize for d in FLOATS) if dtype is None else _dtype(dtype).itemsize
    return (_backward_blocks(N, C, itemsize), C)


# ---- launchers ----------------------------------------------------------------------------
def _check_common(what, inp, weight, abs_max):
    """(N, C) of inp after the shared checks on inp, weight and abs_max."""
    expect(inp, f"{what} inp", FLOATS)
    if inp.ndim < 1:
        raise ValueError(f"{what} inp: expected shape (..., C), got tensor {inp.name!r} {inp.shape}")
    C = inp.shape[-1]
    if C == 0:
        raise ValueError(f"{what} inp: tensor {inp.name!r} {inp.shape} has no channels")
    check_vector_width(what, "C", C, inp.dtype)
    expect(weight, f"{what} weight", inp.dtype, (C,))
    if abs_max is not None:
        expect(abs_max, f"{what} abs_max", FP32, (1,))
    return inp.nelem // C, C


def rmsnorm_forward(out, rstd, inp, weight, eps: float, abs_max=None, stream=None) -> None:
    """RMSNorm of each row: out = inp * rstd * weight, rstd = 1 / sqrt(mean(inp**2) + eps).

    Args:
        out: (N, C) (any leading dims), inp's dtype; written (=).
        rstd: (N,) fp32 (inp's leading dims); written, for the backward.
        inp: (N, C) fp32, bf16 or fp16; C a multiple of 16 bytes' worth of elements.
        weight: (C,) inp's dtype.
        eps: added to the mean square.
        abs_max: optional (1,) fp32; max-accumulates |out| (zero it first).
    NumPy equivalent: rmsnorm_forward_np.
    """
    N, C = _check_common("rmsnorm_forward", inp, weight, abs_max)
    expect(out, "rmsnorm_forward out", inp.dtype, inp.shape)
    expect(rstd, "rmsnorm_forward rstd", FP32, inp.shape[:-1])
    dev = same_device(out, rstd, inp, weight, abs_max)
    if dev.is_cpu:
        y, r = rmsnorm_forward_np(inp.array(), weight.array(), eps)
        write_twin_results(((out, y), (rstd, r)), abs_max, y)
        return
    if N == 0:
        return
    check_aligned("rmsnorm_forward", out, inp, weight)
    args = (out, rstd, inp, weight, abs_max, np.float32(eps), np.int32(N), np.int32(C))
    name = kernel_name("rmsnorm_forward", inp)
    launch(FAMILY, name, grid_size(dev, N, _FWD_WARPS), 32 * _FWD_WARPS, args, dev, stream, dependent=True)


def fused_residual_rmsnorm_forward(
    residual, out, rstd, inp1, inp2, weight, eps: float, abs_max=None, stream=None
) -> None:
    """residual = inp1 + inp2 (rounded to the storage dtype), then out = RMSNorm(residual).

    Args:
        residual: (N, C) (any leading dims), written (=); may alias inp1 or inp2.
        out: (N, C), written (=); may alias inp1 or inp2 too (the final norm writes over its input).
        rstd: (N,) fp32, written.
        inp1, inp2: (N, C) fp32, bf16 or fp16, all tensors the same dtype.
        weight: (C,); eps: added to the mean square.
        abs_max: optional (1,) fp32; max-accumulates |out|.
    NumPy equivalent: fused_residual_rmsnorm_forward_np.
    """
    N, C = _check_common("fused_residual_rmsnorm_forward", inp1, weight, abs_max)
    expect(inp2, "fused_residual_rmsnorm_forward inp2", inp1.dtype, inp1.shape)
    expect(residual, "fused_residual_rmsnorm_forward residual", inp1.dtype, inp1.shape)
    expect(out, "fused_residual_rmsnorm_forward out", inp1.dtype, inp1.shape)
    expect(rstd, "fused_residual_rmsnorm_forward rstd", FP32, inp1.shape[:-1])
    dev = same_device(residual, out, rstd, inp1, inp2, weight, abs_max)
    if dev.is_cpu:
        res, y, r = fused_residual_rmsnorm_forward_np(inp1.array(), inp2.array(), weight.array(), eps)
        write_twin_results(((residual, res), (out, y), (rstd, r)), abs_max, y)
        return
    if N == 0:
        return
    check_aligned("fused_residual_rmsnorm_forward", residual, out, inp1, inp2, weight)
    args = (residual, out, rstd, inp1, inp2, weight, abs_max, np.float32(eps), np.int32(N), np.int32(C))
    name = kernel_name("fused_residual_rmsnorm_forward", inp1)
    launch(FAMILY, name, grid_size(dev, N, _FWD_WARPS), 32 * _FWD_WARPS, args, dev, stream, dependent=True)


def rmsnorm_backward(dinp, dweight, scratch, dresidual, dout, inp, weight, rstd, abs_max=None, stream=None) -> None:
    """RMSNorm backward: dinp = dresidual + d(out)/d(inp) . dout; dweight += sum over rows.

    Args:
        dinp: (N, C) (any leading dims), inp's dtype; written (=). May alias dresidual (in place).
        dweight: (C,) inp's dtype; accumulated (+=), deterministically, rounded once.
        scratch: fp32 (P', C), P' at least rmsnorm_scratch_shape(N, C, inp.dtype)[0] (without the dtype:
            enough for any); its first P rows are overwritten.
        dresidual: (N, C), the gradient already flowing through the residual stream.
        dout: (N, C) gradient of out; inp: (N, C) the forward's input; weight: (C,).
        rstd: (N,) fp32 from the forward.
        abs_max: optional (1,) fp32; max-accumulates |dinp|.
    NumPy equivalent: rmsnorm_backward_np.
    """
    N, C = _check_common("rmsnorm_backward", inp, weight, abs_max)
    for name, t in (("dinp", dinp), ("dresidual", dresidual), ("dout", dout)):
        expect(t, f"rmsnorm_backward {name}", inp.dtype, inp.shape)
    expect(dweight, "rmsnorm_backward dweight", inp.dtype, (C,))
    expect(rstd, "rmsnorm_backward rstd", FP32, inp.shape[:-1])
    P = rmsnorm_scratch_shape(N, C, inp.dtype)[0]
    expect(scratch, "rmsnorm_backward scratch", FP32, (None, C))
    if scratch.shape[0] < P:
        raise ValueError(f"rmsnorm_backward scratch: tensor {scratch.name!r} {scratch.shape} has fewer than {P} rows")
    dev = same_device(dinp, dweight, scratch, dresidual, dout, inp, weight, rstd, abs_max)
    if dev.is_cpu:
        dx, dw = rmsnorm_backward_np(dresidual.array(), dout.array(), inp.array(), weight.array(), rstd.array())
        dw = (dweight.array().astype(np.float32) + dw).astype(dweight.dtype.np)
        write_twin_results(((dinp, dx), (dweight, dw)), abs_max, dx)
        return
    if N == 0:
        return
    check_aligned("rmsnorm_backward", dinp, dresidual, dout, inp, weight)
    warps = _backward_warps(C)
    args = (dinp, scratch, dresidual, dout, inp, weight, rstd, abs_max, np.int32(N), np.int32(C))
    lane_vectors = ceil_div(C * inp.dtype.itemsize, 16 * 32)
    v = next((v for v in _REG_VECTORS if lane_vectors <= v), 0)  # same bits either way; v > 0 reads rows once
    if v:  # at most 8 * 2 * 3 * 2048 * 2 bytes (v8, bf16) = 192 KiB of staged rows; the partials reuse them
        smem = max(4 * warps * C, warps * _BWD_STAGES * 3 * C * inp.dtype.itemsize)
        name = kernel_name(f"rmsnorm_backward_v{v}", inp)
        launch(FAMILY, name, P, 32 * warps, args, dev, stream, shared_mem=smem, dependent=True)
    else:
        name, smem = kernel_name("rmsnorm_backward", inp), 4 * warps * C
        launch(FAMILY, name, P, 32 * warps, args, dev, stream, shared_mem=smem, dependent=True)
    args = (dweight, scratch, np.int32(P), np.int32(C))
    name = kernel_name("rmsnorm_backward_dweight", inp)
    launch(FAMILY, name, ceil_div(C, _DW_COLS), _DW_THREADS, args, dev, stream, dependent=True)
