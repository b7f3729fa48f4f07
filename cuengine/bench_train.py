"""Train-step throughput of one model shape: the measurement behind `cuengine bench` and
tools/bench_train.py, kept in the package so an installed wheel (which has no tools/) measures the
same way.

Random init, random tokens. `warmup` untimed steps first (on cuda with graphs: the first runs
eagerly, the second captures), then the median of `steps` timed by `benchmark.time_ms`; the end
event of a step follows the update that train_step leaves running. MFU is `benchmark.mfu` with
`LlamaModel.flops_per_token` (6 per matmul parameter + causal attention), the same count for FP8.
With `grad_accum` > 1 a step is that many micro-batches of (B, T) (forward and backward each) and
one update, as the training loop runs it (`forward`, `backward`, `loss_sum`, `update`); tokens/s counts
every micro-batch's tokens.
"""

from __future__ import annotations

import time

import numpy as np

from .benchmark import mfu, time_ms


def random_batch(vocab: int, B: int, T: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) int32 (B, T): uniform random ids, targets shifted by one."""
    seq = np.random.default_rng(seed).integers(0, vocab, (B, T + 1)).astype(np.int32)
    return np.ascontiguousarray(seq[:, :-1]), np.ascontiguousarray(seq[:, 1:])


def bench_train_step(cfg, opts, device, B: int, T: int, steps: int, warmup: int, grad_accum: int = 1,
                     comm=None) -> dict:  # fmt: skip
    """Time `steps` train steps of a fresh model, each of `grad_accum` micro-batches of (B, T), then
    `steps` updates (norm + optimizer) alone. Returns {"ms": median step, "update_ms": median update,
    "tok_s", "mfu" (NaN on cpu), "mem_gib" (the allocator's device total), "params", "first_loss",
    "loss", "setup_s" (build, init and warm-up), "report" (the MemoryReport)}."""
    from .model import LlamaModel

    t0 = time.perf_counter()
    model = LlamaModel(cfg, opts, device=device, comm=comm)
    model.init_weights(42)
    model.allocate_run_state(B, T)
    x, y = random_batch(cfg.vocab_size, B, T)

    def step():
        if grad_accum == 1:
            return model.train_step(x, y, lr=1e-4)
        for micro in range(grad_accum):
            model.forward(x)
            model.backward(x, y, micro_step=micro, grad_accum_steps=grad_accum)
        loss = model.loss_sum() / (grad_accum * B * T)  # one host sync per step, as train_step has
        model.update(lr=1e-4)
        return loss

    losses = [step() for _ in range(warmup)]
    device.synchronize()
    setup_s = time.perf_counter() - t0
    step_ms = time_ms(device, lambda: losses.append(step()), warmup=0, iters=steps)
    ranks = 1 if comm is None else comm.world_size  # with a comm: every rank's tokens, MFU per GPU
    tok_s = ranks * grad_accum * B * T / (step_ms / 1e3)
    mfu_ = mfu(model.flops_per_token(T), tok_s / ranks) if device.is_cuda else float("nan")
    update_ms = time_ms(device, lambda: model.update(lr=1e-4), warmup=0, iters=steps)  # norm + optimizer alone
    rep = model.memory_report()
    return {"ms": step_ms, "update_ms": update_ms, "tok_s": tok_s, "mfu": mfu_, "mem_gib": rep.device_bytes / 2**30,
            "params": model.num_parameters(), "first_loss": losses[0], "loss": losses[-1], "setup_s": setup_s,
            "report": rep}  # fmt: skip
