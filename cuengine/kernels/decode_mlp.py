"""The MLP of one decode row in one launch (raw_kernels/decode_mlp.cu): the FFN of the "ksplit" arm.

At batch 1 the gate/up GEMV and the down GEMV were two dependent launches, each paying a wait, an
input staging and a drain (11.2 µs for the pair at the 0.5B shape on the H200, for 6 µs of bytes).
Here every block owns a range of hidden units: it computes their gate, up and SiLU·mul itself and
multiplies them straight into the down projection's columns for those units, so no block waits for
another. The partial outputs of the blocks are summed in a fixed-point accumulator (kernels/gemv.py:
acc_shape, acc_values_np): integer atomics, so the sum does not depend on the order they land in, and
the next layer's RMSNorm prologue (gemv's x_acc) adds it to the residual.

Each block's weights are copied into a ring of shared-memory stages before the kernel waits for the
one before it (programmatic dependent launch): they stream from HBM while the attention and the
output projection still run.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_aligned, expect, overlaps, same_device
from ..dtypes import FP8_E4M3, INT64
from ..dtypes import dtype as _dtype
from ._build import ceil_div, launch
from .gemv import MODEL, acc_input_np, acc_shape, acc_sum_np, check_row_scales, gemv_dual_np
from .rmsnorm import rmsnorm_forward_np

FAMILY = "decode_mlp"
_THREADS = 256  # THREADS in decode_mlp.cu
_MAX_STAGES = 8  # MAX_STAGES
_MAX_C = 2048  # hidden size at most: MAX_ROWS_PT down rows of 256 threads
_XV = (1, 2, 4, 6, 8)  # compiled variants: a lane's 16-byte weight vectors per row
# Shared memory a block takes at most: the ring and the staged row. Well under the SM's 228 KB, so that
# the decode kernels before and after it (a GEMV's 5-10 KB, the attention's W_o slice: 13 KB at the 0.5B
# shape, 36 KB at 1.5B) find room on its SM while it streams; the 0.5B and 1.5B shapes keep 4 and 2 stages.
SMEM_BUDGET = 176 * 1024
_SMEM_MAX = 226 * 1024  # a block's dynamic shared memory at most (227 KB on sm_90, less the static arrays)
_CTYPE = {"bf16": "__nv_bfloat16", "fp32": "float", "e4m3": "__nv_fp8_e4m3"}
# Ring stages filled before the dependent-launch wait (the rest right after it): the weights stream while
# the attention runs, but every byte requested then queues ahead of the kernels on the critical path.
EARLY_STAGES = _MAX_STAGES


def chunk_units(w_dtype) -> int:
    """Hidden units per chunk (CU in decode_mlp.cu): 16 bytes of an E4M3 down row, 8 units otherwise.
    The accumulated bits depend on it: each chunk's partial is rounded to fixed point on its own."""
    return 16 if w_dtype.itemsize == 1 else 8


# ---- NumPy twin ---------------------------------------------------------------------------
def decode_mlp_np(x, norm_weight, w_up, w_down, eps=1e-6, up_scale=None, down_scale=None, x_acc=None):
    """(acc_delta, x'): what `decode_mlp` adds to its accumulator, (b, C + ACC_PAD) int64 (flag words
    set where a chunk's partial could overflow), and the input row x' it normalised.

    x' = acc_input_np(x, x_acc) or x; act = swiglu(gate/up GEMV of rmsnorm(x')) rounded as gemv_dual's
    epilogue; each chunk c of CU hidden units adds round(2^ACC_SHIFT * down_scale * act_c . Wd[:, c]).
    """
    xin = x if x_acc is None else acc_input_np(x, x_acc)
    h = rmsnorm_forward_np(xin, norm_weight, eps)[0]
    act = gemv_dual_np(h, w_up, up_scale, out_dtype=x.dtype, act="swiglu").astype(np.float32)  # (b, H)
    b, H = act.shape
    C = w_down.shape[0]
    cu = chunk_units(_dtype(w_down.dtype))
    wd = w_down.astype(np.float32).reshape(C, H // cu, cu)
    parts = np.einsum("ncu,bcu->bcn", wd, act.reshape(b, H // cu, cu), dtype=np.float64).astype(np.float32)
    return acc_sum_np(parts, down_scale), xin


# ---- sizes --------------------------------------------------------------------------------
def _stage_bytes(C: int, H: int, w_dtype) -> int:
    """One chunk's weights: its CU gate rows and CU up rows (C each) and the CU-wide slice of C down rows."""
    return 3 * chunk_units(w_dtype) * C * w_dtype.itemsize


def _fixed_bytes(C: int, x_dtype, chunks_per_block: int, w_dtype) -> int:
    """Beside the ring: x staged in fp32, its raw copy and the norm weight, the chunks' gate/up scales."""
    return C * (4 + 2 * x_dtype.itemsize) + chunks_per_block * 2 * chunk_units(w_dtype) * 4


def _layout(C: int, H: int, x_dtype, w_dtype, n_sms: int) -> tuple[int, int, int]:
    """(grid, stages, dynamic shared bytes): a block per SM (at most one per chunk), as many ring stages as
    its chunks need within SMEM_BUDGET, at least the two a refill needs."""
    chunks = H // chunk_units(w_dtype)
    grid = min(n_sms, chunks)
    per_block = ceil_div(chunks, grid)
    stage, fixed = _stage_bytes(C, H, w_dtype), _fixed_bytes(C, x_dtype, per_block, w_dtype)
    stages = max(2, min(_MAX_STAGES, per_block, (SMEM_BUDGET - fixed) // stage))
    assert stages * stage + fixed <= _SMEM_MAX, "unsupported() lets no shape past a block's shared memory"
    return grid, stages, stages * stage + fixed


def unsupported(C: int, H: int, x_dtype, w_dtype) -> str | None:
    """Why decode_mlp cannot run this shape and these dtypes (None when it can)."""
    cu = chunk_units(w_dtype)
    vw = 16 // w_dtype.itemsize
    if x_dtype not in MODEL or w_dtype not in (x_dtype, FP8_E4M3):
        models = "/".join(d.name for d in MODEL)
        return f"decode_mlp runs {models} rows over model-dtype or e4m3 weights, got {x_dtype} and {w_dtype}"
    if C % vw or C % (16 // x_dtype.itemsize):
        return f"the hidden size {C} must be a multiple of {max(vw, 16 // x_dtype.itemsize)} (16-byte vectors)"
    if H % cu:
        return f"the intermediate size {H} must be a multiple of {cu} (a chunk of hidden units)"
    if C > _MAX_C or ceil_div(C // vw, 32) > _XV[-1]:
        return f"the hidden size {C} is past decode_mlp's {min(_MAX_C, 32 * _XV[-1] * vw)}"
    return None  # two stages then fit: at C = 2048 bf16 they take 196 KB of the 226 (_SMEM_MAX)


# ---- launcher -----------------------------------------------------------------------------
def decode_mlp(acc, x, norm_weight, w_up, w_down, *, eps=1e-6, up_scale=None, down_scale=None, x_acc=None,
               x_out=None, stream=None) -> None:  # fmt: skip
    """acc += the MLP of RMSNorm(x'), x' = x or x plus the accumulator x_acc, split over hidden units.

    Args:
        acc: (1, C + ACC_PAD) int64 fixed-point accumulator (gemv.acc_shape); += (zero it first).
        x: (1, C) fp32 or bf16, the residual row (one row: the batch-1 decode step).
        norm_weight: (C,) x's dtype, the RMSNorm weight.
        w_up: (2H, C) [gate | up] in x's dtype, or e4m3 with up_scale (2H,) fp32 row scales.
        w_down: (C, H) w_up's dtype; e4m3 with down_scale (C,) fp32.
        x_acc: (1, C + ACC_PAD) int64 or None: an accumulator x misses (x' = round(x + round(y))).
        x_out: (1, C) x's dtype or None, with x_acc: written (=) with x' by one block.
    Raises ValueError for dtypes, shapes, aliasing and sizes the kernel does not take (`unsupported`).
    NumPy equivalent: decode_mlp_np (acc += its delta).
    """
    what = "decode_mlp"
    expect(x, f"{what} x", MODEL, (1, None))
    C = x.shape[1]
    expect(norm_weight, f"{what} norm_weight", x.dtype, (C,))
    expect(w_up, f"{what} w_up", (x.dtype, FP8_E4M3), (None, C))
    if w_up.shape[0] % 2:
        raise ValueError(f"{what} w_up: expected (2H, {C}) = [gate | up], got tensor {w_up.name!r} {w_up.shape}")
    H = w_up.shape[0] // 2
    expect(w_down, f"{what} w_down", w_up.dtype, (C, H))
    check_row_scales(what, "up_scale", w_up, up_scale)
    check_row_scales(what, "down_scale", w_down, down_scale)
    expect(acc, f"{what} acc", INT64, acc_shape(1, C))
    if x_acc is not None:
        expect(x_acc, f"{what} x_acc", INT64, acc_shape(1, C))
    if x_out is not None:
        if x_acc is None:
            raise ValueError(f"{what} x_out: tensor {x_out.name!r} is written only with x_acc (x plus the accumulator)")
        expect(x_out, f"{what} x_out", x.dtype, (1, C))
    why = unsupported(C, H, x.dtype, w_up.dtype)
    if why:
        raise ValueError(f"{what}: {why}")
    written = [t for t in (acc, x_out) if t is not None]
    read = [t for t in (x, norm_weight, w_up, w_down, up_scale, down_scale, x_acc) if t is not None]
    for out in written:
        for t in read + [o for o in written if o is not out]:
            if overlaps(out, t):
                raise ValueError(f"{what}: tensor {out.name!r} overlaps {t.name!r}")
    dev = same_device(acc, x, norm_weight, w_up, w_down, up_scale, down_scale, x_acc, x_out)
    check_aligned(what, acc, x, norm_weight, w_up, w_down, x_acc, x_out)
    if dev.is_cpu:
        delta, xin = decode_mlp_np(x.array(), norm_weight.array(), w_up.array(), w_down.array(), eps,
                                   None if up_scale is None else up_scale.array(),
                                   None if down_scale is None else down_scale.array(),
                                   None if x_acc is None else x_acc.array())  # fmt: skip
        a = acc.array()
        a[:, :C] += delta[:, :C]
        a[:, C] |= delta[:, C]
        if x_out is not None:
            x_out.array()[...] = xin
        return
    grid, stages, smem = _layout(C, H, x.dtype, w_up.dtype, dev.num_sms)
    xv = next(v for v in _XV if 32 * v * (16 // w_up.dtype.itemsize) >= C)
    name = f"decode_mlp<{_CTYPE[x.dtype.name]}, {_CTYPE[w_up.dtype.name]}, {xv}>"
    args = (acc, x_out, x, x_acc, norm_weight, w_up, up_scale, w_down, down_scale, np.float32(eps), np.int32(C),
            np.int32(H), np.int32(stages), np.int32(_stage_bytes(C, H, w_up.dtype)),
            np.int32(EARLY_STAGES))  # fmt: skip
    launch(FAMILY, name, grid, _THREADS, args, dev, stream, shared_mem=smem, dependent=True)
