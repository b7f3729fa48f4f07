"""The sharding plan: where every parameter sits in one flat buffer and which part each rank owns.

Parameters are grouped into buckets in the order of `param_specs`: the embedding, one bucket per
transformer layer, and the head (final norm, plus the LM head when it is not tied). A bucket is
the unit of communication: its gradients are reduce-scattered as soon as backward has finished
with that layer, and its updated weights are all-gathered after the optimizer step. NCCL's
reduce-scatter hands rank r the r-th of `world_size` equal contiguous chunks of a buffer, so every
bucket is padded to a multiple of `world_size * align` elements and rank r owns chunk r of each.

A rank's shard buffer (its gradient shard, AdamW moments and master copy) is the concatenation of
its chunks, bucket after bucket: contiguous and the same size on every rank. Every parameter starts
at a multiple of `align` elements, and so does every chunk, so views of every dtype the engine uses
(fp8 at 1 byte up to fp32) start 16-byte aligned, as the vectorised kernels and cuBLASLt want.
Padding elements belong to no parameter; they are zero and stay zero.

This module is plain Python and NumPy: it knows shapes, not devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ALIGN = 16  # elements: 16 bytes of fp8, 32 of bf16, 64 of fp32


@dataclass(frozen=True)
class ParamSlot:
    name: str  # engine name, e.g. "layers.3.qkv_w"
    shape: tuple[int, ...]
    decays: bool  # takes AdamW weight decay
    offset: int  # first element in the flat buffer; a multiple of align

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    name: str  # "embedding", "layers.<i>" or "head"
    params: tuple[ParamSlot, ...]
    start: int  # first element in the flat buffer
    size: int  # elements in the flat buffer: world_size * shard
    shard: int  # elements each rank owns
    shard_offset: int  # where this bucket's chunk starts in a rank's shard buffer

    @property
    def stop(self) -> int:
        return self.start + self.size

    def owned(self, rank: int) -> tuple[int, int]:
        """[lo, hi) of the flat buffer that `rank` owns in this bucket."""
        lo = self.start + rank * self.shard
        return lo, lo + self.shard


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that lies in a rank's shard."""

    name: str
    lo: int  # first element, in the parameter's flattened (row-major) order
    hi: int  # one past the last
    shard_offset: int  # where element `lo` sits in the rank's shard buffer
    decays: bool

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def bucket_name(param: str) -> str:
    """The bucket of an engine parameter name: "embedding", "layers.<i>" or "head"."""
    if param.startswith("layers."):
        return "layers." + param.split(".", 2)[1]
    return "embedding" if param == "wte" else "head"


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


class ShardPlan:
    """The flat layout of all parameters for `world_size` ranks.

    Args:
        specs: [(name, shape, decays)] as `cuengine.model.weights.param_specs(cfg)` returns.
        world_size: number of ranks (>= 1).
        align: element alignment of every parameter and every chunk (default 16).

    Attributes:
        buckets: list of Bucket in flat-buffer order.
        params: {name: ParamSlot}.
        total: elements of the flat buffer (padding included).
        shard_size: elements of each rank's shard buffer.
    """

    def __init__(self, specs, world_size: int, align: int = ALIGN):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"ShardPlan: world_size must be an int >= 1, got {world_size!r}")
        if align < 1:
            raise ValueError(f"ShardPlan: align must be >= 1, got {align}")
        self.specs = [(str(n), tuple(int(d) for d in s), bool(dec)) for n, s, dec in specs]
        self.world_size, self.align = world_size, align
        groups: dict[str, list] = {}
        for name, shape, decays in self.specs:
            groups.setdefault(bucket_name(name), []).append((name, shape, decays))
        self.buckets: list[Bucket] = []
        self.params: dict[str, ParamSlot] = {}
        start = shard_offset = 0
        for bname, members in groups.items():
            off, slots = start, []
            for name, shape, decays in members:
                slot = ParamSlot(name, shape, decays, off)
                slots.append(slot)
                self.params[name] = slot
                off += _round_up(slot.numel, align)
            size = _round_up(max(off - start, 1), world_size * align)
            self.buckets.append(Bucket(bname, tuple(slots), start, size, size // world_size, shard_offset))
            start += size
            shard_offset += size // world_size
        self.total, self.shard_size = start, shard_offset
        self._by_name = {b.name: b for b in self.buckets}

    def __eq__(self, other) -> bool:
        return isinstance(other, ShardPlan) and self.to_manifest() == other.to_manifest()

    def __repr__(self) -> str:
        return (f"ShardPlan({len(self.params)} params, {len(self.buckets)} buckets, world {self.world_size}, "
                f"{self.total} elements, {self.shard_size} per rank)")  # fmt: skip

    def bucket(self, name: str) -> Bucket:
        """The bucket called `name` ("embedding", "layers.<i>", "head")."""
        return self._by_name[name]

    def bucket_of(self, param: str) -> Bucket:
        return self._by_name[bucket_name(param)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"ShardPlan: rank {rank} outside [0, {self.world_size})")

    def pieces(self, rank: int, bucket: str | None = None) -> list[Piece]:
        """The parameter pieces in `rank`'s shard (of one bucket, or of all), in shard order.

        NumPy equivalent: `shard[p.shard_offset : p.shard_offset + p.numel] ==
        full[p.name].reshape(-1)[p.lo : p.hi]` for every piece p.
        """
        self._check_rank(rank)
        out = []
        for b in [self._by_name[bucket]] if bucket is not None else self.buckets:
            lo, hi = b.owned(rank)
            for p in b.params:
                a, z = max(lo, p.offset), min(hi, p.offset + p.numel)
                if a < z:
                    out.append(Piece(p.name, a - p.offset, z - p.offset, b.shard_offset + a - lo, p.decays))
        return out

    # ---- NumPy helpers (tests, checkpoints) -----------------------------------------------------
    def flatten(self, arrays: dict[str, np.ndarray], dtype=None) -> np.ndarray:
        """The flat buffer (padding zero) holding `arrays` ({name: array of the param's shape})."""
        dtype = dtype or next(iter(arrays.values())).dtype
        flat = np.zeros(self.total, dtype)
        for name, slot in self.params.items():
            a = np.asarray(arrays[name])
            if a.shape != slot.shape:
                raise ValueError(f"ShardPlan.flatten: {name!r} has shape {a.shape}, expected {slot.shape}")
            flat[slot.offset : slot.offset + slot.numel] = a.reshape(-1)
        return flat

    def unflatten(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """{name: view of the param's shape} into a flat buffer."""
        if flat.shape != (self.total,):
            raise ValueError(f"ShardPlan.unflatten: expected a flat buffer of {self.total} elements, got {flat.shape}")
        return {n: flat[s.offset : s.offset + s.numel].reshape(s.shape) for n, s in self.params.items()}

    def shard(self, flat: np.ndarray, rank: int) -> np.ndarray:
        """A copy of `rank`'s shard buffer cut out of a flat buffer."""
        self._check_rank(rank)
        return np.concatenate([flat[slice(*b.owned(rank))] for b in self.buckets])

    def unshard(self, shards: list[np.ndarray]) -> np.ndarray:
        """The flat buffer from every rank's shard buffer (the all-gather, in NumPy)."""
        if len(shards) != self.world_size or any(s.shape != (self.shard_size,) for s in shards):
            raise ValueError(
                f"ShardPlan.unshard: expected {self.world_size} shards of {self.shard_size} elements, got "
                f"{[s.shape for s in shards]}"
            )
        flat = np.empty(self.total, shards[0].dtype)
        for b in self.buckets:
            for r, s in enumerate(shards):
                flat[slice(*b.owned(r))] = s[b.shard_offset : b.shard_offset + b.shard]
        return flat

    # ---- manifest (checkpoints) -----------------------------------------------------------------
    def to_manifest(self) -> dict:
        """A JSON-able description from which `from_manifest` rebuilds the same plan."""
        return {
            "world_size": self.world_size,
            "align": self.align,
            "specs": [[n, list(s), d] for n, s, d in self.specs],
            "offsets": {n: s.offset for n, s in self.params.items()},
            "total": self.total,
            "shard_size": self.shard_size,
        }

    @classmethod
    def from_manifest(cls, manifest: dict) -> ShardPlan:
        """The plan a manifest describes; ValueError if this version of the layout differs."""
        plan = cls([(n, tuple(s), d) for n, s, d in manifest["specs"]], int(manifest["world_size"]),
                   int(manifest["align"]))  # fmt: skip
        if plan.to_manifest() != manifest:
            raise ValueError("ShardPlan.from_manifest: the saved layout differs from the one this version computes")
        return plan
