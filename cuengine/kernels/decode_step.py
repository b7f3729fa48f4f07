"""Decode-loop bookkeeping on the device (raw_kernels/decode_step.cu).

The decode step reads each row's cache position (`positions`, where its input token goes) and
attention length (`lengths` = positions + 1) from device memory; this kernel moves them on after
each step, so one captured CUDA graph serves every step without a host write.
"""

from __future__ import annotations

import numpy as np

from .._checks import expect, same_device
from ..dtypes import INT32
from ._build import ceil_div, launch

FAMILY = "decode_step"


def advance_positions_np(positions: np.ndarray, lengths: np.ndarray) -> None:
    """In place: positions += 1; lengths = positions + 1."""
    positions += 1
    lengths[...] = positions + 1


def advance_positions(positions, lengths, stream=None) -> None:
    """Move every row one position on after a decode step.

    Args:
        positions: (b,) int32, the cache position of each row's input token; incremented in place.
        lengths: (b,) int32, written (=) as positions + 1 (the attention length of the next step).
    NumPy equivalent: advance_positions_np(positions, lengths).
    """
    expect(positions, "advance_positions positions", INT32, (None,))
    b = positions.shape[0]
    expect(lengths, "advance_positions lengths", INT32, (b,))
    dev = same_device(positions, lengths)
    if dev.is_cpu:
        advance_positions_np(positions.array(), lengths.array())
        return
    if b == 0:
        return
    launch(FAMILY, "advance_positions", ceil_div(b, 64), 64, (positions, lengths, np.int32(b)), dev, stream)
