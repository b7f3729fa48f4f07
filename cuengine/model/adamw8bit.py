"""8-bit AdamW state: m and v as block-wise dynamic 8-bit codes (see kernels/adamw8bit.py).

Everything but the moments is AdamWState's: the hyper-parameters on the device, the deterministic
global norm and the NaN clip scale that skips a step, so `LlamaModel` drives either alike. On one GPU
the update is one launch over every tensor (`adamw8bit.AdamW8bitTable`, written at the first update)
and so is the global norm (AdamWState's multi-tensor norm table), bitwise the per-tensor launches that
ZeRO's stage 0 keeps.
"""

from __future__ import annotations

import math

import numpy as np

from ..dtypes import BYTE, FP32
from ..kernels import adamw, adamw8bit, norm
from .optimizer import AdamWState, tensor_seed


class AdamW8bitState(AdamWState):
    """Codes `qm`/`qv` (one byte per parameter) and fp32 block abs-maxes `absmax_m`/`absmax_v`
    (one per 256 parameters), all in context "Optimizer" and all kept by checkpoints.

    Args:
        specs: [(name, shape, decays)] from `weights.param_specs`.
        alloc: the TensorAllocator.
        multi_tensor: update every tensor in one launch through a table (context "Optimizer", built
            at the first update); False: one `adamw8bit_update` launch per tensor.
    """

    def __init__(self, specs, alloc, multi_tensor: bool = True):  # AdamWState.__init__ would allocate fp32 moments
        self.specs = specs
        self.multi_tensor = multi_tensor
        self._multi = None  # (key, AdamW8bitTable) of the last update
        self.device = alloc.device
        self.qm, self.qv, self.absmax_m, self.absmax_v = {}, {}, {}, {}
        with alloc.context("Optimizer"):
            for name, shape, _ in specs:
                nb = adamw8bit.num_blocks(int(np.prod(shape)))
                self.qm[name] = alloc.allocate(BYTE, f"qm.{name}", shape)
                self.qv[name] = alloc.allocate(BYTE, f"qv.{name}", shape)
                self.absmax_m[name] = alloc.allocate(FP32, f"absmax_m.{name}", (nb,))
                self.absmax_v[name] = alloc.allocate(FP32, f"absmax_v.{name}", (nb,))
            self.qmaps = alloc.allocate(FP32, "qmaps", (1024,))
            if multi_tensor:
                numels = [math.prod(shape) for _, shape, _ in specs]
                shape = adamw8bit.multi_tensor_table_shape(numels)
                self.update_table_bytes = alloc.allocate(BYTE, "adamw8bit_table", shape)
                # the global norm through AdamWState's multi-tensor table (one launch, bitwise the loop)
                self.table_bytes = {"norm": alloc.allocate(BYTE, "norm_table", adamw.multi_tensor_table_shape(numels))}
                self.norm_sums = alloc.allocate(FP32, "norm_sums", adamw.multi_norm_sums_shape(numels))
                self._tables = {}
            self.hparams = alloc.allocate(FP32, "hparams", (8,))  # adamw.make_hparams layout
            self.hparams_host = alloc.allocate(FP32, "hparams_host", (8,), kind="pinned")
            self.norm_partials = alloc.allocate(FP32, "norm_partials", norm.norm_partials_shape())
            self.norm_result = alloc.allocate(FP32, "norm_result", (2,))  # [‖g‖, clip scale]
            self.norm_host = alloc.allocate(FP32, "norm_host", (2,), kind="pinned")
        self.hparams_event = self.device.event()
        self.qmaps.copy_from_numpy(adamw8bit.make_qmaps())
        self.zero()

    @property
    def records_abs_max(self) -> bool:
        """The 8-bit update records no FP8 weight abs-max (its table has no slots for them)."""
        return False

    def state_tensors(self) -> dict:
        """{checkpoint key: Tensor} of the state a checkpoint keeps."""
        out = {}
        for name in self.qm:
            out[f"qm.{name}"] = self.qm[name]
            out[f"qv.{name}"] = self.qv[name]
            out[f"absmax_m.{name}"] = self.absmax_m[name]
            out[f"absmax_v.{name}"] = self.absmax_v[name]
        return out

    def zero(self) -> None:
        """A zero abs-max dequantizes every code of its block to 0; the codes are zeroed too, so a
        fresh state is the same bytes whatever was there before."""
        for t in self.state_tensors().values():
            t.fill_zero()

    def host_arrays(self) -> dict[str, np.ndarray]:
        return {k: t.numpy() for k, t in self.state_tensors().items()}

    def _multi_table(self, weights, grads: dict, seed: int):
        """The AdamW8bitTable of these tensors, built (a host→device copy) when their addresses or the
        seed differ from the last update's, so a table never points at memory that moved; None when
        the parameters or the gradients mix dtypes (one kernel instantiation per table)."""
        names = [n for n, _, _ in self.specs]
        params, gs = [weights[n] for n in names], [grads[n] for n in names]
        key = (seed, tuple((t.ptr, t.nelem, t.dtype) for t in (*params, *gs)))
        if self._multi is not None and self._multi[0] == key:
            return self._multi[1]
        if len({t.dtype for t in params}) != 1 or len({t.dtype for t in gs}) != 1:
            return None
        table = adamw8bit.AdamW8bitTable(
            self.update_table_bytes, params, gs, [self.qm[n] for n in names], [self.qv[n] for n in names],
            [self.absmax_m[n] for n in names], [self.absmax_v[n] for n in names], [d for _, _, d in self.specs],
            [tensor_seed(seed, i) for i in range(len(names))])  # fmt: skip
        self._multi = (key, table)
        return table

    def update(self, weights, grads: dict, seed: int, stream=None) -> None:
        """One 8-bit AdamW update of every parameter (see AdamWState.update: a NaN clip scale writes
        nothing; each tensor's rounding seed is derived from `seed` the same way). With `multi_tensor`
        one launch (the first call builds its table: make it outside a graph capture, as LlamaModel's
        warm-up step does), with the bits of one `adamw8bit_update` per tensor."""
        scale = self.norm_result.rows(1, 2)
        table = self._multi_table(weights, grads, seed) if self.multi_tensor and self.specs else None
        if table is not None:
            adamw8bit.adamw8bit_update_multi(table, self.qmaps, self.hparams, scale, stream=stream)
            return
        for i, (name, _, decays) in enumerate(self.specs):
            adamw8bit.adamw8bit_update(weights[name], grads[name], self.qm[name], self.qv[name], self.absmax_m[name],
                                       self.absmax_v[name], self.qmaps, self.hparams, scale, decays,
                                       tensor_seed(seed, i), stream=stream)  # fmt: skip
