"""What would make a run state fit: the advice `allocate_run_state` gives when (B, T) does not."""

from __future__ import annotations

import dataclasses

from .options import memory_preset


class _Fits(Exception):
    """Raised inside a trial allocation that succeeded, so that all_or_nothing releases it."""


def options_that_fit(model, B: int, T: int) -> str:
    """Which options would make a (B, T) run state fit: the first of a ladder, cheapest in step
    time first (LM-head chunks of >= 1024 rows, then the "lean" recompute set, then
    recompute_block, then also offload_residual), whose plan allocates; each is released again."""
    o, N = model.opts, B * T
    chunks = o.lmhead_chunks
    while N % (2 * chunks) == 0 and N // (2 * chunks) >= 1024:
        chunks *= 2
    base = {"lmhead_chunks": chunks} if chunks != o.lmhead_chunks else {}
    lean = {"recompute_swiglu": True, **memory_preset("lean", model.cfg.num_layers)}
    if o.rc_mlp_up:  # every layer's up projection is recomputed already
        del lean["recompute_ffn_layers"]
    block = {"recompute_block": True}
    if o.recompute_ffn_layers:  # recompute_block recomputes every layer's up projection
        block["recompute_ffn_layers"] = 0
    ladder = [base, {**base, **lean}, {**base, **block}, {**base, **block, "offload_residual": True}]
    for changes in ladder:
        trial = dataclasses.replace(o, keep_all_activations=False, **changes)
        if not changes or trial == o:
            continue
        try:
            with model.alloc.all_or_nothing("a trial run state"):
                model._build_run_state(trial, B, T)
                raise _Fits
        except _Fits:
            model.rs = model.grads = model.opt_state = model._blocks = None
            flags = ", ".join(f"{k}={v}" for k, v in changes.items())
            return f"TrainOptions({flags}) makes it fit (its buffers were allocated and released)"
        except MemoryError:
            continue
    return ("not even lmhead_chunks, recompute_block and offload_residual together make it fit: lower B or T, "
            "or use more GPUs")  # fmt: skip
