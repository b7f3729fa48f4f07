"""Global gradient norm with clipping, deterministic and without a host sync.

The squared norm of every gradient goes into a fixed buffer of partial sums (one
slot per block of a grid that depends only on the tensor's size), and one small
kernel turns them into [norm, clip_scale]. The clip scale stays on the device,
where `adamw_update` reads it, so one captured graph serves every step.
"""

from __future__ import annotations

import numpy as np

from .. import _checks
from ..dtypes import BF16, FP32
from . import _build

NORM_SLOTS = 1024  # about 8 x the 132 SMs of an H200: enough blocks to stream a large tensor
_THREADS = 256


def norm_partials_shape() -> tuple[int]:
    """Shape of the fp32 partials buffer of `global_norm_squared` (zero it once per step)."""
    return (NORM_SLOTS,)


def global_norm_squared_reference(x: np.ndarray) -> np.float32:
    """sum(x^2) of one tensor in fp32 (the NumPy twin; the kernel spreads it over slots)."""
    return np.square(x.astype(np.float32)).sum(dtype=np.float32)


def global_norm_finish_reference(partials: np.ndarray, max_norm: float) -> np.ndarray:
    """[norm, clip_scale] in fp32: norm = sqrt(sum(partials)); clip_scale = max_norm/norm when
    max_norm > 0 and norm > max_norm, else 1. A NaN or inf norm is kept as it is, and its
    clip_scale is NaN (adamw_update then skips the step)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        norm = np.sqrt(partials.astype(np.float32).sum(dtype=np.float32))
        mx = np.float32(max_norm)
        scale = mx / norm if (mx > 0 and norm > mx) else np.float32(1)
        scale = scale if np.isfinite(norm) else np.float32(np.nan)
    return np.array([norm, scale], np.float32)


def global_norm_squared(partials, tensor, stream=None) -> None:
    """Add sum(tensor^2) into the partial sums, deterministically (bitwise reproducible).

    Args:
        partials: fp32 of shape `norm_partials_shape()`; the caller zeroes it once per step,
            then calls this once per gradient tensor. How the sum spreads over the slots is
            an implementation detail (the cpu twin adds it all to slot 0); only
            `global_norm_finish` reads it.
        tensor: any shape, fp32 or bf16.

    NumPy equivalent: `partials[0] += global_norm_squared_reference(tensor)`.
    """
    _checks.expect(partials, "global_norm_squared: partials", dtype=FP32, shape=norm_partials_shape())
    _checks.expect(tensor, "global_norm_squared: tensor", dtype=(FP32, BF16))  # (...)
    dev = _checks.same_device(partials, tensor)
    n = tensor.nelem
    if n == 0:
        return
    if dev.is_cpu:
        partials.array()[0] += global_norm_squared_reference(tensor.array())
        return
    # The grid depends on n alone, never on the device or on alignment: that fixes the order.
    grid = min(NORM_SLOTS, _build.ceil_div(n, _THREADS * 8))
    name = _build.kernel_name("global_norm_squared", tensor, scalar=not _checks.is_aligned(tensor))
    _build.launch("norm", name, grid, _THREADS, (partials, tensor, np.int64(n)), dev, stream)


def global_norm_finish(result, partials, max_norm: float, stream=None) -> None:
    """Write result = [norm, clip_scale] from the partial sums, on the device.

    Args:
        result: (2,) fp32. result[1:2] is the `grad_scale` that `adamw_update` takes.
        partials: fp32 of shape `norm_partials_shape()`, filled by `global_norm_squared`.
        max_norm: clip threshold; <= 0 disables clipping (clip_scale 1).

    A NaN or inf norm gives clip_scale NaN (adamw_update skips the step) and stays visible in result[0].

    NumPy equivalent: `result[...] = global_norm_finish_reference(partials, max_norm)`.
    """
    _checks.expect(result, "global_norm_finish: result", dtype=FP32, shape=(2,))
    _checks.expect(partials, "global_norm_finish: partials", dtype=FP32, shape=norm_partials_shape())
    dev = _checks.same_device(result, partials)
    if dev.is_cpu:
        result.array()[...] = global_norm_finish_reference(partials.array(), max_norm)
        return
    args = (result, partials, np.int32(NORM_SLOTS), np.float32(max_norm))
    _build.launch("norm", "global_norm_finish", 1, 1024, args, dev, stream)
