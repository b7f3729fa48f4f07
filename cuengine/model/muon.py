"""Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers"; at scale: Liu et al. 2025,
"Muon is Scalable for LLM Training", Moonlight) for the blocks' 2-D matrices, AdamW for the rest.

Each HF matrix (q, k, v, o, gate, up, down: the packed qkv_w and up_w are split into their HF row
views, so q, k and v are orthogonalized separately, as are gate and up) gets
    buf = mu buf + g;  u = g + mu buf                             (Nesterov momentum)
    X = u / ‖u‖_F, then 5 Newton–Schulz iterations X = a X + (b A + c A²) X, A = X Xᵀ (the smaller
        Gram matrix: XᵀX with X on the left for a tall matrix), (a, b, c) = (3.4445, -4.7750, 2.0315)
    W = W - lr (wd W + 0.2 sqrt(max(rows, cols)) X)
The quintic's coefficients push every singular value of X into roughly [0.7, 1.2] in 5 steps
rather than converging to exactly 1: an approximate U Vᵀ. The scale 0.2 sqrt(max(rows, cols)) is
Moonlight's: it gives the update the RMS of a typical AdamW update, so the run's one learning rate
and weight decay serve both the Muon matrices and the AdamW parameters (embeddings, LM head, norms
and biases; `AdamWState`'s fp32 moments). The matmuls are bf16 through `blas.matmul`, on scratch
buffers allocated once for the largest matrix; the rest is kernels/muon.py. A NaN clip scale
writes nothing (muon_momentum and muon_apply skip), like AdamW.
"""

from __future__ import annotations

import math

import numpy as np

from .. import blas
from ..dtypes import BF16, FP32
from ..kernels import adamw, muon, norm
from .optimizer import AdamWState
from .weights import MATMUL_WEIGHTS, hf_layout

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def lr_scale(rows: int, cols: int) -> float:
    """Moonlight's update scale: matches AdamW's update RMS (about 0.2) for a matrix of this shape."""
    return 0.2 * math.sqrt(max(rows, cols))


def newton_schulz_reference(g: np.ndarray, steps: int = NS_STEPS) -> np.ndarray:
    """The float64 Newton–Schulz orthogonalization of one matrix (the method, without bf16)."""
    a, b, c = NS_COEFFS
    x = np.asarray(g, np.float64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


class MuonState(AdamWState):
    """Momentum `buf` (fp32) for the blocks' matrices, AdamW moments `m`, `v` (fp32) for the other
    parameters, the shared hyper-parameters and norm, and the Newton–Schulz scratch; all in
    context "Optimizer".

    Args:
        cfg: TransformerConfig (for the HF row views of the packed matrices).
        specs: [(name, shape, decays)] from `weights.param_specs`.
        alloc: the TensorAllocator.
        momentum: Muon's mu (hparams slot 6).
    """

    def __init__(self, cfg, specs, alloc, momentum: float = 0.95):
        self.specs = specs
        self.device = alloc.device
        self.momentum = float(momentum)
        layout = hf_layout(cfg)
        self.views: dict[str, list[tuple[int, int, int]]] = {}  # engine name: [(first row, rows, cols)]
        for name, shape, _ in specs:
            if name.rsplit(".", 1)[-1] in MATMUL_WEIGHTS:
                self.views[name] = [(0, shape[0], shape[1]) if a == b == 0 else (a, b - a, shape[1])
                                    for _, a, b in layout[name]]  # fmt: skip
        mats = [v for vs in self.views.values() for v in vs]
        big = max(math.prod(s) for n, s, _ in specs if n in self.views)
        gram = max(min(r, c) for _, r, c in mats) ** 2
        self.m, self.v, self.buf = {}, {}, {}
        with alloc.context("Optimizer"):
            for name, shape, _ in specs:
                if name in self.views:
                    self.buf[name] = alloc.allocate(FP32, f"buf.{name}", shape)
                else:
                    self.m[name] = alloc.allocate(FP32, f"m.{name}", shape)
                    self.v[name] = alloc.allocate(FP32, f"v.{name}", shape)
            self.g = alloc.allocate(FP32, "muon.g", (big,))  # momentum + gradient of one engine tensor
            self.x = alloc.allocate(BF16, "muon.x", (big,))
            self.xb = alloc.allocate(BF16, "muon.xb", (big,))
            self.a = alloc.allocate(BF16, "muon.a", (gram,))
            self.aa = alloc.allocate(BF16, "muon.aa", (gram,))
            self.ns_partials = alloc.allocate(FP32, "muon.partials", norm.norm_partials_shape())
            self.ns_result = alloc.allocate(FP32, "muon.norm", (2,))
            self.hparams = alloc.allocate(FP32, "hparams", (8,))  # adamw.make_hparams layout, mu at 6
            self.hparams_host = alloc.allocate(FP32, "hparams_host", (8,), kind="pinned")
            self.norm_partials = alloc.allocate(FP32, "norm_partials", norm.norm_partials_shape())
            self.norm_result = alloc.allocate(FP32, "norm_result", (2,))  # [‖g‖, clip scale]
            self.norm_host = alloc.allocate(FP32, "norm_host", (2,), kind="pinned")
        self.hparams_event = self.device.event()
        self.zero()

    def state_tensors(self) -> dict:
        out = {f"buf.{n}": t for n, t in self.buf.items()}
        for name in self.m:
            out[f"m.{name}"] = self.m[name]
            out[f"v.{name}"] = self.v[name]
        return out

    def zero(self) -> None:
        for t in self.state_tensors().values():
            t.fill_zero()

    def set_hparams(self, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> None:
        self.hparams_event.synchronize()
        hp = adamw.make_hparams(lr, beta1, beta2, eps, weight_decay, step)
        hp[6] = self.momentum
        self.hparams_host.array()[...] = hp
        self.device.copy_async(self.hparams, self.hparams_host)
        self.device.stream.record(self.hparams_event)

    def orthogonalize(self, x, g, stream=None) -> None:
        """x (bf16, (rows, cols)) = the Newton–Schulz orthogonalization of g (fp32, (rows, cols))."""
        rows, cols = g.shape
        k = min(rows, cols)
        A = self.a.rows(0, k * k).reshape(k, k)
        AA = self.aa.rows(0, k * k).reshape(k, k)
        xb = self.xb.rows(0, rows * cols).reshape(rows, cols)
        self.ns_partials.fill_zero(stream)
        norm.global_norm_squared(self.ns_partials, g, stream=stream)
        norm.global_norm_finish(self.ns_result, self.ns_partials, 0.0, stream=stream)
        muon.muon_normalize(x, g, self.ns_result, stream=stream)
        a, b, c = NS_COEFFS
        for _ in range(NS_STEPS):
            if rows <= cols:
                blas.matmul(A, x, x, stream=stream)  # X Xᵀ
            else:
                blas.matmul(A, x, x, trans_a=True, trans_b=False, stream=stream)  # Xᵀ X
            blas.matmul(AA, A, A, stream=stream)  # A Aᵀ = A² (A is symmetric)
            muon.muon_axpby(AA, A, AA, b, c, stream=stream)  # B = b A + c A²
            if rows <= cols:
                blas.matmul(xb, AA, x, trans_b=False, stream=stream)  # B X
            else:
                blas.matmul(xb, x, AA, trans_b=False, stream=stream)  # X B
            muon.muon_axpby(x, x, xb, a, 1.0, stream=stream)

    def update(self, weights, grads: dict, seed: int, stream=None) -> None:
        """One step: Muon for the block matrices (per HF view), AdamW for the rest; each tensor's
        rounding seed is derived from `seed` as AdamWState.update does."""
        scale = self.norm_result.rows(1, 2)
        for i, (name, shape, decays) in enumerate(self.specs):
            s = (seed + 7919 * i) & 0x7FFFFFFF
            if name not in self.buf:
                adamw.adamw_update(weights[name], grads[name], self.m[name], self.v[name], self.hparams, scale, decays,
                                   s, stream=stream)  # fmt: skip
                continue
            n = math.prod(shape)
            g = self.g.rows(0, n).reshape(*shape)
            muon.muon_momentum(self.buf[name], g, grads[name], self.hparams, scale, stream=stream)
            for r0, rows, cols in self.views[name]:
                x = self.x.rows(0, rows * cols).reshape(rows, cols)
                self.orthogonalize(x, g.rows(r0, r0 + rows), stream=stream)
                muon.muon_apply(weights[name].rows(r0, r0 + rows), x, self.hparams, scale, lr_scale(rows, cols), s,
                                r0 * cols, stream=stream)  # fmt: skip
