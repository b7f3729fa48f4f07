"""Checkpoints: weights, AdamW moments, the optimizer's rounding seed and the step, restored bitwise.

Layout of a checkpoint directory:
    weights.safetensors    engine tensors in the model dtype (packed qkv / up, engine names)
    optimizer.safetensors  "m.<name>" and "v.<name>" in their own dtypes
    state.json             step, optimizer seed, config, options and the caller's `extra`
It is written into a temporary sibling directory and renamed into place, so a crash never
leaves a half-written checkpoint under the final name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

FORMAT = "cuengine-checkpoint-1"


def save(model, out_dir, extra: dict | None = None) -> None:
    from safetensors.numpy import save_file

    target = Path(out_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "format": FORMAT,
        "step": model.step,
        "seed": model.opts.seed,  # with the step, the whole state of the stochastic rounding
        "config": model.cfg.to_hf_dict(),
        "options": dataclasses.asdict(model.opts),
        "extra": extra if extra is not None else {},
    }
    text = json.dumps(state, indent=2)  # fails early (before any file) on a non-JSON extra
    model.device.synchronize()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        save_file({n: t.numpy() for n, t in model.weights.tensors.items()}, str(tmp / "weights.safetensors"))
        save_file(model.opt_state.host_arrays(), str(tmp / "optimizer.safetensors"))
        (tmp / "state.json").write_text(text + "\n")
        old = None
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _read_checked(file: Path, want: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    if not file.is_file():
        raise ValueError(f"checkpoint: {file} is missing")
    arrays = load_file(str(file))
    missing = sorted(set(want) - set(arrays))
    extra = sorted(set(arrays) - set(want))
    if missing or extra:
        raise ValueError(f"checkpoint: {file.name} does not match this model: missing {missing[:5]}, extra {extra[:5]}")
    for k, (shape, dt) in want.items():
        a = arrays[k]
        if a.shape != shape or a.dtype != dt:
            raise ValueError(f"checkpoint: {file.name}: {k!r} is {a.dtype} {a.shape}, expected {dt} {shape}")
    return arrays


def load(model, path) -> dict:
    path = Path(path)
    if not (path / "state.json").is_file():
        raise ValueError(f"checkpoint: {path} holds no state.json")
    state = json.loads((path / "state.json").read_text())
    if state.get("format") != FORMAT:
        raise ValueError(f"checkpoint: {path} has format {state.get('format')!r}, expected {FORMAT!r}")
    if state["config"] != model.cfg.to_hf_dict():
        raise ValueError(f"checkpoint: {path} was written for another model config")
    weights = _read_checked(path / "weights.safetensors",
                            {n: (t.shape, t.dtype.np) for n, t in model.weights.tensors.items()})  # fmt: skip
    opt = model.opt_state
    want = {}
    for n in opt.m:
        want[f"m.{n}"] = (opt.m[n].shape, opt.m[n].dtype.np)
        want[f"v.{n}"] = (opt.v[n].shape, opt.v[n].dtype.np)
    moments = _read_checked(path / "optimizer.safetensors", want)
    if state["seed"] != model.opts.seed:
        raise ValueError(f"checkpoint: {path} was trained with seed {state['seed']}, the model has {model.opts.seed}")
    # Everything is read and checked: now write.
    for n, t in model.weights.tensors.items():
        t.copy_from_numpy(weights[n])
    for n in opt.m:
        opt.m[n].copy_from_numpy(moments[f"m.{n}"])
        opt.v[n].copy_from_numpy(moments[f"v.{n}"])
    model.weights.requantize()
    model.step = int(state["step"])
    return state["extra"]
