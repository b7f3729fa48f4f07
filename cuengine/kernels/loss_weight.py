"""The loss weight 1/(valid targets) computed on the device, for data-parallel training.

With several ranks the weight of one valid target's loss is 1 over the valid targets of all
ranks, a count only the device learns (an all-reduce). Computing the weight there keeps the host
from waiting for the count in every step, and keeps the step capturable in one CUDA graph.
"""

from __future__ import annotations

import numpy as np

from .. import _checks
from ..dtypes import FP32, INT32
from . import _build


def loss_weight_reference(count: int) -> np.float32:
    """1/max(count, 1) as the one-GPU path stores it: the fp64 quotient rounded once to fp32."""
    return np.float32(1.0 / max(int(count), 1))


def loss_weight_from_count(d_loss, count_out, count, stream=None) -> None:
    """d_loss = 1/max(count, 1) and count_out = count, on the device.

    Args:
        d_loss: (1,) fp32, written. It may be `count`'s own four bytes viewed as fp32 (the targets
            upload carries the count in d_loss's slot).
        count_out: (1,) int32 or None: a copy of the count, for the host to read later.
        count: (1,) int32, e.g. after the all-reduce of every rank's valid targets.

    NumPy equivalent: `n = count[0]; count_out[0] = n; d_loss[0] = loss_weight_reference(n)`.
    """
    _checks.expect(d_loss, "loss_weight_from_count: d_loss", dtype=FP32, shape=(1,))
    _checks.expect(count, "loss_weight_from_count: count", dtype=INT32, shape=(1,))
    if count_out is not None:
        _checks.expect(count_out, "loss_weight_from_count: count_out", dtype=INT32, shape=(1,))
    dev = _checks.same_device(d_loss, count, count_out)
    if dev.is_cpu:
        n = int(count.array()[0])  # read before d_loss, which may be the same bytes
        if count_out is not None:
            count_out.array()[0] = n
        d_loss.array()[0] = loss_weight_reference(n)
        return
    _build.launch("loss_weight", "loss_weight_from_count", 1, 1, (d_loss, count_out, count), dev, stream)
