"""Decode GEMV: out (b, N) = prologue(x) · Wᵀ for b = 1..64 rows (raw_kernels/gemv.cu).

At decode time a linear layer multiplies a few activation rows by a weight that is read once from
HBM, so the kernel is built for bandwidth: 16-byte weight loads, eight warps per block, split-K
inside the block where N is small, the input staged once per block in shared memory. Fused around
the dot products: an RMSNorm or SwiGLU prologue on the input, and bias and residual epilogues.
Weights are the model's own (bf16 or fp32) or per-row E4M3 with fp32 row scales (W8A16, made by
`quantize_rows`). Rounding points follow the training forward, so decode logits equal full-forward
logits: fp32 accumulation rounded once to out's dtype, a bias added after that rounding and rounded
again (cuBLASLt's epilogue order), a residual as round(residual + round(y)).

Every sum runs in an order fixed by (N, K) alone (the K split is chosen from the shape, not from
the GPU or from b), so results are deterministic and a row's output does not depend on the batch.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_aligned, check_vector_width, expect, overlaps, same_device
from ..dtypes import BF16, FP8_E4M3, FP32, INT64
from ._build import ceil_div, grid_size, kernel_name, launch
from .activations import activation_forward_np
from .rmsnorm import rmsnorm_forward_np

FAMILY = "gemv"
MODEL = (FP32, BF16)  # model dtypes: x, norm_weight and bias; also the weight unless it is e4m3
ACTS = (None, "swiglu")

_WARPS, _ROWS = 8, 2  # warps per block, weight rows per warp (WARPS, R in gemv.cu); the split counts tiles of _ROWS
_WIDE_ROWS = 4  # weight rows per warp of the single-row E4M3 gemv_..._1_r4 kernels (_rows)
_TILES = (1, 4, 8)  # input rows per pass (BT) with a compiled kernel
_SPLITS = (1, 2, 4, 8)  # warps sharing a row group, each reducing 1/S of K
# The K split's limits (_split), constants so that the bits do not depend on the GPU:
_TILES_MAX = 528  # tiles at most (4 per SM on the H200's 132 SMs)
_WAVE = 396  # the single-row grid's one wave there (_RESIDENT[1] = 3 blocks per SM), which a split may pass
_SHORT_ROUNDS = 2  # only while a lane's slice takes more than this many rounds of _U vectors
_U = 4  # 16-byte weight vectors per row and lane in flight (U in gemv.cuh)
_SMEM_PASS = 120 * 1024  # staged input rows per pass: BT = 4 still fits at K = 14336 bf16
_SMEM_ROW = 200 * 1024  # one single-row pass must fit (227 KB a block, less static shared memory)
_PRO_NONE, _PRO_NORM, _PRO_SWIGLU, _PRO_NORM_STAGED = 0, 1, 2, 3  # enum Prologue in gemv.cuh
_DUAL_NONE, _DUAL_PAIR, _DUAL_SWIGLU = 0, 1, 2  # enum Dual in gemv.cuh
_RESIDENT = {1: 3, 4: 2, 8: 2}  # blocks per SM that the kernel of each BT is compiled for (__launch_bounds__)
_LONG_WAVE = 8  # tiles a block past which the grid takes two waves (_grid)
_SM_SHARED = 228 * 1024  # shared memory per SM (sm_90); each block also takes 1 KB reserved + its static arrays
# Fixed-point accumulators (gemv.cuh): a partial p is added as round(p * 2^ACC_SHIFT); a row holds K values,
# a flag word and a pad word. A partial at or past ACC_LIMIT in magnitude (or not finite) sets the flag.
ACC_SHIFT = 28
ACC_PAD = 2
ACC_LIMIT = 2.0**23


# ---- fixed-point accumulators --------------------------------------------------------------
def acc_shape(b: int, K: int) -> tuple[int, int]:
    """Shape (b, K + ACC_PAD) int64 of an accumulator for b rows of K values, zeroed before its first
    partial: the decode arm "ksplit" sums a layer's output split over its input into one (gemv.cuh)."""
    return (b, K + ACC_PAD)


def acc_fix_np(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q, bad): the int64 fixed-point values of fp32 partials p (round half to even), 0 where a partial
    is not finite or |p| >= ACC_LIMIT, and `bad` there (acc_fix in gemv.cuh)."""
    p = np.asarray(p, np.float32)
    with np.errstate(invalid="ignore"):
        bad = ~(np.abs(p) < np.float32(ACC_LIMIT))
    q = np.rint(np.where(bad, 0, p).astype(np.float64) * 2.0**ACC_SHIFT).astype(np.int64)
    return q, bad


def acc_sum_np(parts: np.ndarray, row_scale=None) -> np.ndarray:
    """(b, K + ACC_PAD) int64: a zeroed accumulator after the fp32 partial outputs parts (b, P, K), each
    times row_scale (K,) fp32 when given, are added: the sum of their fixed-point values (acc_fix_np), and
    the flag where one of them could overflow."""
    parts = np.asarray(parts, np.float32)
    if row_scale is not None:
        parts = (parts * np.asarray(row_scale, np.float32)).astype(np.float32)
    q, bad = acc_fix_np(parts)
    b, _, K = parts.shape
    acc = np.zeros(acc_shape(b, K), np.int64)
    acc[:, :K] = q.sum(axis=1)
    acc[:, K] = bad.any(axis=(1, 2))
    return acc


def acc_values_np(acc: np.ndarray) -> np.ndarray:
    """(b, K) fp32 values of accumulator rows (b, K + ACC_PAD): float(sum) * 2^-ACC_SHIFT, rounded once;
    NaN for a flagged row (acc_read in gemv.cuh)."""
    acc = np.asarray(acc)
    K = acc.shape[-1] - ACC_PAD
    y = (acc[..., :K].astype(np.float32) * np.float32(2.0**-ACC_SHIFT)).astype(np.float32)
    return np.where(acc[..., K : K + 1] != 0, np.float32(np.nan), y)


def acc_input_np(x: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """x' = round(x + round(y)) in x's dtype, y = acc_values_np(acc): a residual with the accumulator
    it misses added as a residual epilogue adds a layer's output."""
    y = acc_values_np(acc).astype(x.dtype).astype(np.float32)
    return (x.astype(np.float32) + y).astype(x.dtype)


# ---- NumPy twins --------------------------------------------------------------------------
def quantize_rows_np(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(w8, w_scale) for w (N, K): per-row E4M3 with W ≈ w8 * w_scale[:, None].

    w_scale (N,) fp32 = max|row| / 448, or 1 for an all-zero row (a non-finite row gives a
    non-finite scale, so a GEMV over it is non-finite too); w8 = e4m3(clip(w / w_scale, ±448)),
    rounded to nearest even, all in fp32.
    """
    w32 = w.astype(np.float32)
    amax = np.max(np.abs(w32), axis=1, initial=np.float32(0))
    scale = np.where(amax == 0, np.float32(1), amax / np.float32(448)).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = w32 / scale[:, None]
    return np.clip(q, -FP8_E4M3.fp8_max, FP8_E4M3.fp8_max).astype(FP8_E4M3.np), scale


def _input_np(x, norm_weight, eps, act):
    """The GEMV input, rounded to x's dtype as the training forward rounds it."""
    if act == "swiglu":
        return activation_forward_np(x, "swiglu")
    if norm_weight is not None:
        return rmsnorm_forward_np(x, norm_weight, eps)[0]
    return x


def gemv_np(x, w, w_scale=None, bias=None, residual=None, norm_weight=None, eps=1e-6, act=None, out_dtype=None):
    """out (b, N) of `gemv` from NumPy arrays; out_dtype defaults to x's dtype.

    NumPy equivalent: `y = (xin @ w.T * w_scale).astype(o); y = (y + bias).astype(o);
    out = (residual + y).astype(o)`, fp32 math, xin = x, rmsnorm(x) or swiglu(x) in x's dtype.
    """
    out_dtype = np.dtype(x.dtype if out_dtype is None else out_dtype)
    y = _input_np(x, norm_weight, eps, act).astype(np.float32) @ w.astype(np.float32).T
    if w_scale is not None:
        y = y * w_scale.astype(np.float32)
    y = y.astype(out_dtype)
    if bias is not None:
        y = (y.astype(np.float32) + bias.astype(np.float32)).astype(out_dtype)
    if residual is not None:
        y = (residual.astype(np.float32) + y.astype(np.float32)).astype(out_dtype)
    return y


def gemv_dual_np(x, w_up, w_scale=None, norm_weight=None, eps=1e-6, out_dtype=None, act=None):
    """out (b, 2H) = [gate | up] of `gemv_dual`: the GEMV over the packed (2H, K) weight; with
    act="swiglu", out (b, H) = activation_forward_np of that rounded [gate | up]."""
    y = gemv_np(x, w_up, w_scale, norm_weight=norm_weight, eps=eps, out_dtype=out_dtype)
    return y if act is None else activation_forward_np(y, act)


# ---- sizes --------------------------------------------------------------------------------
def _tile(b: int, K: int, itemsize: int) -> int:
    """Input rows per pass: the smallest compiled tile that holds b (at most 8) within _SMEM_PASS."""
    fits = [t for t in _TILES if t * K * itemsize <= _SMEM_PASS] or [1]
    return next((t for t in fits if t >= b), fits[-1])


def _staged_bytes(bt: int, K: int, itemsize: int, norm: bool) -> int:
    """Dynamic shared memory of one pass's staged input. The single-row kernels stage it as fp32, so that
    the dot products do not convert each input once per weight row (the multi-row kernels keep the model
    dtype, for room), and a norm prologue then also keeps x's raw rows there to normalise from."""
    xs = 4 if bt == 1 else itemsize
    return bt * K * (xs + (itemsize if norm and xs != itemsize else 0))


def _split(rows: int, vectors: int) -> int:
    """K-slices per row group: double them while a slice keeps 32 vectors and the tiles stay within
    _TILES_MAX, and beyond one wave of blocks (_WAVE) only while a lane's slice is long.

    A decode-sized GEMV is about one tile per resident block, so small N (4864 -> 896) needs the split
    to fill the GPU. More tiles than the wave leave a tail of blocks working a second tile: where a tile
    is a round or two of loads a lane, that tail is a whole extra step on the critical path (4864 -> 896
    at S = 8: 448 tiles; the 0.5B bf16 decode step 0.619 ms/token there, 0.595 at S = 4, and the 1.5B
    qkv GEMV at S = 2 rather than 4: 1.341 -> 1.282; BENCHMARKS fourteenth session, call 6), while a
    long slice (14336 -> 4096: 14 rounds at S = 1) is better split on into a short tail than left to
    two thirds of the wave (38.7 against 32.0 µs at S = 2, call 7).
    """
    s = 1
    while s < _SPLITS[-1] and vectors // (2 * s) >= 32:
        tiles = ceil_div(rows, _ROWS * _WARPS // (2 * s))
        if tiles > _TILES_MAX or (tiles > _WAVE and ceil_div(vectors, s * 32 * _U) <= _SHORT_ROUNDS):
            break
        s *= 2
    return s


def _rows(N: int, bt: int, s: int, fp8: bool) -> int:
    """Weight rows per warp: _WIDE_ROWS (one vector a row in flight) for a single-row GEMV over E4M3
    weights whose tiles of _ROWS would pass one wave (_WAVE), so that fewer blocks work a second tile
    (the 0.5B gate/up projection, 9728 rows: 608 tiles of 2 rows a warp, 304 of 4). Measured on the H200
    (BENCHMARKS fifteenth session, call 2): 0.5B FP8 decode 0.572 -> 0.564 ms/token, 1.5B unchanged; over
    bf16 weights four rows a warp were slower (U = 2: 0.600 -> 0.620; U = 1: 0.636), so those keep two.
    The sums do not depend on the rows (gemv.cuh), so neither do the bits."""
    wide = fp8 and bt == 1 and ceil_div(N, _ROWS * _WARPS // s) > _WAVE
    return _WIDE_ROWS if wide else _ROWS


def _grid(dev, tiles: int, bt: int, smem: int) -> int:
    """One resident wave, where blocks take tiles round-robin and each stages (and normalises) its input
    once; a second wave of blocks would restage it (the bf16 gate/up's 608 tiles on 608 blocks: +2.3 µs a
    layer). For a single input row past _LONG_WAVE tiles a block (the FP8 LM head's 12), the blocks'
    share of slow DRAM replies makes the launch end with its slowest block (an 8.7 µs tail); two waves
    of half as many tiles let the hardware hand the second wave's blocks to the SMs that finish first
    (tools/PERF_NOTES.md 32)."""
    per_sm = min(_RESIDENT[bt], _SM_SHARED // (smem + 2048))
    wave = dev.num_sms * max(1, per_sm)
    return max(1, min(tiles, 2 * wave if bt == 1 and tiles > _LONG_WAVE * wave else wave))


# ---- launchers ----------------------------------------------------------------------------
def check_row_scales(what: str, label: str, w, scale) -> None:
    """ValueError unless an e4m3 weight w (N, K) comes with its (N,) fp32 row scales (quantize_rows) and a
    model-dtype weight with none: the decode launchers' W8A16 rule."""
    if w.dtype.is_fp8:
        if scale is None:
            raise ValueError(f"{what} {label}: e4m3 weight {w.name!r} needs its ({w.shape[0]},) fp32 row scales "
                             "(quantize_rows)")  # fmt: skip
        expect(scale, f"{what} {label}", FP32, (w.shape[0],))
    elif scale is not None:
        raise ValueError(f"{what} {label}: only e4m3 weights take row scales, but {w.name!r} is {w.dtype}")


def _check(what, out, x, w, w_scale, bias, residual, norm_weight, act, split, dual=_DUAL_NONE):
    """(b, K, N, device) after every boundary check gemv and gemv_dual share (`dual`: gemv_dual's
    output, [gate | up] or its SwiGLU)."""
    expect(x, f"{what} x", MODEL, (None, None))
    if act not in ACTS:
        raise ValueError(f"{what}: act={act!r} is not supported; use None or 'swiglu'")
    if act is not None and norm_weight is not None:
        raise ValueError(
            f"{what}: norm_weight and act={act!r} cannot be combined: the RMSNorm prologue feeds the "
            "q/k/v and gate/up projections, the SwiGLU prologue the down projection"
        )
    b, width = x.shape
    if act == "swiglu" and width % 2:
        raise ValueError(f"{what} x: act='swiglu' needs x (b, 2K) = [gate | up], got tensor {x.name!r} {x.shape}")
    K = width // 2 if act else width
    expect(w, f"{what} w", (x.dtype, FP8_E4M3), (None, K))
    N = w.shape[0]
    if K == 0:
        raise ValueError(f"{what}: K = 0; x {x.name!r} {x.shape} has no input columns")
    check_vector_width(what, "K", K, w.dtype)
    row = _staged_bytes(1, K, x.dtype.itemsize, norm_weight is not None)
    if row > _SMEM_ROW:
        raise ValueError(
            f"{what}: K = {K} is too large: one input row is staged in shared memory as fp32 (with its "
            f"{x.dtype} copy for an RMSNorm prologue), at most {_SMEM_ROW * K // row} values here"
        )
    check_row_scales(what, "w_scale", w, w_scale)
    if dual and N % 2:
        raise ValueError(f"{what} w_up: expected (2H, K) = [gate | up], got tensor {w.name!r} {w.shape}")
    if dual == _DUAL_SWIGLU:  # SiLU·mul rounds to the model dtype, as swiglu_forward does
        expect(out, f"{what} out", x.dtype, (b, N // 2))
    else:
        expect(out, f"{what} out", (x.dtype, FP32), (b, N))
    if bias is not None:
        expect(bias, f"{what} bias", x.dtype, (N,))
    if residual is not None:
        expect(residual, f"{what} residual", out.dtype, (b, N))
        if overlaps(out, residual) and residual.offset != out.offset:
            raise ValueError(
                f"{what} residual: tensor {residual.name!r} partly overlaps out; it may only be out itself"
            )
    if norm_weight is not None:
        expect(norm_weight, f"{what} norm_weight", x.dtype, (K,))
    for t in (x, w, w_scale, bias, norm_weight):
        if t is not None and overlaps(out, t):
            raise ValueError(f"{what} out: tensor {out.name!r} overlaps input {t.name!r}; only residual may alias out")
    if split not in (None, *_SPLITS):
        raise ValueError(f"{what}: split={split!r}; choose None (by shape) or one of {_SPLITS}")
    dev = same_device(out, x, w, w_scale, bias, residual, norm_weight)
    check_aligned(what, x, w, norm_weight)
    return b, K, N, dev


def _check_acc(what, x_acc, x_out, x, b, K, norm_weight, *others) -> None:
    """The accumulator prologue's operands: x_acc (b, K + ACC_PAD) int64 beside an RMSNorm prologue, and
    x_out (b, K) in x's dtype beside x_acc, overlapping nothing else."""
    if x_acc is None:
        if x_out is not None:
            raise ValueError(f"{what} x_out: tensor {x_out.name!r} is written only with x_acc (x plus the accumulator)")
        return
    if norm_weight is None:
        raise ValueError(f"{what} x_acc: accumulator {x_acc.name!r} is added in the RMSNorm prologue; pass norm_weight")
    expect(x_acc, f"{what} x_acc", INT64, acc_shape(b, K))
    same_device(x, x_acc, x_out)
    check_aligned(what, x_acc, x_out)
    if x_out is not None:
        expect(x_out, f"{what} x_out", x.dtype, (b, K))
        for t in (x, x_acc, norm_weight, *others):
            if t is not None and overlaps(x_out, t):
                raise ValueError(f"{what} x_out: tensor {x_out.name!r} overlaps {t.name!r}")


def _launch(out, x, w, w_scale, bias, residual, norm_weight, eps, prologue, dual, b, K, N, split, dev, stream,
            x_acc=None, x_out=None):  # fmt: skip
    bt = _tile(b, K, x.dtype.itemsize)
    s = split or _split(N, K * w.dtype.itemsize // 16)
    rows = _rows(N, bt, s, w.dtype.is_fp8)
    name = f"{kernel_name('gemv', x, w, out)}_{bt}" + ("_r4" if rows == _WIDE_ROWS else "")
    smem = _staged_bytes(bt, K, x.dtype.itemsize, prologue == _PRO_NORM)
    if prologue == _PRO_NORM and smem + K * x.dtype.itemsize <= _SMEM_ROW:
        prologue, smem = _PRO_NORM_STAGED, smem + K * x.dtype.itemsize  # the norm weight, staged before the wait
    args = (out, x, w, w_scale, bias, residual, norm_weight, x_acc, x_out, np.float32(eps), np.int32(prologue),
            np.int32(dual), np.int32(b), np.int32(K), np.int32(N), np.int32(s))  # fmt: skip
    launch(FAMILY, name, _grid(dev, ceil_div(N, rows * _WARPS // s), bt, smem), 32 * _WARPS, args, dev, stream,
           shared_mem=smem, dependent=True)  # fmt: skip


def gemv(out, x, w, *, w_scale=None, bias=None, residual=None, norm_weight=None, eps=1e-6, act=None, split=None,
         x_acc=None, x_out=None, stream=None) -> None:  # fmt: skip
    """out = [residual +] xin · Wᵀ [+ bias], one decode step of a linear layer.

    Args:
        out: (b, N) x's dtype, or fp32 (LM-head logits); written (=).
        x: (b, K) fp32 or bf16, the model dtype; (b, 2K) = [gate | up] with act="swiglu".
        w: (N, K) x's dtype, or e4m3 with w_scale (W8A16). K a multiple of 16 bytes of w.
        w_scale: (N,) fp32 row scales of an e4m3 w (W ≈ w * w_scale[:, None]), from quantize_rows.
        bias: (N,) x's dtype, added after the product is rounded to out's dtype, then rounded again.
        residual: (b, N) out's dtype: out = round(residual + round(y)); may be out itself.
        norm_weight: (K,) x's dtype: xin = round(x * rstd * norm_weight), rstd = 1/sqrt(mean(x²) + eps),
            rounded as rmsnorm_forward rounds it.
        eps: the RMSNorm epsilon.
        act: None, or "swiglu": xin = round(silu(gate) * up), as activations.swiglu_forward.
        split: K-slices per row (1, 2, 4, 8) for tuning; None picks it from (N, K).
        x_acc: (b, K + ACC_PAD) int64, with norm_weight only: a fixed-point accumulator (acc_shape) of
            what x misses; the RMSNorm prologue then normalises x' = round(x + round(y)) (acc_input_np).
        x_out: (b, K) x's dtype, with x_acc: written (=) with x' (one block writes it; the residual the
            layer after reads). Must not overlap x, out or the other operands.
    Raises ValueError for a dtype, shape, alignment or aliasing the kernel does not take, and for
    norm_weight together with act. NumPy equivalent: gemv_np (on acc_input_np(x, x_acc)).
    """
    b, K, N, dev = _check("gemv", out, x, w, w_scale, bias, residual, norm_weight, act, split)
    _check_acc("gemv", x_acc, x_out, x, b, K, norm_weight, out, w, w_scale, bias, residual)
    if dev.is_cpu:
        xin = x.array() if x_acc is None else acc_input_np(x.array(), x_acc.array())
        if x_out is not None:
            x_out.array()[...] = xin
        out.array()[...] = gemv_np(
            xin, w.array(), None if w_scale is None else w_scale.array(), None if bias is None else bias.array(),
            None if residual is None else residual.array(), None if norm_weight is None else norm_weight.array(),
            eps, act, out.dtype.np,
        )  # fmt: skip
        return
    if b == 0 or N == 0:
        return
    prologue = _PRO_SWIGLU if act else _PRO_NORM if norm_weight is not None else _PRO_NONE
    _launch(out, x, w, w_scale, bias, residual, norm_weight, eps, prologue, _DUAL_NONE, b, K, N, split, dev, stream,
            x_acc, x_out)  # fmt: skip


def gemv_dual(out, x, w_up, *, w_scale=None, norm_weight=None, eps=1e-6, act=None, split=None,
              stream=None) -> None:  # fmt: skip
    """out = [gate | up] = xin · w_upᵀ for the packed (2H, K) [gate | up] weight, in one pass.

    A warp reads gate row j and up row j together, so with act="swiglu" the epilogue writes
    SiLU(gate) * up straight away: out (b, H) in x's dtype, the values swiglu_forward makes of the
    rounded [gate | up], and the down projection after it needs no SwiGLU prologue (each of its
    blocks would recompute all H of them). Args as gemv: out (b, 2H) x's dtype or fp32, x (b, K),
    w_up (2H, K) x's dtype or e4m3 with w_scale (2H,), norm_weight (K,) for the fused RMSNorm.
    Raises ValueError as gemv, and for an odd number of weight rows.
    NumPy equivalent: gemv_dual_np.
    """
    if act not in ACTS:
        raise ValueError(f"gemv_dual: act={act!r} is not supported; use None or 'swiglu'")
    dual = _DUAL_SWIGLU if act else _DUAL_PAIR
    b, K, N, dev = _check("gemv_dual", out, x, w_up, w_scale, None, None, norm_weight, None, split, dual)
    if dev.is_cpu:
        out.array()[...] = gemv_dual_np(
            x.array(), w_up.array(), None if w_scale is None else w_scale.array(),
            None if norm_weight is None else norm_weight.array(), eps, out.dtype.np, act,
        )  # fmt: skip
        return
    if b == 0 or N == 0:
        return
    prologue = _PRO_NORM if norm_weight is not None else _PRO_NONE
    _launch(out, x, w_up, w_scale, None, None, norm_weight, eps, prologue, dual, b, K, N, split, dev, stream)


def quantize_rows(w8, w_scale, w, stream=None) -> None:
    """Per-row E4M3 of a weight, run once at load: W ≈ w8 * w_scale[:, None].

    Args:
        w8: (N, K) e4m3; written (=).
        w_scale: (N,) fp32; written (=): max|row| / 448, or 1 for an all-zero row.
        w: (N, K) fp32 or bf16.
    NumPy equivalent: quantize_rows_np.
    """
    expect(w, "quantize_rows w", MODEL, (None, None))
    N, K = w.shape
    expect(w8, "quantize_rows w8", FP8_E4M3, (N, K))
    expect(w_scale, "quantize_rows w_scale", FP32, (N,))
    dev = same_device(w8, w_scale, w)
    if dev.is_cpu:
        w8.array()[...], w_scale.array()[...] = quantize_rows_np(w.array())
        return
    if N == 0 or K == 0:
        return
    args = (w8, w_scale, w, np.int32(N), np.int32(K))
    launch(FAMILY, kernel_name("quantize_rows", w), grid_size(dev, N, _WARPS), 32 * _WARPS, args, dev, stream)
