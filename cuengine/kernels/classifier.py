"""Fused softmax cross-entropy over one LM-head chunk: loss, LSE and dlogits in place.

The logits of a 150k vocabulary are the largest activation of a step, so the forward
(loss, LSE) and the first step of the backward (dlogits) share one kernel and the
gradient overwrites the logits instead of taking another buffer (LLMQ's fused classifier).
"""

from __future__ import annotations

import numpy as np

from .. import _checks
from ..dtypes import BF16, FP32, INT32
from ..tensor import Tensor
from . import _build
from .fp8 import abs_max_reference

_WARP_ROW_MAX_V = 4096  # rows up to this length take one warp each
_WARP_ROWS = 8  # rows (warps) per block of the `_warp` kernels
# Dynamic shared memory per block that caches a row's head between the forward and backward
# passes, by compute capability major (the opt-in maximum is 227 KB on sm_90 and sm_100); other
# devices get 32 KB, which needs no opt-in. The 16-byte block kernels also stage their loads there
# (cp.async), so they take it in the forward-only launch too, and need a 16-byte slot per thread
# (16 KB at 1024 threads) unless the whole row fits.
_CACHE_BYTES = {9: 224 * 1024, 10: 224 * 1024}
_CACHE_BYTES_OTHER = 32 * 1024


def fused_classifier_reference(logits, losses, lse, targets, d_loss, z_loss=0.0, write_dlogits=True, abs_max=None):
    """The NumPy twin: same arguments as `fused_classifier`, as arrays, updated in place.

    logits (N, V) fp32 or bf16, losses (N,) fp32 (+=), lse (N,) fp32 (=), targets (N,) int32,
    abs_max None or a (1,) fp32 array (max-accumulated with max|dlogits| as stored).
    All math in fp32; dlogits round once to the logits dtype. Returns nothing.
    """
    f32 = np.float32
    x = logits.astype(f32)
    n, v = x.shape
    t = targets.astype(np.int64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = x.max(axis=1, keepdims=True)
        s = np.exp(x - m).sum(axis=1, dtype=f32, keepdims=True)
        row_lse = (m + np.log(s)).astype(f32)  # (N, 1)
        lse[...] = row_lse[:, 0]
        valid = (t >= 0) & (t < v)
        x_t = x[np.arange(n), np.where(valid, t, 0)]
        z = f32(z_loss)
        loss = (row_lse[:, 0] - x_t) + z * row_lse[:, 0] * row_lse[:, 0]
        bad = ~valid & (t != -1)
        losses[valid] += loss[valid]
        losses[bad] += f32(np.nan)
        if not write_dlogits:
            return
        p = np.exp(x - row_lse)
        g = p * (f32(1) + f32(2) * z * row_lse)
        g[np.arange(n)[valid], t[valid]] -= f32(1)
        g *= f32(d_loss)
        g[t == -1] = 0
    logits[...] = g.astype(logits.dtype)
    if abs_max is not None:
        abs_max[0] = np.maximum(abs_max[0], abs_max_reference(logits))


def fused_classifier(logits, losses, lse, targets, d_loss, z_loss: float = 0.0, write_dlogits: bool = True,
                     abs_max=None, stream=None) -> None:  # fmt: skip
    """Cross-entropy loss, log-sum-exp and (optionally) dlogits for one chunk of rows.

    Args:
        logits: (N, V) fp32 or bf16; overwritten with dlogits when `write_dlogits`.
        losses: (N,) fp32; the per-token loss is added (+=): the caller zeroes it once per
            step and it accumulates over micro-steps and chunks.
        lse: (N,) fp32; written (=) with log(sum(exp(logits))) of each row.
        targets: (N,) int32 token ids; -1 ignores the row (no loss, zero gradient row). An id
            outside [-1, V) adds NaN to its loss (the device cannot raise without a host sync).
        d_loss: gradient of the total loss with respect to each token's loss, e.g. 1/(valid targets):
            a float, or a (1,) fp32 Tensor read on the device when the kernel runs, so that one
            captured graph serves batches with different numbers of valid targets.
        z_loss: coefficient of the lse^2 term in the loss.
        write_dlogits: False computes only losses and lse (validation) and leaves logits as they are.
        abs_max: None, or a (1,) fp32 slot (e.g. the FP8 stats of dlogits' quantized copy) into
            which max|dlogits| of the stored values is max-accumulated, as `fp8.abs_max(abs_max,
            logits)` after the call would (zero it first): no second read of the logits. Needs
            `write_dlogits`.

    NumPy equivalent: `fused_classifier_reference`.
    """
    _checks.expect(logits, "fused_classifier: logits", dtype=(FP32, BF16), shape=(None, None))  # (N, V)
    n, v = logits.shape
    _checks.expect(losses, "fused_classifier: losses", dtype=FP32, shape=(n,))  # (N,)
    _checks.expect(lse, "fused_classifier: lse", dtype=FP32, shape=(n,))  # (N,)
    _checks.expect(targets, "fused_classifier: targets", dtype=INT32, shape=(n,))  # (N,)
    if v == 0:
        raise ValueError(f"fused_classifier: logits {logits.name!r} has an empty vocabulary dimension {logits.shape}")
    on_device = isinstance(d_loss, Tensor)
    if on_device:
        _checks.expect(d_loss, "fused_classifier: d_loss", dtype=FP32, shape=(1,))  # (1,)
    if abs_max is not None:
        _checks.expect(abs_max, "fused_classifier: abs_max", dtype=FP32, shape=(1,))  # (1,)
        if not write_dlogits:
            raise ValueError("fused_classifier: abs_max records max|dlogits|, so it needs write_dlogits=True")
    dev = _checks.same_device(logits, losses, lse, targets, d_loss if on_device else None, abs_max)
    if n == 0:
        return
    if dev.is_cpu:
        dl = d_loss.array()[0] if on_device else d_loss
        fused_classifier_reference(logits.array(), losses.array(), lse.array(), targets.array(), dl, z_loss,
                                   write_dlogits, None if abs_max is None else abs_max.array())  # fmt: skip
        return
    pack = 16 // logits.dtype.itemsize
    vectorised = v % pack == 0 and _checks.is_aligned(logits)
    per_thread = pack if vectorised else 1
    name = _build.kernel_name("fused_classifier", logits, scalar=not vectorised)
    cache_n, smem = 0, 0
    if v <= _WARP_ROW_MAX_V:  # a warp per row, _WARP_ROWS rows per block
        name += "_warp"
        blocks, threads = _build.ceil_div(n, _WARP_ROWS), 32 * _WARP_ROWS
    else:
        blocks = n
        threads = min(1024, max(32, _build.ceil_div(_build.ceil_div(v, per_thread), 32) * 32))
        if write_dlogits or vectorised:
            budget = _CACHE_BYTES.get(dev.compute_capability[0], _CACHE_BYTES_OTHER) // logits.dtype.itemsize
            cache_n = min(v, budget) // per_thread * per_thread
            smem = cache_n * logits.dtype.itemsize
    args = (logits, losses, lse, abs_max, targets, np.float32(0.0 if on_device else d_loss),
            d_loss if on_device else None, np.float32(z_loss), np.int32(bool(write_dlogits)), np.int32(n), np.int32(v),
            np.int32(cache_n))  # fmt: skip
    _build.launch("classifier", name, blocks, threads, args, dev, stream, shared_mem=smem, dependent=True)
