"""FP8 per-tensor scaling: abs-max, quantise, quantise+transpose, both copies at once (also over a
table of tensors in one launch), transpose, bias gradient.

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
from ..dtypes import BF16, BYTE, FP8_E4M3, FP8_E5M2, FP32, INT32
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
    return quantize_with_scale_reference(x, scale, fp8_dtype), np.array([abs_max, scale, scale_inv], np.float32)


def quantize_with_scale_reference(x: np.ndarray, scale, fp8_dtype) -> np.ndarray:
    """fp8(x * scale), clipped to +-fp8_max and rounded to nearest even (SATFINITE), in fp32 math: the
    values of quantize_reference, and of the delayed-scaling producers given their scale."""
    lim = np.float32(fp8_dtype.fp8_max)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.clip(x.astype(np.float32) * np.float32(scale), -lim, lim).astype(fp8_dtype.np)


def amax_history_roll_reference(history: np.ndarray, stats: np.ndarray, slots: np.ndarray, fp8_max: np.ndarray) -> None:
    """The twin of amax_history_roll, in place on history (R, n + 1); stats is the flat fp32 table."""
    h = history[:, 1:]
    h[:, 1:] = h[:, :-1].copy()
    h[:, 0] = stats[slots + STAT_ABS_MAX]
    m = np.where(np.isfinite(h), h, np.float32(0)).max(axis=1, initial=np.float32(0))  # the finite ones
    history[:, 0] = np.where(m > 0, fp8_max / np.where(m > 0, m, 1), 1).astype(np.float32)


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
    _build.launch("fp8", name, grid, 512, (amax, inp, np.int64(n)), dev, stream, dependent=True)


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
    _build.launch("fp8", name, grid, 256, (out, out.stats, src, inp, np.int64(n)), dev, stream, dependent=True)


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
    args = (out, out.stats, src, inp, np.int32(n), np.int32(c))
    _build.launch("fp8", name, grid, 256, args, dev, stream, dependent=True)


def _check_dual(out, out_tp, inp, abs_max, what: str):
    """quantize_dual's argument checks (ValueError naming `what`): (N, C, abs-max source slot, device)."""
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
    return n, c, src, _checks.same_device(out, out_tp, inp, src)


def _dual_vectorized(out, out_tp, inp, n: int, c: int) -> bool:
    """Whether quantize_dual takes the 16-byte kernel (the only one quantize_dual_multi has)."""
    return c % 8 == 0 and n % 16 == 0 and _checks.is_aligned(out, out_tp, inp)


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
    n, c, src, dev = _check_dual(out, out_tp, inp, abs_max, what)
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
    vec = _dual_vectorized(out, out_tp, inp, n, c)
    name = _build.kernel_name("quantize_dual", inp, out, scalar=not vec)
    grid = _transpose_grid(n, c, 1, what)
    args = (out, out_tp, out.stats, out_tp.stats, src, inp, np.int32(n), np.int32(c))
    _build.launch("fp8", name, grid, 256, args, dev, stream, dependent=True)


# ---- quantize_dual over many tensors in one launch -------------------------------------------------
# One DualRecord of fp8.cu: 64 bytes, in this order.
_DUAL_RECORD = np.dtype([("rows", "<u8"), ("out", "<u8"), ("stats_rows", "<u8"), ("stats_out", "<u8"),
                         ("amax", "<u8"), ("inp", "<u8"), ("n", "<i4"), ("c", "<i4"), ("first_block", "<i4"),
                         ("col_tiles", "<i4")])  # fmt: skip
_MAX_GRID = 2**31 - 1  # blocks of a 1-D launch


def _dual_tiles(shape) -> tuple[int, int]:
    """(row tiles, column tiles) of quantize_dual's launch over an input of `shape` (..., C); (0, 0) when empty."""
    c = shape[-1] if len(shape) else 0
    n = math.prod(shape) // c if c else 0
    return (_build.ceil_div(n, 32 * 4), _build.ceil_div(c, _TILE_C)) if n else (0, 0)


def quantize_dual_table_shape(shapes) -> tuple[int]:
    """Bytes of the BYTE table a `QuantizeDualTable` over inputs of these shapes (each (..., C)) needs:
    a 64-byte record per non-empty input, then the owner (int32 record index) of every block."""
    tiles = [r * c for r, c in map(_dual_tiles, shapes) if r]
    return (max(1, len(tiles) * _DUAL_RECORD.itemsize + 4 * sum(tiles)),)


class QuantizeDualTable:
    """The device table `quantize_dual_multi` reads: one record per non-empty entry (its addresses: plain and
    transposed copy, their stats slots, the abs-max source and the input; N, C; its first block and column-tile
    count) and the record index of every block, written once here (a host-to-device copy: build the table
    outside any graph capture), so a launch allocates and uploads nothing.

    Args:
        table: BYTE tensor of `quantize_dual_table_shape([inp.shape for inp in inps])` on the tensors' device.
        outs, outs_tp, inps: lists of equal length; entry i is `quantize_dual(outs[i], outs_tp[i], inps[i])`
            with abs_max=None (the source is outs[i].abs_max), checked as quantize_dual checks its arguments.
            One input dtype (fp32 or bf16) and one FP8 dtype per table. No stats slot may belong to two
            entries (one entry's stats writes would race with another's reads in the one launch).

    On cuda, when an entry misses the 16-byte kernel's conditions (C % 8, N % 16, aligned addresses),
    `quantize_dual_multi` launches per entry instead (`self.vectorized` False). The tensors must stay where
    they are: the table holds their addresses.
    """

    def __init__(self, table, outs, outs_tp, inps):
        what = "QuantizeDualTable"
        k = len(inps)
        if k == 0:
            raise ValueError(f"{what}: no tensors")
        if len(outs) != k or len(outs_tp) != k:
            raise ValueError(f"{what}: outs has {len(outs)} entries and outs_tp {len(outs_tp)}, inps has {k}")
        checked = [_check_dual(o, t, x, None, f"{what}[{i}]") for i, (o, t, x) in enumerate(zip(outs, outs_tp, inps))]
        for i, (o, x) in enumerate(zip(outs, inps)):
            for t, label, first in ((x, "inp", inps[0]), (o, "out", outs[0])):
                if t.dtype != first.dtype:
                    raise ValueError(f"{what}[{i}]: {label} {t.name!r} is {t.dtype} but {first.name!r} is "
                                     f"{first.dtype}; one table holds one input dtype and one FP8 dtype")  # fmt: skip
        owners_of = {}
        for i, (o, t) in enumerate(zip(outs, outs_tp)):
            for s in {o.stats.ptr, t.stats.ptr}:
                if owners_of.setdefault(s, i) != i:
                    raise ValueError(f"{what}[{i}]: a stats slot of out {o.name!r} or out_tp {t.name!r} is also "
                                     f"one of entry {owners_of[s]}'s; each entry needs its own")  # fmt: skip
        self.device = _checks.same_device(table, *outs, *outs_tp, *inps)
        _checks.expect(table, f"{what}: table", dtype=BYTE, shape=quantize_dual_table_shape([x.shape for x in inps]))
        kept = [(i, n, c) for i, (n, c, _, _) in enumerate(checked) if n]  # empty entries launch nothing
        self.entries = [(outs[i], outs_tp[i], inps[i]) for i, _, _ in kept]  # (out, out_tp, inp) per record
        self.vectorized = all(_dual_vectorized(*e, n, c) for e, (_, n, c) in zip(self.entries, kept))
        rec = np.zeros(len(kept), _DUAL_RECORD)
        grids = [_dual_tiles(inps[i].shape) for i, _, _ in kept]  # (row tiles, column tiles) per record
        self.blocks = sum(rt * ct for rt, ct in grids)
        if self.blocks > _MAX_GRID:
            raise ValueError(f"{what}: {self.blocks} tiles exceed the {_MAX_GRID} blocks of one launch")
        owners = np.zeros(self.blocks, np.int32)
        first = 0
        for j, (r, (out, out_tp, inp), (i, n, c), (rt, ct)) in enumerate(zip(rec, self.entries, kept, grids)):
            if self.device.is_cuda:  # the per-tensor launch's column limit, which the fallback would meet
                _transpose_grid(n, c, 1, f"{what}[{i}]")
            r["rows"], r["out"], r["inp"] = out.ptr, out_tp.ptr, inp.ptr
            r["stats_rows"], r["stats_out"], r["amax"] = out.stats.ptr, out_tp.stats.ptr, out.abs_max.ptr
            r["n"], r["c"], r["first_block"], r["col_tiles"] = n, c, first, ct
            owners[first : first + rt * ct] = j
            first += rt * ct
        head = len(kept) * _DUAL_RECORD.itemsize
        if self.device.is_cuda and self.entries:
            table.copy_from_numpy(np.concatenate([rec.view(np.uint8), owners.view(np.uint8)]))
        self.table = table
        self.owner = table.rows(head, head + owners.nbytes).view(INT32) if self.entries else None  # (blocks,)
        self.dtypes = (inps[0].dtype, outs[0].dtype)


def quantize_dual_multi(table: QuantizeDualTable, stream=None) -> None:
    """`quantize_dual(out, out_tp, inp)` of every entry of `table` (abs-max source: out.abs_max), on cuda in
    one launch whose values and stats are bitwise those of one launch per entry.

    Args:
        table: a QuantizeDualTable.

    NumPy equivalent: the cpu path calls `quantize_dual` per entry (and so does cuda when an entry misses
    the 16-byte conditions).
    """
    dev = table.device
    if not table.entries:
        return
    if dev.is_cpu or not table.vectorized:
        for out, out_tp, inp in table.entries:
            quantize_dual(out, out_tp, inp, stream=stream)
        return
    name = _build.kernel_name("quantize_dual_multi", *table.dtypes)
    _build.launch("fp8", name, table.blocks, 256, (table.table, table.owner), dev, stream, dependent=True)


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
    _build.launch("fp8", name, grid, 256, (out, inp, np.int32(n), np.int32(c)), dev, stream, dependent=True)


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
    args = (scratch, dout, np.int32(n), np.int32(oc), np.int32(rows))
    _build.launch("fp8", name, grid, 256, args, dev, stream, dependent=True)
    args = (dbias, scratch, np.int32(grid[1]), np.int32(oc))
    name = _build.kernel_name("bias_reduce", dbias)
    _build.launch("fp8", name, _build.ceil_div(oc, 64), 64, args, dev, stream, dependent=True)


def amax_history_roll(history, stats, slots, fp8_max, stream=None) -> None:
    """Delayed scaling's step: each of R FP8 tensors' abs-max history takes the abs-max recorded this
    micro-step, and its scale for the next is made from the largest of the last n.

    Producers that quantise with a delayed scale (activations' `scale=` arguments) know it before they
    write, so the quantise folds into them; they max-accumulate the abs-max of what they wrote into the
    tensor's stats slot, and this launch moves it into the history.

    Args:
        history: (R, n + 1) fp32, in place. Row r: [scale, abs-max of the last micro-step, ..., of the
            n-th last]; all zero at the start (the scale column then 0: run current scaling first).
        stats: fp32 table of stats slots (any shape, read flat), e.g. a run state's abs-max table.
        slots: (R,) int32, the flat index in `stats` of each tensor's stats slot.
        fp8_max: (R,) fp32, the largest finite value of each tensor's FP8 format (448 or 57344).

    NumPy equivalent: amax_history_roll_reference (scale = fp8_max / the largest finite abs-max of the
    history, 1 when that is 0, as quantize's rule; a non-finite abs-max, from a micro-step whose gradient
    overflowed, stays in the history but does not hold the scale at 1 for the next n micro-steps).
    """
    _checks.expect(history, "amax_history_roll: history", dtype=FP32, shape=(None, None))  # (R, n + 1)
    R, width = history.shape
    if width < 2:
        raise ValueError(f"amax_history_roll: history {history.name!r} needs n + 1 >= 2 columns, got {history.shape}")
    _checks.expect(stats, "amax_history_roll: stats", dtype=FP32)
    _checks.expect(slots, "amax_history_roll: slots", dtype=INT32, shape=(R,))
    _checks.expect(fp8_max, "amax_history_roll: fp8_max", dtype=FP32, shape=(R,))
    dev = _checks.same_device(history, stats, slots, fp8_max)
    if R == 0:
        return
    if dev.is_cpu:
        amax_history_roll_reference(history.array(), stats.array().reshape(-1), slots.array(), fp8_max.array())
        return
    args = (history, stats, slots, fp8_max, np.int32(R), np.int32(width - 1))
    _build.launch("fp8", "amax_history_roll", 1, 256, args, dev, stream, dependent=True)
