"""AdamW with decoupled weight decay and seeded stochastic rounding for bf16 state.

Hyper-parameters and the clip scale are read on the device, so the update can be
captured once into a CUDA graph and replayed every step. bf16 params and moments
round stochastically from a counter-based hash of (seed, step, array, index):
without it, small updates to bf16 weights round away to nothing. The NumPy twin
draws the same bits and makes the same fp32 roundings, so cpu and cuda agree.
"""

from __future__ import annotations

import numpy as np

from .. import _checks
from ..dtypes import BF16, FP32
from . import _build

_U32 = np.uint32


def make_hparams(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> np.ndarray:
    """The (8,) fp32 hparams array that `adamw_update` reads; step is 1-based."""
    return np.array([lr, beta1, beta2, eps, weight_decay, step, 0, 0], np.float32)


# ---- the twin's random bits (same as mix32/sr_key/sr_bits in adamw.cu) ---------------------------
def _mix32(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> _U32(16))
    x = x * _U32(0x7FEB352D)
    x = x ^ (x >> _U32(15))
    x = x * _U32(0x846CA68B)
    return x ^ (x >> _U32(16))


def sr_bits(seed: int, step: int, which: int, index: np.ndarray) -> np.ndarray:
    """The 32 random bits for elements `index` (int64) of array `which` (0 param, 1 m, 2 v)."""
    with np.errstate(over="ignore"):
        base = np.array([(seed + 0x9E3779B9 * (which + 1)) & 0xFFFFFFFF], _U32)
        key = _mix32(_mix32(base) ^ _U32(step & 0xFFFFFFFF))
        idx = np.asarray(index, np.int64).astype(np.uint64)
        lo = (idx & np.uint64(0xFFFFFFFF)).astype(_U32)
        hi = (idx >> np.uint64(32)).astype(_U32)
        return _mix32(_mix32(key ^ lo) + hi)


def stochastic_round_bf16(x: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """Round fp32 `x` to bf16, up in magnitude with probability equal to the dropped fraction.

    Adds the low 16 of `bits` below the bf16 mantissa and truncates; inf and NaN round to nearest.
    """
    x = np.asarray(x, np.float32)
    raw = (x.view(_U32) + (bits.astype(_U32) & _U32(0xFFFF))) & _U32(0xFFFF0000)
    return np.where(np.isfinite(x), raw.view(np.float32), x).astype(BF16.np)


def _store(x: np.ndarray, dtype, seed: int, step: int, which: int, offset: int = 0) -> np.ndarray:
    if dtype == BF16.np:
        return stochastic_round_bf16(x, sr_bits(seed, step, which, np.arange(offset, offset + x.size)).reshape(x.shape))
    return x.astype(dtype)


def adamw_fp32_np(p, grad, m, v, hparams, grad_scale, weight_decay_on: bool):
    """The kernels' fp32 AdamW arithmetic, in their order, on flat fp32 p, m, v (grad any float
    dtype): returns (p, m, v, step), or None for a skipped step (a non-finite grad_scale). Shared
    by the AdamW and 8-bit AdamW twins; beta^step in float64 as the host computes it."""
    f32 = np.float32
    hp = np.asarray(hparams, f32)
    lr, b1, b2, eps = hp[0], hp[1], hp[2], hp[3]
    wd = hp[4] if weight_decay_on else f32(0)
    bc1 = f32(1.0 - np.float64(b1) ** np.float64(hp[5]))
    bc2 = f32(1.0 - np.float64(b2) ** np.float64(hp[5]))
    gs = f32(1) if grad_scale is None else f32(grad_scale)
    if not np.isfinite(gs):
        return None
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        g = grad.astype(f32).reshape(-1) * gs
        m = b1 * m + (f32(1) - b1) * g
        v = b2 * v + (f32(1) - b2) * (g * g)
        upd = (m / bc1) / (np.sqrt(v / bc2) + eps) + wd * p
        p = p - lr * upd
    return p, m, v, int(hp[5])


def adamw_reference(param, grad, m, v, hparams, grad_scale, weight_decay_on: bool, seed: int, index_offset: int = 0):
    """The NumPy twin: returns new (param, m, v) in their own dtypes.

    Arrays may be of any shape with equal sizes; hparams as in `adamw_update`; grad_scale a
    float or None. Same fp32 operations, in the same order, as the kernel (`adamw_fp32_np`).
    A non-finite grad_scale returns the inputs unchanged (the skipped step).
    """
    f32 = np.float32
    out = adamw_fp32_np(param.astype(f32).reshape(-1), grad, m.astype(f32).reshape(-1), v.astype(f32).reshape(-1),
                        hparams, grad_scale, weight_decay_on)  # fmt: skip
    if out is None:
        return param.copy(), m.copy(), v.copy()
    p, m32, v32, step = out
    k = index_offset
    return (_store(p, param.dtype, seed, step, 0, k).reshape(param.shape),
            _store(m32, m.dtype, seed, step, 1, k).reshape(m.shape),
            _store(v32, v.dtype, seed, step, 2, k).reshape(v.shape))  # fmt: skip


def adamw_update(param, grad, m, v, hparams, grad_scale, weight_decay_on: bool, seed: int, index_offset: int = 0,
                 stream=None) -> None:  # fmt: skip
    """One AdamW step, in place on param, m and v.

    Args:
        param: fp32 or bf16, any shape (N elements).
        grad: fp32 or bf16, N elements.
        m, v: fp32 or bf16, N elements each: first and second moments.
        hparams: (8,) fp32 on the device: [lr, beta1, beta2, eps, weight_decay, step, 0, 0],
            step 1-based (see `make_hparams`). Read by the kernel, so a captured graph follows
            the values the host writes before each replay.
        grad_scale: (1,) fp32 on the device (the clip scale, `result[1:2]` of
            `global_norm_finish`), or None for 1. Non-finite: nothing is written (the step is
            skipped on the device: global_norm_finish gives NaN for a non-finite norm).
        weight_decay_on: False for norms and biases.
        seed: constant per tensor (it is baked into a captured graph); the step in hparams
            varies the draws. bf16 outputs round stochastically from these; fp32 ones do not.
        index_offset: the index of element 0 in the random draws: a slice [k, k+N) of a tensor
            updated with index_offset=k rounds exactly as that slice of the whole tensor (a
            rank updating its shard of a parameter rounds as one process would).

    Update: g = grad*scale; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
    p -= lr * ((m/(1-b1^step)) / (sqrt(v/(1-b2^step)) + eps) + wd p).

    NumPy equivalent: `adamw_reference(...)`.
    """
    what = "adamw_update"
    _checks.expect(param, f"{what}: param", dtype=(FP32, BF16))  # (N,)
    _checks.expect(grad, f"{what}: grad", dtype=(FP32, BF16))  # (N,)
    _checks.expect(m, f"{what}: m", dtype=(FP32, BF16))  # (N,)
    _checks.expect(v, f"{what}: v", dtype=(FP32, BF16))  # (N,)
    _checks.expect(hparams, f"{what}: hparams", dtype=FP32, shape=(8,))  # (8,)
    if grad_scale is not None:
        _checks.expect(grad_scale, f"{what}: grad_scale", dtype=FP32, shape=(1,))  # (1,)
    n = param.nelem
    for t, label in ((grad, "grad"), (m, "m"), (v, "v")):
        if t.nelem != n:
            raise ValueError(
                f"{what}: {label} {t.name!r} {t.shape} {t.dtype} has {t.nelem} elements, "
                f"param {param.name!r} {param.shape} has {n}"
            )
    dev = _checks.same_device(param, grad, m, v, hparams, grad_scale)
    seed = int(seed) & 0xFFFFFFFF
    if n == 0:
        return
    if dev.is_cpu:
        gs = None if grad_scale is None else grad_scale.array()[0]
        p2, m2, v2 = adamw_reference(param.array(), grad.array(), m.array(), v.array(), hparams.array(), gs,
                                     weight_decay_on, seed, index_offset)  # fmt: skip
        param.array()[...] = p2
        m.array()[...] = m2
        v.array()[...] = v2
        return
    vec = _checks.is_aligned(param, grad, m, v)
    name = _build.kernel_name("adamw", param, grad, m, v, scalar=not vec)
    grid = _build.grid_size(dev, n, 256 * (8 if vec else 1), 8)
    args = (param, grad, m, v, hparams, grad_scale, np.int32(bool(weight_decay_on)), np.uint32(seed), np.int64(n),
            np.int64(index_offset))  # fmt: skip
    _build.launch("adamw", name, grid, 256, args, dev, stream)
