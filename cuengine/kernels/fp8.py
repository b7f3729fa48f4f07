"""FP8 per-tensor scaling: abs-max, quantise, quantise+transpose, both copies at once, transpose,
bias gradient.

Hopper FP8 GEMMs are TN only, so the backward needs transposed FP8 copies; the
quantise and the transpose are fused so the bf16 source is read once, and `quantize_dual`
writes the plain and the transposed copy from that one read (a gradient, or a weight after its
update, needs both). Scales
follow `cuengine.tensor.stats_values`: scale = fp8_max / abs_max, scale_inv =
1 / scale, and an abs-max of 0 (or a non-finite one) gives 1 and 1.
"""

from __future__ import annotations

import math

import numpy as np

from .. import _checks
from ..dtypes import BF16, FP8_E4M3, FP8_E5M2, FP32
from ..tensor import STAT_ABS_MAX, STAT_SCALE, STAT_SCALE_INV
from . import _build

_BITS = {1: np.uint8, 2: np.uint16}
_BIAS_ROWS = 128  # the fewest rows per partial sum in bias_backward (BIAS_ROWS in fp8.cu); sizes scratch
_BIAS_BLOCKS = 528  # bias_partial blocks to aim for: one wave of 4 per SM (__launch_bounds__(256, 4)) on 132 SMs
_TILE_C = 64  # columns of inp per transpose tile (TC in fp8.cu)


def _amax_slot(abs_max, out, what: str):
    if out.stats is None:
        raise ValueError(f"{what}: out {out.name!r} ({out.dtype} {out.shape}) carries no FP8 stats slot")
    if abs_max is None:
        return out.abs_max
    return _checks.expect(abs_max, f"{what}: abs_max", dtype=FP32, shape=(1,))


def _rows_cols(inp, what: str) -> tuple[int, int]:
    if inp.ndim < 1 or inp.shape[-1] == 0:
        raise ValueError(f"{what}: inp {inp.name!r} needs a non-empty last dimension, got {inp.shape}")
    return inp.nelem // inp.shape[-1], inp.shape[-1]


# ---- twins --------------------------------------------------------------------------------------
def abs_max_reference(x: np.ndarray) -> np.float32:
    """max(|x|) in fp32; NaN if any element is NaN, 0 for an empty array."""
    if x.size == 0:
        return np.float32(0)
    return np.max(np.abs(x.astype(np.float32)))


def fp8_scales(abs_max, fp8_dtype) -> tuple[np.float32, np.float32]:
    """(scale, scale_inv) for an abs-max: fp8_max/abs_max and 1/scale, or (1, 1) when the
    abs-max is 0 or not finite (the kernels use the same rule)."""
    amax = np.float32(abs_max)
    if amax > 0 and np.isfinite(amax):
        scale = np.float32(fp8_dtype.fp8_max) / amax
        return scale, np.float32(1) / scale
    return np.float32(1), np.float32(1)


def quantize_reference(x: np.ndarray, abs_max, fp8_dtype) -> tuple[np.ndarray, np.ndarray]:
    """The NumPy twin of quantize_with_abs_max: (values, stats [abs_max, scale, scale_inv]).

    values = clip(x * scale, -fp8_max, fp8_max) rounded to nearest even (SATFINITE), computed
    in fp32 and shaped like x.
    """
    scale, scale_inv = fp8_scales(abs_max, fp8_dtype)
    lim = np.float32(fp8_dtype.fp8_max)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.clip(x.astype(np.float32) * scale, -lim, lim).astype(fp8_dtype.np)
    return q, np.array([abs_max, scale, scale_inv], np.float32)


def bias_backward_reference(dbias: np.ndarray, dout: np.ndarray) -> np.ndarray:
    """dbias + column sums of dout (N, OC), summed in fp32, rounded once to dbias's dtype."""
    s = dout.reshape(-1, dbias.shape[0]).astype(np.float32).sum(axis=0, dtype=np.float32)
    return (dbias.astype(np.float32) + s).astype(dbias.dtype)


# ---- launchers ----------------------------------------------------------------------------------
def abs_max(amax, inp, stream=None) -> None:
    """Max-accumulate |inp| into `amax`: amax = max(amax, max|inp|). Zero amax first.

    Args:
        amax: (1,) fp32 slot, e.g. `t.abs_max` of an FP8 tensor; a NaN in inp makes it NaN.
        inp: any shape, fp32 or bf16.

    NumPy equivalent: `amax[0] = np.maximum(amax[0], abs_max_reference(inp))`.
    """
    _checks.expect(amax, "abs_max: amax", dtype=FP32, shape=(1,))  # (1,)
    _checks.expect(inp, "abs_max: inp", dtype=(FP32, BF16))  # (...)
    dev = _checks.same_device(amax, inp)
    n = inp.nelem
    if n == 0:
        return
    if dev.is_cpu:
        a = amax.array()
        a[0] = np.maximum(a[0], abs_max_reference(inp.array()))
        return
    vec = _checks.is_aligned(inp)
    grid = _build.grid_size(dev, n, 512 * (8 if vec else 1), 4)
    name = _build.kernel_name("abs_max", inp, scalar=not vec)
    _build.launch("fp8", name, grid, 512, (amax, inp, np.int64(n)), dev, stream)


def _write_twin_stats(out, stats, src) -> None:
    """The cpu path's stats: scale and scale_inv, and abs_max unless out's own slot was the source."""
    st = out.stats.array()
    st[STAT_SCALE], st[STAT_SCALE_INV] = stats[1:]
    if src.ptr != out.abs_max.ptr:
        st[STAT_ABS_MAX] = stats[0]


def quantize_with_abs_max(out, inp, abs_max=None, stream=None) -> None:
    """Quantise `inp` to FP8 with per-tensor scaling, writing out's stats.

    Args:
        out: FP8 (e4m3 or e5m2) with a stats slot, as many elements as inp (any shape).
            Gets the values and [abs_max, scale, scale_inv].
        inp: fp32 or bf16.
        abs_max: (1,) fp32 slot holding max|inp| (filled by the producer), or None to use
            out.abs_max, which the caller or the producer filled.

    NumPy equivalent: `quantize_reference(inp, abs_max, out.dtype)`.
    """
    _checks.expect(out, "quantize_with_abs_max: out", dtype=(FP8_E4M3, FP8_E5M2))  # (...)
    _checks.expect(inp, "quantize_with_abs_max: inp", dtype=(FP32, BF16))  # (...)
    src = _amax_slot(abs_max, out, "quantize_with_abs_max")  # (1,)
    if out.nelem != inp.nelem:
        raise ValueError(
            f"quantize_with_abs_max: out {out.name!r} {out.shape} and inp {inp.name!r} {inp.shape} "
            "hold different numbers of elements"
        )
    dev = _checks.same_device(out, inp, src)
    n = inp.nelem
    if n == 0:
        return
    if dev.is_cpu:
        q, stats = quantize_reference(inp.array(), src.array()[0], out.dtype)
        out.array()[...] = q.reshape(out.shape)
        _write_twin_stats(out, stats, src)
        return
    vec = _checks.is_aligned(out, inp)
    name = _build.kernel_name("quantize", inp, out, scalar=not vec)
    grid = _build.grid_size(dev, n, 256 * (8 if vec else 1))
    _build.launch("fp8", name, grid, 256, (out, out.stats, src, inp, np.int64(n)), dev, stream)


def _transpose_grid(n: int, c: int, itemsize: int, what: str) -> tuple[int, int]:
    rows_per_tile = 32 * (4 // itemsize)
    grid = (_build.ceil_div(n, rows_per_tile), _build.ceil_div(c, _TILE_C))
    if grid[1] > 65535:
        raise ValueError(f"{what}: {c} columns exceed the {65535 * _TILE_C} a transpose launch covers")
    return grid


def quantize_and_transpose(out, inp, abs_max=None, stream=None) -> None:
    """Quantise `inp` (N, C) to FP8 and write it transposed, (C, N), in one pass.

    Args:
        out: (C, N) FP8 (e4m3 or e5m2) with a stats slot; gets values and stats.
        inp: (..., C) fp32 or bf16; leading dimensions are flattened to N.
        abs_max: as in `quantize_with_abs_max`.

    NumPy equivalent: `quantize_reference(inp.reshape(-1, C), abs_max, out.dtype)` transposed.
    """
    what = "quantize_and_transpose"
    _checks.expect(inp, f"{what}: inp", dtype=(FP32, BF16))  # (N, C)
    n, c = _rows_cols(inp, what)
    _checks.expect(out, f"{what}: out", dtype=(FP8_E4M3, FP8_E5M2), shape=(c, n))  # (C, N)
    src = _amax_slot(abs_max, out, what)  # (1,)
    dev = _checks.same_device(out, inp, src)
    if n == 0:
        return
    if dev.is_cpu:
        q, stats = quantize_reference(inp.array().reshape(n, c), src.array()[0], out.dtype)
        out.array()[...] = q.T
        _write_twin_stats(out, stats, src)
        return
    vec = c % 8 == 0 and n % 16 == 0 and _checks.is_aligned(out, inp)
    name = _build.kernel_name("quantize_transpose", inp, out, scalar=not vec)
    grid = _transpose_grid(n, c, 1, what)
    _build.launch("fp8", name, grid, 256, (out, out.stats, src, inp, np.int32(n), np.int32(c)), dev, stream)


def quantize_dual(out, out_tp, inp, abs_max=None, stream=None) -> None:
    """Quantise `inp` (N, C) to FP8 once and store it twice: `out` (N, C) and `out_tp` (C, N).

    The values are bit for bit those of `quantize_with_abs_max(out, inp)` followed by
    `transpose(out_tp, out)`, in one pass over inp (its bf16 is read once, and out is not read
    back), for the backward's dout and the weights' FP8 copies, which the TN-only FP8 GEMMs need
    both ways round.

    Args:
        out: FP8 (e4m3 or e5m2) with a stats slot, N*C elements (any shape); values and stats.
        out_tp: (C, N), out's dtype, with a stats slot (its own, or out's: `out_tp.with_stats(out.stats)`);
            the transposed values and the same stats.
        inp: (..., C) fp32 or bf16; leading dimensions are flattened to N.
        abs_max: as in `quantize_with_abs_max` (None: out.abs_max).

    NumPy equivalent: `q = quantize_reference(inp.reshape(-1, C), abs_max, out.dtype)[0]`;
    `out = q`, `out_tp = q.T`.
    """
    what = "quantize_dual"
    _checks.expect(inp, f"{what}: inp", dtype=(FP32, BF16))  # (N, C)
    n, c = _rows_cols(inp, what)
    _checks.expect(out, f"{what}: out", dtype=(FP8_E4M3, FP8_E5M2))  # (N, C), any shape
    if out.nelem != inp.nelem:
        raise ValueError(
            f"{what}: out {out.name!r} {out.shape} and inp {inp.name!r} {inp.shape} hold different numbers of elements"
        )
    _checks.expect(out_tp, f"{what}: out_tp", dtype=out.dtype, shape=(c, n))  # (C, N)
    src = _amax_slot(abs_max, out, what)  # (1,)
    _amax_slot(None, out_tp, what + " (out_tp)")
    dev = _checks.same_device(out, out_tp, inp, src)
    if n == 0:
        return
    if dev.is_cpu:
        q, stats = quantize_reference(inp.array().reshape(n, c), src.array()[0], out.dtype)
        out.array()[...] = q.reshape(out.shape)
        out_tp.array()[...] = q.T
        _write_twin_stats(out, stats, src)
        if out_tp.stats.ptr != out.stats.ptr:
            _write_twin_stats(out_tp, stats, src)
        return
    vec = c % 8 == 0 and n % 16 == 0 and _checks.is_aligned(out, out_tp, inp)
    name = _build.kernel_name("quantize_dual", inp, out, scalar=not vec)
    grid = _transpose_grid(n, c, 1, what)
    args = (out, out_tp, out.stats, out_tp.stats, src, inp, np.int32(n), np.int32(c))
    _build.launch("fp8", name, grid, 256, args, dev, stream)


def transpose(out, inp, stream=None) -> None:
    """Transpose (N, C) to (C, N) for any 1- or 2-byte dtype, moving raw bits.

    Args:
        out: (C, N), the same dtype as inp.
        inp: (..., C); leading dimensions are flattened to N.

    FP8 stats are not touched: a Tensor's stats are its own slot, so out keeps its own; share
    them with `out = out.with_stats(inp.stats)` or copy them (`dev.copy_async(out.stats,
    inp.stats)`) when the transposed copy must carry inp's scales.

    NumPy equivalent: `out[...] = inp.reshape(-1, C).T`.
    """
    _checks.expect(inp, "transpose: inp")  # (N, C)
    if inp.dtype.itemsize not in (1, 2):
        raise ValueError(f"transpose: inp {inp.name!r} is {inp.dtype}; only 1- and 2-byte dtypes are supported")
    n, c = _rows_cols(inp, "transpose")
    _checks.expect(out, "transpose: out", dtype=inp.dtype, shape=(c, n))  # (C, N)
    dev = _checks.same_device(out, inp)
    if n == 0:
        return
    bits = _BITS[inp.dtype.itemsize]
    if dev.is_cpu:
        out.array().view(bits)[...] = inp.array().view(bits).reshape(n, c).T
        return
    s = inp.dtype.itemsize
    vec = c % 8 == 0 and n % (16 // s) == 0 and _checks.is_aligned(out, inp)
    name = _build.kernel_name(f"transpose_u{8 * s}", scalar=not vec)
    grid = _transpose_grid(n, c, s, "transpose")
    _build.launch("fp8", name, grid, 256, (out, inp, np.int32(n), np.int32(c)), dev, stream)


def bias_backward_scratch_shape(n: int, oc: int) -> tuple[int, int]:
    """Shape of the fp32 scratch `bias_backward` needs for dout (N, OC): (ceil(N/128), OC)."""
    return (max(1, math.ceil(n / _BIAS_ROWS)), oc)


def bias_backward(dbias, dout, scratch, stream=None) -> None:
    """Accumulate the bias gradient: dbias += dout summed over rows, deterministically.

    Args:
        dbias: (OC,) fp32 or bf16, accumulated (+=) in fp32 and rounded once.
        dout: (..., OC) fp32 or bf16; leading dimensions are flattened to N.
        scratch: fp32 with at least prod(bias_backward_scratch_shape(N, OC)) elements (any
            shape); its contents afterwards are unspecified.

    NumPy equivalent: `bias_backward_reference(dbias, dout)`.
    """
    _checks.expect(dbias, "bias_backward: dbias", dtype=(FP32, BF16), shape=(None,))  # (OC,)
    oc = dbias.shape[0]
    _checks.expect(dout, "bias_backward: dout", dtype=(FP32, BF16))  # (N, OC)
    if dout.ndim < 1 or dout.shape[-1] != oc:
        raise ValueError(f"bias_backward: dout {dout.name!r} {dout.shape} must end in OC = {oc} (dbias {dbias.shape})")
    _checks.expect(scratch, "bias_backward: scratch", dtype=FP32)
    n = dout.nelem // oc if oc else 0
    need = math.prod(bias_backward_scratch_shape(n, oc))
    if scratch.nelem < need:
        raise ValueError(
            f"bias_backward: scratch {scratch.name!r} {scratch.shape} holds {scratch.nelem} fp32 elements; "
            f"dout (N={n}, OC={oc}) needs {need} (bias_backward_scratch_shape)"
        )
    dev = _checks.same_device(dbias, dout, scratch)
    if n == 0 or oc == 0:
        return
    if dev.is_cpu:
        dbias.array()[...] = bias_backward_reference(dbias.array(), dout.array())
        return
    pack = 16 // dout.dtype.itemsize
    vec = oc % pack == 0 and _checks.is_aligned(dout)
    cols = 32 * (pack if vec else 1)
    if _build.ceil_div(n, _BIAS_ROWS) > 65535:
        raise ValueError(f"bias_backward: N = {n} rows exceed the {65535 * _BIAS_ROWS} one launch covers")
    # Rows per block: about _BIAS_BLOCKS blocks in all (one wave of the vectorised kernel), never
    # fewer than _BIAS_ROWS rows (so the chunks fit the scratch), a multiple of the kernel's 8 warps;
    # _BIAS_ROWS (many waves) when the column strips alone fill a wave. A function of (N, OC, dtype)
    # only, so the partial sums, and dbias's bits, depend neither on the GPU nor on alignment.
    groups = _BIAS_BLOCKS // _build.ceil_div(oc, 32 * pack)
    rows = max(_BIAS_ROWS, _build.ceil_div(_build.ceil_div(n, groups), 8) * 8) if groups else _BIAS_ROWS
    grid = (_build.ceil_div(oc, cols), _build.ceil_div(n, rows))
    name = _build.kernel_name("bias_partial", dout, scalar=not vec)
    _build.launch("fp8", name, grid, 256, (scratch, dout, np.int32(n), np.int32(oc), np.int32(rows)), dev, stream)
    args = (dbias, scratch, np.int32(grid[1]), np.int32(oc))
    _build.launch("fp8", _build.kernel_name("bias_reduce", dbias), _build.ceil_div(oc, 64), 64, args, dev, stream)
