"""Checkpoints: weights, AdamW moments, the optimizer's rounding seed and the step, restored bitwise.

Layout of a checkpoint directory:
    weights.safetensors    engine tensors in the model dtype (packed qkv / up, engine names)
    optimizer.safetensors  the optimizer's `state_tensors()`: "m.<name>" and "v.<name>" in their own
                           dtypes for AdamW; codes and block abs-maxes for adamw8bit
    fp8_history.safetensors  with TrainOptions.fp8_amax_history only: the delayed FP8 scales and their
                           abs-max history ("fp8_amax_history", the run state's table)
    state.json             step, optimizer seed, config, options and the caller's `extra`
It is written into a temporary sibling directory, flushed to disk and renamed into place, so a
crash never leaves a half-written checkpoint under the final name (see `save`).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .weights import read_error, umask

FORMAT = "cuengine-checkpoint-1"


def save(model, out_dir, extra: dict | None = None, moments: dict | None = None) -> None:
    """Write the checkpoint under a temporary name, flush it to disk, then swap it in: the previous
    checkpoint is renamed to `.<name>.old` and the new one to `<name>`. A process killed at any
    point leaves a loadable checkpoint: the previous one under `<name>`, or, between the two
    renames, under `.<name>.old`, where `load` (and the next `save`) find it."""
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
    check_replaceable(target)
    model.device.synchronize()
    old = _old_path(target)
    if not target.exists() and (old / "state.json").is_file():
        os.replace(old, target)  # the last save was killed between its renames: put the old one back
    _remove_dead_temporaries(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    try:
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it 0700
        save_file({n: t.numpy() for n, t in model.weights.tensors.items()}, str(tmp / "weights.safetensors"))
        moments = model.opt_state.host_arrays() if moments is None else moments  # sharded: gathered
        save_file(moments, str(tmp / "optimizer.safetensors"))
        history = _fp8_history(model)
        if history is not None:
            save_file({HISTORY: history.numpy()}, str(tmp / "fp8_history.safetensors"))
        (tmp / "state.json").write_text(text + "\n")
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask())  # safetensors writes 0600 whatever the umask
            _fsync(f)  # the data is on disk before the rename makes it the checkpoint
        _fsync(tmp)
        if target.exists():
            if old.exists():
                shutil.rmtree(old)  # left by a save killed after its renames: target is newer
            os.replace(target, old)
        os.replace(tmp, target)
        _fsync(target.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


HISTORY = "fp8_amax_history"


def _fp8_history(model):
    rs = getattr(model, "rs", None)
    return None if rs is None else rs.fp8_history


# what a checkpoint directory holds: the only entries a save may replace (anything else there is a user's)
_FILES = frozenset({"weights.safetensors", "optimizer.safetensors", "fp8_history.safetensors", "state.json"})


def check_replaceable(target: Path) -> None:
    """A save replaces `target` whole: refuse, before writing anything, unless it is absent, an empty directory
    or a checkpoint (state.json and checkpoint files only), so a mistyped path never deletes someone's files."""
    if not target.exists():
        return
    if not target.is_dir():
        raise ValueError(f"save_checkpoint: {target} is a file, not a checkpoint directory; choose another path")
    names = {p.name for p in target.iterdir()}
    if names and ("state.json" not in names or not names <= _FILES):
        other = sorted(names - _FILES) or ["no state.json"]
        listed = ", ".join(other[:3]) + (", ..." if len(other) > 3 else "")
        raise ValueError(f"save_checkpoint: {target} holds files that are not a checkpoint's ({listed}); a save "
                         "replaces the directory whole, so choose another path")  # fmt: skip


def _old_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_dead_temporaries(target: Path) -> None:
    """Remove the temporary directories of saves to `target` whose process has died (killed
    mid-save); those of a live process are left alone."""
    prefix = f".{target.name}.tmp-"
    for p in target.parent.glob(glob.escape(prefix) + "*"):
        pid = p.name[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def _read_checked(file: Path, want: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    if not file.is_file():
        raise ValueError(f"checkpoint: {file} is missing")
    try:
        arrays = load_file(str(file))
    except BaseException as err:
        if not read_error(err):
            raise
        raise ValueError(f"checkpoint: {file}: not a readable safetensors file ({type(err).__name__}: {err})") from None
    missing = sorted(set(want) - set(arrays))
    extra = sorted(set(arrays) - set(want))
    if missing or extra:
        raise ValueError(f"checkpoint: {file} does not match this model: missing {missing[:5]}, extra {extra[:5]}")
    for k, (shape, dt) in want.items():
        a = arrays[k]
        if a.shape != shape or a.dtype != dt:
            raise ValueError(f"checkpoint: {file}: {k!r} is {a.dtype} {a.shape}, expected {dt} {shape}")
    return arrays


def _read_state(path: Path) -> dict:
    file = path / "state.json"
    if not file.is_file():
        old = _old_path(path)
        if path.exists() or not (old / "state.json").is_file():
            raise ValueError(f"checkpoint: {path} holds no state.json")
        file = old / "state.json"  # a save was killed between its two renames: the previous one
    try:
        state = json.loads(file.read_bytes())
    except (OSError, ValueError) as err:  # ValueError covers bad JSON and bad UTF-8
        raise ValueError(f"checkpoint: {file}: not readable JSON ({err})") from None
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint: {file}: expected a JSON object, found {type(state).__name__}")
    if state.get("format") != FORMAT:
        raise ValueError(f"checkpoint: {file} has format {state.get('format')!r}, expected {FORMAT!r}")
    for key, kind in (("step", int), ("seed", int), ("config", dict), ("extra", dict)):
        v = state.get(key)
        if not isinstance(v, kind) or isinstance(v, bool) or (kind is int and v < 0):
            what = "a non-negative int" if kind is int else "a JSON object"
            raise ValueError(f"checkpoint: {file}: {key!r} must be {what}, found {v!r}")
    state["dir"] = file.parent
    return state


def load(model, path) -> dict:
    """Check the whole checkpoint (state.json, both safetensors files: readable, every tensor of
    the right name, dtype and shape), then restore weights, moments and step. Anything wrong
    raises ValueError naming the file, and the model is left as it was."""
    path = Path(path)
    state = _read_state(path)
    path = state.pop("dir")
    if state["config"] != model.cfg.to_hf_dict():
        raise ValueError(f"checkpoint: {path} was written for another model config")
    if state["seed"] != model.opts.seed:
        raise ValueError(f"checkpoint: {path} was trained with seed {state['seed']}, the model has {model.opts.seed}")
    weights = _read_checked(path / "weights.safetensors",
                            {n: (t.shape, t.dtype.np) for n, t in model.weights.tensors.items()})  # fmt: skip
    opt_tensors = model.opt_state.state_tensors()
    want = {k: (t.shape, t.dtype.np) for k, t in opt_tensors.items()}
    sharded = model._dp is not None and not want  # ZeRO: the full moments are read whole; each rank takes its shard
    moments = _read_checked(path / "optimizer.safetensors", model._dp.moment_shapes() if sharded else want)
    # the delayed FP8 scales: restored where the model keeps them; a checkpoint without them (saved without
    # fp8_amax_history) starts the history afresh, its first micro-step scaling as the rest
    history, hist_file = _fp8_history(model), path / "fp8_history.safetensors"
    saved_history = None
    if history is not None and hist_file.is_file():
        saved_history = _read_checked(hist_file, {HISTORY: (history.shape, history.dtype.np)})[HISTORY]
    # Everything is read and checked: now write.
    for n, t in model.weights.tensors.items():
        t.copy_from_numpy(weights[n])
    model.weights.assigned = True
    for k, t in opt_tensors.items():
        t.copy_from_numpy(moments[k])
    if sharded:
        model._dp.load_moments(moments)
    if history is not None:
        if saved_history is None:
            history.fill_zero()
        else:
            history.copy_from_numpy(saved_history)
        model.rs.fp8_history_filled = saved_history is not None
    model.weights.requantize()
    model.step = state["step"]
    return state["extra"]
