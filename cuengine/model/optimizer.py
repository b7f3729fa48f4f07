"""AdamW over the model's parameters, with a deterministic global gradient norm and clipping.

Everything stays on the device: the norm is reduced into fixed partial slots (the same order
every step, so the same bits), `global_norm_finish` turns it into [norm, clip scale], and each
`adamw_update` reads the clip scale and the hyper-parameters from device memory. The host only
refreshes the hyper-parameters with one small host→device copy before the step.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import dtype as _dtype
from ..kernels import adamw, norm


class AdamWState:
    """First and second moments for every parameter (context "Optimizer").

    Args:
        specs: [(name, shape, decays)] from `weights.param_specs`.
        alloc: the TensorAllocator.
        m_dtype, v_dtype: "fp32" or "bf16".
    """

    def __init__(self, specs, alloc, m_dtype="fp32", v_dtype="fp32"):
        self.specs = specs
        self.m, self.v = {}, {}
        with alloc.context("Optimizer"):
            for name, shape, _ in specs:
                self.m[name] = alloc.allocate(_dtype(m_dtype), f"m.{name}", shape)
                self.v[name] = alloc.allocate(_dtype(v_dtype), f"v.{name}", shape)
        self.zero()

    def zero(self) -> None:
        for t in (*self.m.values(), *self.v.values()):
            t.fill_zero()

    def host_arrays(self) -> dict[str, np.ndarray]:
        out = {}
        for name in self.m:
            out[f"m.{name}"] = self.m[name].numpy()
            out[f"v.{name}"] = self.v[name].numpy()
        return out


def global_norm(rs, grads: dict, max_norm: float, stream=None) -> None:
    """rs.norm_result = [‖g‖, clip scale] over all gradients, in a fixed order (deterministic).
    `max_norm` 0 disables clipping (the scale stays 1)."""
    rs.norm_partials.fill_zero(stream)
    for g in grads.values():
        norm.global_norm_squared(rs.norm_partials, g, stream=stream)
    norm.global_norm_finish(rs.norm_result, rs.norm_partials, float(max_norm), stream=stream)


def adamw_step(weights, grads: dict, state: AdamWState, rs, seed: int, stream=None) -> None:
    """One AdamW update of every parameter, reading rs.hparams and the clip scale on device.
    Norm weights and biases take no weight decay. `seed` drives bf16 stochastic rounding: each
    tensor gets a fixed seed derived from it (the step in hparams varies the draws), so the
    update can be captured into a graph and a resumed run rounds exactly as the original."""
    scale = rs.norm_result.rows(1, 2)  # (1,) clip scale
    for i, (name, _, decays) in enumerate(state.specs):
        adamw.adamw_update(weights[name], grads[name], state.m[name], state.v[name], rs.hparams, scale, decays,
                           (seed + 7919 * i) & 0x7FFFFFFF, stream=stream)  # fmt: skip
