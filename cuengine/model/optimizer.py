"""AdamW over the model's parameters, with a deterministic global gradient norm and clipping.

Everything stays on the device: the norm is reduced into fixed partial slots (the same order
every step, so the same bits), `global_norm_finish` turns it into [norm, clip scale], and each
`adamw_update` reads the clip scale and the hyper-parameters from device memory. The host only
refreshes the hyper-parameters with one small host→device copy before the step, so the norm and
the update can be captured into a CUDA graph and replayed with new hyper-parameters.

The norm and the update each run as one multi-tensor launch over a table of every parameter
(`adamw.MultiTensorTable`, about 170 tensors at the 0.5B shape: 170 launches become 1, and the
small norms and biases stop costing a launch each), bitwise equal to the per-tensor launches.
"""

from __future__ import annotations

import math

import numpy as np

from ..dtypes import BYTE, FP32
from ..dtypes import dtype as _dtype
from ..kernels import adamw, fp8, norm


def tensor_seed(seed: int, i: int) -> int:
    """The stochastic-rounding seed of the i-th parameter (in `specs` order) under the run's seed."""
    return (seed + 7919 * i) & 0x7FFFFFFF


class AdamWState:
    """AdamW's buffers: first and second moments for every parameter, the hyper-parameters on
    device (with their pinned staging copy), the norm's partial sums and [norm, clip scale]; all
    in context "Optimizer". Only the moments are state a checkpoint keeps (`host_arrays`).

    Args:
        specs: [(name, shape, decays)] from `weights.param_specs`.
        alloc: the TensorAllocator.
        m_dtype, v_dtype: "fp32" or "bf16".
    """

    # {"norm" | "adamw": (key, MultiTensorTable)} built on first use; None in Muon, which loops over
    # the tensors (the 8-bit state uses only "norm": its update has a table of its own)
    _tables: dict | None = None

    def __init__(self, specs, alloc, m_dtype="fp32", v_dtype="fp32"):
        self.specs = specs
        self.device = alloc.device
        self.m, self.v = {}, {}
        with alloc.context("Optimizer"):
            for name, shape, _ in specs:
                self.m[name] = alloc.allocate(_dtype(m_dtype), f"m.{name}", shape)
                self.v[name] = alloc.allocate(_dtype(v_dtype), f"v.{name}", shape)
            self.hparams = alloc.allocate(FP32, "hparams", (8,))  # adamw.make_hparams layout
            self.hparams_host = alloc.staging(self.hparams, "hparams_host")  # pinned on cuda; hparams on cpu
            self.norm_partials = alloc.allocate(FP32, "norm_partials", norm.norm_partials_shape())
            self.norm_result = alloc.allocate(FP32, "norm_result", (2,))  # [‖g‖, clip scale]
            self.norm_host = alloc.staging(self.norm_result, "norm_host")
            numels = [math.prod(shape) for _, shape, _ in specs]
            shape = adamw.multi_tensor_table_shape(numels)
            self.table_bytes = {k: alloc.allocate(BYTE, f"{k}_table", shape) for k in ("norm", "adamw")}
            self.norm_sums = alloc.allocate(FP32, "norm_sums", adamw.multi_norm_sums_shape(numels))
        self._tables = {}
        self.hparams_event = self.device.event()  # the last copy out of hparams_host
        self.zero()

    def zero(self) -> None:
        for t in (*self.m.values(), *self.v.values()):
            t.fill_zero()

    def state_tensors(self) -> dict:
        """{checkpoint key: Tensor} of the state a checkpoint keeps: the moments."""
        out = {}
        for name in self.m:
            out[f"m.{name}"] = self.m[name]
            out[f"v.{name}"] = self.v[name]
        return out

    def host_arrays(self) -> dict[str, np.ndarray]:
        return {k: t.numpy() for k, t in self.state_tensors().items()}

    def set_hparams(self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> None:
        """Enqueue the copy of the next update's hyper-parameters to the device (no host sync,
        except waiting for the previous copy out of the pinned staging buffer)."""
        self.hparams_event.synchronize()
        self.hparams_host.array()[...] = adamw.make_hparams(lr, beta1, beta2, eps, weight_decay, step)
        self.device.copy_async(self.hparams, self.hparams_host)
        self.device.stream.record(self.hparams_event)

    @property
    def records_abs_max(self) -> bool:
        """Whether `update` takes `abs_max=` (AdamW: yes; the 8-bit and Muon states: no)."""
        return self._tables is not None

    def _table(self, kind: str, grads: list, params=None, seed: int = 0, abs_maxes=None):
        """The multi-tensor table of these tensors, built (a host→device copy) when they differ from
        the last call's; None when they do not fit the buffers sized from `specs` (one dtype per role,
        as many elements), and the caller loops per tensor. The key is the tensors' addresses, so a
        table never points at memory that moved. `abs_maxes`: per tensor, None or its abs-max slot."""
        if self._tables is None:
            return None
        names = [n for n, _, _ in self.specs]
        roles = [grads] if params is None else [params, grads, [self.m[n] for n in names], [self.v[n] for n in names]]
        slots = tuple(None if a is None else a.ptr for a in abs_maxes or ())
        key = (seed, tuple((t.ptr, t.nelem, t.dtype) for ts in roles for t in ts), slots)
        got = self._tables.get(kind)
        if got is not None and got[0] == key:
            return got[1]
        numels = [t.nelem for t in grads]
        if (len(grads) != len(names) or any(len({t.dtype for t in ts}) != 1 for ts in roles)
                or adamw.multi_tensor_table_shape(numels) != self.table_bytes[kind].shape
                or adamw.multi_norm_sums_shape(numels) != self.norm_sums.shape):  # fmt: skip
            return None
        if params is None:
            table = adamw.MultiTensorTable(self.table_bytes[kind], grads)
        else:
            decays = [d for _, _, d in self.specs]
            seeds = [tensor_seed(seed, i) for i in range(len(names))]
            table = adamw.MultiTensorTable(self.table_bytes[kind], grads, params, roles[2], roles[3], decays, seeds,
                                           abs_maxes=abs_maxes)  # fmt: skip
        self._tables[kind] = (key, table)
        return table

    def global_norm(self, grads: dict, max_norm: float, stream=None) -> None:
        """norm_result = [‖g‖, clip scale] over all gradients, in a fixed order (deterministic).
        `max_norm` 0 disables clipping (the scale stays 1); a non-finite norm makes the scale NaN,
        which `update` reads as "skip". The first call builds the multi-tensor table (a host→device
        copy): make it outside a graph capture, as LlamaModel's warm-up step does."""
        table = self._table("norm", list(grads.values()))
        if table is not None:
            adamw.global_norm_squared_multi(self.norm_partials, self.norm_sums, table, stream=stream)
        else:
            self.norm_partials.fill_zero(stream)
            for g in grads.values():
                norm.global_norm_squared(self.norm_partials, g, stream=stream)
        norm.global_norm_finish(self.norm_result, self.norm_partials, float(max_norm), stream=stream)

    def update(self, weights, grads: dict, seed: int, stream=None, abs_max: dict | None = None) -> None:
        """One AdamW update of every parameter, reading the hyper-parameters and the clip scale
        on device; a NaN clip scale (non-finite norm) changes no parameter and no moment. Norm
        weights and biases take no weight decay. `seed` drives bf16 stochastic
        rounding: each tensor gets a fixed seed derived from it (the step in hparams varies the
        draws), so the update can be captured into a graph and a resumed run rounds exactly as
        the original. One launch over every tensor (the first call builds its table: see
        `global_norm`), with the bits of one `adamw_update` per tensor.

        `abs_max`: {name: (1,) fp32 slot}; each slot max-accumulates max|w| of that parameter as
        stored after the update (of the unchanged weights on a skipped step), recorded by the update's
        own stores (`ModelWeights.abs_max_slots`, zeroed first): the FP8 copies then need no abs-max pass."""
        scale = self.norm_result.rows(1, 2)  # (1,) clip scale
        names = [n for n, _, _ in self.specs]
        slots = None if abs_max is None else [abs_max.get(n) for n in names]
        table = self._table("adamw", [grads[n] for n in names], [weights[n] for n in names], seed, slots)
        if table is not None:
            adamw.adamw_update_multi(table, self.hparams, scale, stream=stream)
            return
        for i, (name, _, decays) in enumerate(self.specs):
            adamw.adamw_update(weights[name], grads[name], self.m[name], self.v[name], self.hparams, scale, decays,
                               tensor_seed(seed, i), stream=stream)  # fmt: skip
            if slots is not None and slots[i] is not None:
                fp8.abs_max(slots[i], weights[name], stream=stream)
