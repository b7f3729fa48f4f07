"""Muon's elementwise steps (momentum, normalization, the Newton–Schulz polynomial's sums, the
update); the matmuls between them are `blas.matmul`. See cuengine/model/muon.py for the recipe.

Each launcher runs its NumPy twin on the cpu device, with the kernel's fp32 rounding points, so a
whole Muon step on the cpu is the reference the GPU is compared with.
"""

from __future__ import annotations

import numpy as np

from .. import _checks
from ..dtypes import BF16, FP32
from . import _build
from .adamw import _store

_F32 = np.float32


def _grid(dev, n):
    return _build.grid_size(dev, n, 256 * 4)


def _skip(grad_scale) -> bool:
    return grad_scale is not None and not np.isfinite(grad_scale.array()[0])


def muon_momentum(buf, out, grad, hparams, grad_scale, stream=None) -> None:
    """buf = mu buf + g; out = g + mu buf (Nesterov), g = grad * grad_scale, mu = hparams[6].

    Args:
        buf: fp32, N elements (the momentum, in place).
        out: fp32, N elements (written).
        grad: fp32 or bf16, N elements.
        hparams: (8,) fp32, as adamw's with Muon's momentum at slot 6.
        grad_scale: (1,) fp32 clip scale or None; non-finite: nothing is written.
    """
    what = "muon_momentum"
    _checks.expect(buf, f"{what}: buf", dtype=FP32)  # (N,)
    _checks.expect(out, f"{what}: out", dtype=FP32)  # (N,)
    _checks.expect(grad, f"{what}: grad", dtype=(FP32, BF16))  # (N,)
    _checks.expect(hparams, f"{what}: hparams", dtype=FP32, shape=(8,))  # (8,)
    if grad_scale is not None:
        _checks.expect(grad_scale, f"{what}: grad_scale", dtype=FP32, shape=(1,))  # (1,)
    _same_size(what, buf, out, grad)
    dev = _checks.same_device(buf, out, grad, hparams, grad_scale)
    n = buf.nelem
    if n == 0:
        return
    if dev.is_cpu:
        if _skip(grad_scale):
            return
        mu = hparams.array()[6]
        gs = _F32(1) if grad_scale is None else grad_scale.array()[0]
        g = grad.array().astype(_F32).reshape(-1) * gs
        b = mu * buf.array().reshape(-1) + g
        buf.array()[...] = b.reshape(buf.shape)
        out.array()[...] = (g + mu * b).reshape(out.shape)
        return
    _build.launch("muon", _build.kernel_name("muon_momentum", grad), _grid(dev, n), 256,
                  (buf, out, grad, hparams, grad_scale, np.int64(n)), dev, stream)  # fmt: skip


def muon_normalize(x, g, result, stream=None) -> None:
    """x = bf16(g / (result[0] + 1e-7)): g over its Frobenius norm (result of global_norm_finish).

    Args:
        x: bf16, N elements (written). g: fp32, N elements. result: (2,) fp32.
    """
    what = "muon_normalize"
    _checks.expect(x, f"{what}: x", dtype=BF16)  # (N,)
    _checks.expect(g, f"{what}: g", dtype=FP32)  # (N,)
    _checks.expect(result, f"{what}: result", dtype=FP32, shape=(2,))  # (2,)
    _same_size(what, x, g)
    dev = _checks.same_device(x, g, result)
    n = x.nelem
    if n == 0:
        return
    if dev.is_cpu:
        d = result.array()[0] + _F32(1e-7)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            x.array()[...] = (g.array() / d).astype(BF16.np).reshape(x.shape)
        return
    _build.launch("muon", "muon_normalize", _grid(dev, n), 256, (x, g, result, np.int64(n)), dev, stream)


def muon_axpby(out, x, y, alpha: float, beta: float, stream=None) -> None:
    """out = bf16(alpha x + beta y), all bf16 with N elements; out may be x."""
    what = "muon_axpby"
    for t, label in ((out, "out"), (x, "x"), (y, "y")):
        _checks.expect(t, f"{what}: {label}", dtype=BF16)  # (N,)
    _same_size(what, out, x, y)
    dev = _checks.same_device(out, x, y)
    n = out.nelem
    if n == 0:
        return
    if dev.is_cpu:
        r = _F32(alpha) * x.array().astype(_F32) + _F32(beta) * y.array().astype(_F32)
        out.array()[...] = r.astype(BF16.np).reshape(out.shape)
        return
    _build.launch("muon", "muon_axpby", _grid(dev, n), 256, (out, x, y, _F32(alpha), _F32(beta), np.int64(n)), dev,
                  stream)  # fmt: skip


def muon_apply(param, x, hparams, grad_scale, scale: float, seed: int, index_offset: int = 0, stream=None) -> None:
    """param = param - lr (wd param + scale x), lr = hparams[0], wd = hparams[4]; bf16 params round
    stochastically with adamw's draws (array 0, step hparams[5]); a non-finite clip scale writes nothing.

    Args:
        param: fp32 or bf16, N elements (in place). x: bf16, N elements (the orthogonalized update).
        scale: the shape-dependent LR scale of the matrix.
        seed, index_offset: as in adamw.adamw_update (a row view passes its first element's index).
    """
    what = "muon_apply"
    _checks.expect(param, f"{what}: param", dtype=(FP32, BF16))  # (N,)
    _checks.expect(x, f"{what}: x", dtype=BF16)  # (N,)
    _checks.expect(hparams, f"{what}: hparams", dtype=FP32, shape=(8,))  # (8,)
    if grad_scale is not None:
        _checks.expect(grad_scale, f"{what}: grad_scale", dtype=FP32, shape=(1,))  # (1,)
    _same_size(what, param, x)
    dev = _checks.same_device(param, x, hparams, grad_scale)
    n = param.nelem
    seed = int(seed) & 0xFFFFFFFF
    if n == 0:
        return
    if dev.is_cpu:
        if _skip(grad_scale):
            return
        hp = hparams.array()
        p = param.array().astype(_F32).reshape(-1)
        upd = hp[4] * p + _F32(scale) * x.array().astype(_F32).reshape(-1)
        p = p - hp[0] * upd
        param.array()[...] = _store(p, param.dtype.np, seed, int(hp[5]), 0, index_offset).reshape(param.shape)
        return
    name = _build.kernel_name("muon_apply", param)
    _build.launch("muon", name, _grid(dev, n), 256, (param, x, hparams, grad_scale, _F32(scale), np.uint32(seed),
                                                       np.int64(n), np.int64(index_offset)), dev, stream)  # fmt: skip


def _same_size(what, first, *others) -> None:
    for t in others:
        if t.nelem != first.nelem:
            raise ValueError(f"{what}: {t.name!r} {t.shape} {t.dtype} has {t.nelem} elements, "
                             f"{first.name!r} {first.shape} has {first.nelem}")  # fmt: skip
