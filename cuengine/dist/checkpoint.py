"""Sharded checkpoint state: each rank writes its own shard, any number of ranks reads it back.

Weights are the same on every rank (ZeRO-1/2 shard gradients and optimizer state, not weights),
so rank 0 writes them as a single-GPU run does. What is sharded (AdamW moments, master copies) is
written by every rank as `optimizer.rank<r>-of-<N>.safetensors`, one flat array per key holding
that rank's shard buffer, and rank 0 writes `shards.json`, the plan those buffers follow. A
run on M ranks finds its pieces by parameter name and element range, so N → M works for any N
and M, 1 included, reading only the slices it needs. Nothing here needs a communicator.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np

from .plan import ShardPlan

MANIFEST = "shards.json"
FORMAT = "cuengine-shards-1"


def shard_file(rank: int, world_size: int) -> str:
    return f"optimizer.rank{rank:05d}-of-{world_size:05d}.safetensors"


def save_shard(out_dir, plan: ShardPlan, rank: int, arrays: dict[str, np.ndarray]) -> None:
    """Write `rank`'s shard buffers {key: (plan.shard_size,) array} into `out_dir`."""
    from safetensors.numpy import save_file

    for k, a in arrays.items():
        if a.shape != (plan.shard_size,):
            raise ValueError(f"save_shard: {k!r} has shape {a.shape}, expected ({plan.shard_size},) for rank {rank}")
    save_file({k: np.ascontiguousarray(a) for k, a in arrays.items()},
              str(Path(out_dir) / shard_file(rank, plan.world_size)))  # fmt: skip


def write_manifest(out_dir, plan: ShardPlan, keys) -> None:
    """Rank 0's part: the plan and the keys every shard file holds."""
    text = json.dumps({"format": FORMAT, "keys": sorted(keys), "plan": plan.to_manifest()})
    (Path(out_dir) / MANIFEST).write_text(text + "\n")


def read_manifest(path) -> tuple[ShardPlan, list[str]]:
    """(plan, keys) of a sharded checkpoint directory; ValueError if it holds none."""
    f = Path(path) / MANIFEST
    if not f.is_file():
        raise ValueError(f"checkpoint: {path} holds no {MANIFEST} (not a sharded checkpoint)")
    m = json.loads(f.read_text())
    if m.get("format") != FORMAT:
        raise ValueError(f"checkpoint: {f} has format {m.get('format')!r}, expected {FORMAT!r}")
    plan = ShardPlan.from_manifest(m["plan"])
    for r in range(plan.world_size):
        if not (Path(path) / shard_file(r, plan.world_size)).is_file():
            raise ValueError(f"checkpoint: {path} lacks {shard_file(r, plan.world_size)}")
    return plan, m["keys"]


def load_shard(path, plan: ShardPlan, rank: int) -> dict[str, np.ndarray]:
    """`rank`'s shard buffers under `plan` {key: (plan.shard_size,)}, from shards saved on any
    number of ranks. Padding is zero. ValueError if the checkpoint holds other parameters."""
    from safetensors import safe_open

    old, keys = read_manifest(path)
    if old.specs != plan.specs:
        raise ValueError(f"checkpoint: {path} holds shards of other parameters than this model's")
    where: dict[str, list] = {}  # name -> [(lo, hi, old rank, old shard offset)]
    for r in range(old.world_size):
        for p in old.pieces(r):
            where.setdefault(p.name, []).append((p.lo, p.hi, r, p.shard_offset))
    files, out = {}, {}
    with contextlib.ExitStack() as stack:

        def reader(r):
            if r not in files:
                files[r] = stack.enter_context(safe_open(str(Path(path) / shard_file(r, old.world_size)), "np"))
            return files[r]

        for k in keys:
            out[k] = np.zeros(plan.shard_size, reader(0).get_slice(k)[0:1].dtype)
        for piece in plan.pieces(rank):
            for lo, hi, r, off in where[piece.name]:
                a, z = max(lo, piece.lo), min(hi, piece.hi)
                if a >= z:
                    continue
                dst = slice(piece.shard_offset + a - piece.lo, piece.shard_offset + z - piece.lo)
                for k in keys:
                    out[k][dst] = reader(r).get_slice(k)[off + a - lo : off + z - lo]
    return out


def load_full(path) -> dict[str, dict[str, np.ndarray]]:
    """{key: {param name: full array}}: the shards gathered, for a model that does not shard."""
    plan, keys = read_manifest(path)
    single = ShardPlan(plan.specs, 1, plan.align)
    return {k: single.unflatten(buf) for k, buf in load_shard(path, single, 0).items()}


def shard_of(plan: ShardPlan, rank: int, full: dict[str, np.ndarray]) -> np.ndarray:
    """`rank`'s shard buffer cut from full per-parameter arrays (a single-GPU checkpoint's moments)."""
    shard = np.zeros(plan.shard_size, next(iter(full.values())).dtype)
    for p in plan.pieces(rank):
        shard[p.shard_offset : p.shard_offset + p.numel] = np.asarray(full[p.name]).reshape(-1)[p.lo : p.hi]
    return shard
