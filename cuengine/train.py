"""The training loop, callable from Python without the command line.

`Trainer` steps a `LlamaModel` (with its run state allocated) over a token source: learning rate
from a schedule (any `step -> lr` callable; `Schedule` is the usual warm-up and decay), gradient
accumulation, a non-finite loss stops the run before the update, validation and checkpoints at a
cadence (steps and wall time), and hooks that see one record per step. `cuengine train` is argument
parsing, a progress line and a JSON-lines log around it (README.md has a worked example).

    trainer = Trainer(model, cuengine.data.TokenSource([tokens], "mine"), batch_size=8, seq_len=128,
                      steps=200, lr=Schedule(200, lr=1e-3, warmup=20))
    trainer.run()
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .benchmark import mfu
from .model.llama import count_valid


def lr_at(step: int, total: int, lr: float, min_lr: float, warmup: int, schedule: str) -> float:
    """Learning rate of 0-based `step` of `total`: linear warm-up over `warmup` steps, then
    `schedule` ("cosine", "linear" or "constant") from `lr` towards `min_lr`, which it would reach
    one step after the last (as llm.c does: the last step still learns)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    frac = (step - warmup) / max(total - warmup, 1)
    if schedule == "linear":
        return min_lr + (lr - min_lr) * (1.0 - frac)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * frac))


@dataclass(frozen=True)
class Schedule:
    """`lr_at` as a callable: `Schedule(...)(step)` is the learning rate of 0-based `step`."""

    steps: int
    lr: float
    min_lr: float = 0.0
    warmup: int = 0
    kind: str = "cosine"  # "cosine", "linear" or "constant"

    def __post_init__(self):
        if self.kind not in ("cosine", "linear", "constant"):
            raise ValueError(f"Schedule.kind must be 'cosine', 'linear' or 'constant', got {self.kind!r}")
        for name in ("steps", "warmup"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (name == "steps"):
                raise ValueError(f"Schedule.{name} must be an int >= {int(name == 'steps')}, got {v!r}")
        for name in ("lr", "min_lr"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                raise ValueError(f"Schedule.{name} must be a finite number >= 0, got {v!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"Schedule.min_lr {self.min_lr} is above lr {self.lr}")

    def __call__(self, step: int) -> float:
        return lr_at(step, self.steps, self.lr, self.min_lr, self.warmup, self.kind)


def optimizer_step(model, source, B: int, T: int, accum: int, lr: float) -> float:
    """One optimizer step over `accum` micro-batches of `source`; the mean loss over their valid
    targets. Raises FloatingPointError (before the update) on a non-finite loss or gradient norm."""
    if accum == 1:
        return model.train_step(*source.batch(B, T), lr=lr)
    batches = [source.batch(B, T) for _ in range(accum)]
    valid = sum(count_valid(y) for _, y in batches)  # each valid target weighs 1/valid, as one big batch
    for micro, (x, y) in enumerate(batches):
        model.forward(x)
        model.backward(x, y, micro_step=micro, grad_accum_steps=accum, valid_tokens=valid)
    return model.finish_step(lr, valid)


def evaluate(model, source, B: int, T: int, batches: int) -> float:
    """Mean loss over the valid targets of the first `batches` batches of `source` (the same
    batches every time)."""
    source.reset()
    total = count = 0
    for _ in range(batches):
        x, y = source.batch(B, T)
        n = int(np.count_nonzero(y != -1))
        total, count = total + model.validate(x, y) * n, count + n
    return total / count


def memory_bytes(dev) -> int:
    """Device memory in use on cuda; peak resident memory of this process on cpu."""
    if dev.is_cuda:
        free, total = dev.memory_info()
        return total - free
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Trainer:
    """Train `model` on `source` (anything with `batch(B, T) -> (inputs, targets)`; `state()` and
    `load_state()` too when checkpointing, as `cuengine.data.TokenSource` has).

    Args:
        lr: a `step -> lr` callable of the 0-based step (e.g. a `Schedule`), or a constant.
        steps: the step the run ends at (a schedule's length, usually).
        val, eval_every, eval_batches: validation every `eval_every` steps (0: never) and at the
            last step, over `eval_batches` batches of `val`.
        checkpoint_dir: where checkpoints go (None: none, and then save_every and save_seconds must be 0).
            One is written every `save_every` steps (0: off), when `save_seconds` of wall time passed
            since the last (0: off), at the step `run` stops at, and when a stop is requested
            (`request_stop`, or Ctrl-C under `run` with `handle_sigint`).
        checkpoint_extra: JSON-able dict stored in every checkpoint beside the step and the data state.
        hooks: callables `hook(record)` run after each step; the record holds "step", "loss", "lr",
            "tokens", "tok_per_s", "ms", "memory", on cuda "mfu", and "val_loss" after a validation.
            The gradients of the step are still readable in a hook (`model.gradients()`); with
            zero_stage >= 1 the weights need `model.sync_weights()` (on every rank) first.

    Several ranks (a model with a `comm`): Ctrl-C and the wall clock differ per rank, so a stop
    request and a timed checkpoint (`save_seconds`) are agreed on, without a host wait per step:
    after step k each rank posts its two flags into a tiny all-reduce (max) on the main stream,
    read back into pinned memory, and reads the agreement posted after step k-1, which the device
    finished long ago (step k's loss read waited for it). So every rank stops, or saves on time,
    at the same step, one step after the post that carried the request: a Ctrl-C during step k
    stops after step k+1 with a checkpoint (one arriving between the post and the end of step k,
    after step k+2; with one rank, after step k), and a timed save comes one step late.
    """

    def __init__(self, model, source, *, batch_size: int, seq_len: int, steps: int,
                 lr: Callable[[int], float] | float, grad_accum: int = 1, val=None, eval_every: int = 0,
                 eval_batches: int = 1, checkpoint_dir=None, save_every: int = 0, save_seconds: float = 0.0,
                 checkpoint_extra: dict | None = None, hooks=()):  # fmt: skip
        for name, v in (("batch_size", batch_size), ("seq_len", seq_len), ("steps", steps), ("grad_accum", grad_accum),
                        ("eval_batches", eval_batches)):  # fmt: skip
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Trainer: {name} must be an integer >= 1, got {v!r}")
        for name, v in (("eval_every", eval_every), ("save_every", save_every)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Trainer: {name} must be an integer >= 0, got {v!r}")
        if isinstance(save_seconds, bool) or not isinstance(save_seconds, (int, float)) or not save_seconds >= 0:
            raise ValueError(f"Trainer: save_seconds must be a number >= 0, got {save_seconds!r}")
        if not callable(getattr(source, "batch", None)):
            raise ValueError(f"Trainer: source needs a batch(B, T) method, got {type(source).__name__}")
        if eval_every and val is None:  # a run that asked for validation and would silently get none
            raise ValueError(f"Trainer: eval_every={eval_every} needs val, the validation source")
        if (save_every or save_seconds) and checkpoint_dir is None:
            raise ValueError("Trainer: save_every and save_seconds need checkpoint_dir")
        self.model, self.source, self.val = model, source, val
        self.B, self.T, self.accum, self.steps = batch_size, seq_len, grad_accum, steps
        self.lr = lr if callable(lr) else (lambda step, c=float(lr): c)
        self.eval_every, self.eval_batches = eval_every, eval_batches
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.save_every, self.save_seconds = save_every, save_seconds
        self.checkpoint_extra = dict(checkpoint_extra or {})
        self.hooks = list(hooks)
        self.step = 0  # optimizer steps done
        self.stop_requested = False
        self.last_saved = None  # the step of the last checkpoint this trainer wrote or resumed from

    def resume(self, checkpoint_dir=None) -> dict:
        """Restore a checkpoint (default: `checkpoint_dir`): weights, optimizer, step and the
        source's position. Returns the `checkpoint_extra` it was saved with. Checks first: a
        checkpoint of another model raises ValueError and changes nothing."""
        path = Path(checkpoint_dir) if checkpoint_dir is not None else self.checkpoint_dir
        if path is None:
            raise ValueError("Trainer.resume: no checkpoint directory given and no checkpoint_dir set")
        extra = self.model.load_checkpoint(path)
        self.source.load_state(extra["data"])
        self.step = self.last_saved = int(extra["step"])
        return {k: v for k, v in extra.items() if k not in ("step", "data")}

    def request_stop(self) -> None:
        """End `run` after the current step, with a checkpoint when there is a `checkpoint_dir`."""
        self.stop_requested = True

    def save(self) -> None:
        extra = dict(self.checkpoint_extra, step=self.step, data=self.source.state())
        self.model.save_checkpoint(self.checkpoint_dir, extra=extra)
        self.last_saved = self.step

    def run(self, stop: int | None = None, handle_sigint: bool = False) -> int:
        """Train from the current step up to `stop` (default: `steps`); returns the step reached.

        With `handle_sigint` (main thread only), a first Ctrl-C asks for a stop: the current step
        finishes and a checkpoint is written; a second one interrupts at once.
        """
        stop = self.steps if stop is None else stop
        if handle_sigint and threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)

            def on_sigint(signum, frame):
                signal.signal(signal.SIGINT, signal.default_int_handler)
                self.request_stop()

            signal.signal(signal.SIGINT, on_sigint)
            try:
                return self._run(stop)
            finally:
                signal.signal(signal.SIGINT, previous)
        return self._run(stop)

    def _run(self, stop: int) -> int:
        model, dev = self.model, self.model.device
        comm = getattr(model, "comm", None)  # several ranks: one step trains on all of their batches
        ranks = 1 if comm is None else comm.world_size
        tokens_per_step = self.B * self.T * self.accum * ranks
        flops_tok = model.flops_per_token(self.T) if dev.is_cuda else None
        saved_at = time.monotonic()
        self.stop_requested = False
        agree = _Agreement(comm) if comm is not None else None
        while self.step < stop:
            lr = self.lr(self.step)
            t0 = time.perf_counter()
            try:
                loss = optimizer_step(model, self.source, self.B, self.T, self.accum, lr)
            except FloatingPointError as err:
                raise FloatingPointError(f"step {self.step + 1}: {err}") from None
            dt = time.perf_counter() - t0
            self.step += 1
            rec = {"step": self.step, "loss": loss, "lr": lr, "tokens": self.step * tokens_per_step,
                   "tok_per_s": tokens_per_step / dt, "ms": dt * 1e3, "memory": memory_bytes(dev)}  # fmt: skip
            if flops_tok is not None:
                rec["mfu"] = mfu(flops_tok, rec["tok_per_s"] / ranks)  # per GPU
            if self.val is not None and (
                (self.eval_every and self.step % self.eval_every == 0) or self.step == self.steps
            ):
                rec["val_loss"] = evaluate(model, self.val, self.B, self.T, self.eval_batches)
            for hook in self.hooks:
                hook(rec)
            # one reading of the stop request serves the checkpoint and the loop: a Ctrl-C after it
            # stops after the next step, with a checkpoint
            if agree is None:
                stop_now = self.stop_requested
                timed = bool(self.save_seconds and time.monotonic() - saved_at >= self.save_seconds)
            else:  # what every rank posted after the previous step
                stop_now, timed = agree.read()
            if self.checkpoint_dir is not None and (
                (self.save_every and self.step % self.save_every == 0) or timed or self.step == stop or stop_now
            ):
                self.save()
                saved_at = time.monotonic()
            if stop_now:
                self.stop_requested = True
                break
            if agree is not None and self.step < stop:  # (nobody reads what the last step would post)
                agree.post(
                    self.stop_requested, bool(self.save_seconds and time.monotonic() - saved_at >= self.save_seconds)
                )
        sync = getattr(model, "sync_weights", None)
        if sync is not None:  # every rank ends here at the same step: a due all-gather runs now
            sync()
        return self.step


class _Agreement:
    """Flags every rank posts after a step, max-reduced over the ranks and read one step later
    without a host wait (see Trainer): an all-reduce of two int32 on the main stream, copied into
    pinned memory behind an event, in one of two slots (the one posted last step is being read)."""

    def __init__(self, comm):
        from .dtypes import INT32
        from .tensor import Tensor

        dev = comm.device
        self.comm, self.k = comm, 0
        self.flags = [Tensor.empty(INT32, (2,), dev, name=f"stop_flags.{i}") for i in range(2)]
        self.host = [Tensor.empty(INT32, (2,), dev, name=f"stop_flags_host.{i}", kind="pinned") for i in range(2)]
        self.events = [dev.event() for _ in range(2)]
        self.posted = [False, False]

    def post(self, stop: bool, timed: bool) -> None:
        """Enqueue this rank's flags (no host wait: the slot's last readback was read at `read`)."""
        i, dev = self.k % 2, self.comm.device
        self.host[i].array()[...] = (int(stop), int(timed))
        dev.copy_async(self.flags[i], self.host[i])
        self.comm.all_reduce(self.flags[i], op="max")
        dev.copy_async(self.host[i], self.flags[i])
        self.events[i].record()
        self.posted[i] = True
        self.k += 1

    def read(self) -> tuple[bool, bool]:
        """(stop, timed) as any rank posted them last (False, False before the first post)."""
        i = (self.k - 1) % 2
        if not self.posted[i]:
            return False, False
        self.posted[i] = False
        self.events[i].synchronize()  # done already: a later step's loss read waited for the device
        stop, timed = self.host[i].array().tolist()
        return bool(stop), bool(timed)
