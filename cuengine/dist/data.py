"""The data-sharding rule: every rank takes its own rows of the same global batch.

All ranks hold the same TokenSource (same files, same seed) and draw the same global batch of
`B * world_size` windows; rank r keeps rows [r*B, (r+1)*B). So the ranks train on distinct windows,
their union is exactly the batch one process with `B * world_size` rows would see, and the
source's state (epoch, cursor), the same on every rank, resumes the run to the same batches on
any number of ranks that keeps the global batch size.
"""

from __future__ import annotations

import numpy as np


def rank_batch(source, B: int, T: int, rank: int, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), int32 (B, T) each: rank `rank`'s rows of the next global batch of `source`.

    NumPy equivalent: `x, y = source.batch(B * world_size, T); x[rank*B:(rank+1)*B], y[rank*B:(rank+1)*B]`.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank_batch: rank {rank} outside [0, {world_size})")
    inputs, targets = source.batch(B * world_size, T)
    rows = slice(rank * B, (rank + 1) * B)
    return np.ascontiguousarray(inputs[rows]), np.ascontiguousarray(targets[rows])


class RankSource:
    """A token source as one rank sees it: `batch(B, T)` is `rank_batch`, and the rest (`state`,
    `load_state`, `reset`, `name`, ...) is the wrapped source's, so a `Trainer` (or any loop written
    for one process) runs unchanged on every rank."""

    def __init__(self, source, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"RankSource: rank {rank} outside [0, {world_size})")
        self.source, self.rank, self.world_size = source, rank, world_size

    def batch(self, B: int, T: int) -> tuple[np.ndarray, np.ndarray]:
        return rank_batch(self.source, B, T, self.rank, self.world_size)

    def __getattr__(self, name):
        return getattr(self.source, name)
