"""MLP activations, plain and gated, forward and backward (raw_kernels/activations.cu).

Plain activations map (N, H) to (N, H). Gated ones read (N, 2H) holding gate and up and write (N, H):
layout "split" is [gate | up] halves of each row (the model's packed up projection), "interleaved"
is gate = x[:, 0::2], up = x[:, 1::2] (the standalone MLP op, seed 002). The backward writes the
gradient of the whole input in the same layout and may overwrite the input (in place), as the seed
does with its mlp_up buffer. activation_forward_quant writes E4M3 through the forward's own kernel
body. The model's FFN (swiglu_*: split layout) and ops.mlp (interleaved) share these kernels.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_aligned, check_vector_width, expect, overlaps, same_device
from ..dtypes import BF16, FP8_E4M3, FP8_E5M2, FP16, FP32
from ..tensor import STAT_ABS_MAX, STAT_SCALE, STAT_SCALE_INV, stats_values
from ._build import ceil_div, grid_size, kernel_name, launch, write_twin_results
from .fp8 import quantize_with_scale_reference

FAMILY = "activations"
FLOATS = (FP32, BF16, FP16)

PLAIN = ("silu", "gelu_tanh_approx", "relu", "relu_sq")
GATED = ("swiglu", "swiglu_oai", "reglu", "geglu", "glu")
ACTIVATIONS = PLAIN + GATED
LAYOUTS = ("split", "interleaved")

# kernel ids (enum Act in activations.cu): plain ones by name, gated ones by their gate function
_ACT_ID = {"silu": 0, "gelu_tanh_approx": 1, "relu": 2, "relu_sq": 3,
           "swiglu": 0, "geglu": 1, "reglu": 2, "glu": 4, "swiglu_oai": 5}  # fmt: skip

_GELU_K = np.float32(np.sqrt(2.0 / np.pi))
_GELU_A = np.float32(0.044715)
_OAI_ALPHA = np.float32(1.702)
_OAI_LIMIT = np.float32(7.0)


# ---- NumPy twins (fp32 math, as the kernels) ----------------------------------------------
def _sigmoid(x):
    with np.errstate(over="ignore"):
        return np.float32(1) / (np.float32(1) + np.exp(-x))


def _value(f: str, x):
    """f(x) for the plain functions and the gate functions of gated activations."""
    if f == "silu":
        return x * _sigmoid(x)
    if f == "gelu_tanh_approx":  # x * sigmoid(2u) == 0.5 x (1 + tanh(u)), without the cancellation at x < 0
        return x * _sigmoid(np.float32(2) * _GELU_K * (x + _GELU_A * x * x * x))
    if f == "relu":
        return np.where(x > 0, x, np.float32(0))
    if f == "relu_sq":
        return np.where(x > 0, x * x, np.float32(0))
    return _sigmoid(x)


def _grad(f: str, x):
    if f == "silu":
        s = _sigmoid(x)
        return s * (np.float32(1) + x * (np.float32(1) - s))
    if f == "gelu_tanh_approx":
        x2 = x * x
        s = _sigmoid(np.float32(2) * _GELU_K * (x + _GELU_A * x2 * x))
        return s + x * (np.float32(2) * _GELU_K) * (np.float32(1) + np.float32(3) * _GELU_A * x2) * s * (
            np.float32(1) - s
        )
    if f == "relu":
        return np.where(x > 0, np.float32(1), np.float32(0))
    if f == "relu_sq":
        return np.where(x > 0, np.float32(2) * x, np.float32(0))
    s = _sigmoid(x)
    return s * (np.float32(1) - s)


_GATE_FN = {"swiglu": "silu", "geglu": "gelu_tanh_approx", "reglu": "relu", "glu": "sigmoid"}


def _split(x: np.ndarray, layout: str):
    H = x.shape[-1] // 2
    if layout == "split":
        return x[..., :H], x[..., H:]
    return x[..., 0::2], x[..., 1::2]


def activation_forward_np(inp: np.ndarray, activation: str, layout: str = "split") -> np.ndarray:
    """The activation of inp: (..., H) -> (..., H) plain, (..., 2H) -> (..., H) gated.

    fp32 math, rounded to inp's dtype. NumPy equivalent for swiglu, split layout:
    `g, u = x[:, :H], x[:, H:]; out = g / (1 + exp(-g)) * u`.
    """
    x = inp.astype(np.float32)
    if activation in PLAIN:
        return _value(activation, x).astype(inp.dtype)
    g, u = _split(x, layout)
    if activation == "swiglu_oai":
        gc, uc = np.minimum(g, _OAI_LIMIT), np.clip(u, -_OAI_LIMIT, _OAI_LIMIT)
        y = gc * _sigmoid(_OAI_ALPHA * gc) * (uc + np.float32(1))
    else:
        y = _value(_GATE_FN[activation], g) * u
    return y.astype(inp.dtype)


def activation_backward_np(dout: np.ndarray, inp: np.ndarray, activation: str, layout: str = "split") -> np.ndarray:
    """The gradient with respect to inp (same shape and layout as inp), rounded to inp's dtype.

    Kinks follow PyTorch: relu'(0) = 0; swiglu_oai's clamps pass the gradient at their bounds.
    """
    x, d = inp.astype(np.float32), dout.astype(np.float32)
    if activation in PLAIN:
        return (d * _grad(activation, x)).astype(inp.dtype)
    g, u = _split(x, layout)
    if activation == "swiglu_oai":
        gc, uc = np.minimum(g, _OAI_LIMIT), np.clip(u, -_OAI_LIMIT, _OAI_LIMIT)
        s = _sigmoid(_OAI_ALPHA * gc)
        glu = gc * s
        dg = np.where(g <= _OAI_LIMIT, d * (uc + np.float32(1)) * (s + _OAI_ALPHA * glu * (np.float32(1) - s)), 0)
        du = np.where((u >= -_OAI_LIMIT) & (u <= _OAI_LIMIT), d * glu, 0)
    else:
        f = _GATE_FN[activation]
        dg, du = d * u * _grad(f, g), d * _value(f, g)
    dx = np.empty_like(x)
    dg_view, du_view = _split(dx, layout)
    dg_view[...], du_view[...] = dg, du
    return dx.astype(inp.dtype)


def activation_forward_quant_np(inp: np.ndarray, activation: str, layout: str, abs_max: float, scale=None):
    """(q, scale, scale_inv): E4M3 of the activation of inp, rounded to inp's dtype, times scale.

    scale = 448 / abs_max (1 when abs_max is 0), as cuengine.tensor.stats_values, unless given (delayed
    scaling); values are clipped to +-448 and rounded to nearest even (SATFINITE).
    """
    return _e4m3_of(activation_forward_np(inp, activation, layout), abs_max, scale)


def _e4m3_of(value: np.ndarray, abs_max: float, scale=None):
    """(q, scale, scale_inv) of activation_forward_quant_np, from the activation's value itself."""
    if scale is None:
        _, scale, scale_inv = stats_values(abs_max, FP8_E4M3)
    else:
        scale, scale_inv = np.float32(scale), np.float32(1) / np.float32(scale)
    return quantize_with_scale_reference(value, scale, FP8_E4M3), scale, scale_inv


# ---- launchers ----------------------------------------------------------------------------
def _shapes(what, out_like, inp, activation, layout):
    """(N, H) after checking activation, layout and the (N, H) / (N, 2H) shapes.

    out_like = (name, tensor, dtype): the (N, H) operand, of `dtype` (None: inp's dtype).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"{what}: unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"{what}: unknown layout {layout!r}; choose 'split' or 'interleaved'")
    expect(inp, f"{what} inp", FLOATS)
    if inp.ndim < 1:
        raise ValueError(f"{what} inp: expected shape (..., H), got tensor {inp.name!r} {inp.shape}")
    gated = activation in GATED
    width = inp.shape[-1]
    if gated and width % 2:
        raise ValueError(f"{what} inp: {activation} needs (..., 2H), got tensor {inp.name!r} {inp.shape}")
    H = width // 2 if gated else width
    check_vector_width(what, "H", H, inp.dtype)
    name, out, dtype = out_like
    expect(out, f"{what} {name}", dtype or inp.dtype, inp.shape[:-1] + (H,))
    return (inp.nelem // width if width else 0), H


def _launch(kernel: str, tensors, inp, activation: str, layout: str, N: int, H: int, dev, stream, extra=()):
    """One launch of the `kernel` ("forward", "forward_quant", "backward") of this activation: the plain
    kernels walk the N*H elements as flat 16-byte vectors, the gated ones the (row, vector) pairs of
    the (N, H) output, reading x in `layout`. `tensors` are the kernel's pointer arguments.

    The gated backward takes one vector per thread and a grid that covers them all: a grid-stride loop
    over one wave of resident blocks, or over 16 blocks per SM, kept a thread's next loads behind its
    stores and reached 85-92% of copy on the H200, one vector per thread 96-99%. Its grid.x (up to
    2^31 - 1) is never the limit: that many blocks of 256 vectors would be terabytes. Its "backward_quant_tp"
    and "backward_q_tp" variants take a tile of 128 rows by 64 outputs per block, the transposed FP8 bytes
    passing through shared memory. `extra`: arguments after the sizes (backward_q_tp's E5M2 flag)."""
    vecs = N * H // (16 // inp.dtype.itemsize)
    if activation in GATED:
        name, sizes = kernel_name(f"gated_{kernel}_{layout}", inp), (np.int64(N), np.int32(H))
    else:
        name, sizes = kernel_name(f"act_{kernel}", inp), (np.int64(vecs),)
    args = (*tensors, np.int32(_ACT_ID[activation]), *sizes, *extra)
    if kernel in ("backward_quant_tp", "backward_q_tp"):  # tiles of 128 rows by 64 outputs (TILE_ROWS, TILE_OUTS)
        grid = ceil_div(N, 128) * ceil_div(H, 64)
    elif activation in GATED and kernel == "backward":
        grid = ceil_div(vecs, 256)
    else:
        grid = grid_size(dev, vecs, 256)
    launch(FAMILY, name, grid, 256, args, dev, stream, dependent=True)


def activation_forward(out, inp, activation: str, layout: str = "split", abs_max=None, stream=None) -> None:
    """out = activation(inp); for gated activations out = f(gate) * up.

    Args:
        out: (N, H) (any leading dims), inp's dtype; written (=).
        inp: (N, H) for plain activations, (N, 2H) for gated; fp32, bf16 or fp16; H a multiple of
            16 bytes' worth of elements.
        activation: one of ACTIVATIONS.
        layout: "split" ([gate | up]) or "interleaved" (gate, up alternating); plain ones ignore it.
        abs_max: optional (1,) fp32; max-accumulates |out|.
    NumPy equivalent: activation_forward_np.
    """
    N, H = _shapes("activation_forward", ("out", out, None), inp, activation, layout)
    if abs_max is not None:
        expect(abs_max, "activation_forward abs_max", FP32, (1,))
    dev = same_device(out, inp, abs_max)
    if dev.is_cpu:
        y = activation_forward_np(inp.array(), activation, layout)
        write_twin_results(((out, y),), abs_max, y)
        return
    if N * H == 0:
        return
    check_aligned("activation_forward", out, inp)
    _launch("forward", (out, inp, abs_max), inp, activation, layout, N, H, dev, stream)


def _check_scale(what: str, scale) -> None:
    if scale is not None:
        expect(scale, what, FP32, (1,))


def activation_forward_quant(out_fp8, inp, activation: str, layout: str = "split", stream=None,
                             scale=None) -> None:  # fmt: skip
    """activation(inp) written straight to E4M3, with the abs-max an earlier forward recorded, or with a
    delayed scale.

    Reads out_fp8.abs_max (left unchanged), writes out_fp8.scale = 448 / abs_max and
    out_fp8.scale_inv = 1 / scale (both 1 when abs_max is 0, as stats_values), and the values
    fp8(round(activation(inp)) * scale), clipped to +-448 with round-to-nearest-even. Rounding to
    inp's dtype first makes this equal to activation_forward followed by quantisation: the same
    kernel body serves both, so a recomputed FP8 copy has the bits of the original.

    Args:
        out_fp8: (N, H) e4m3 with an FP8 stats slot.
        inp, activation, layout: as for activation_forward.
        scale: optional (1,) fp32 on the device, delayed scaling (fp8.amax_history_roll's scale column):
            the values are quantised with it, out_fp8's scale and scale_inv become it and its inverse, and
            out_fp8.abs_max max-accumulates |round(activation(inp))| (the abs-max of later steps' scales).
            One pass, where current scaling needs the abs-max before the values.
    NumPy equivalent: activation_forward_quant_np(inp, activation, layout, abs_max, scale).
    """
    what = "activation_forward_quant"
    N, H = _shapes(what, ("out_fp8", out_fp8, FP8_E4M3), inp, activation, layout)
    if out_fp8.stats is None:
        raise ValueError(f"{what} out_fp8: tensor {out_fp8.name!r} carries no FP8 stats slot")
    _check_scale(f"{what} scale", scale)
    dev = same_device(out_fp8, inp, out_fp8.stats, scale)
    if dev.is_cpu:
        stats = out_fp8.stats.array()
        delayed = None if scale is None else scale.array()[0]
        q, s, s_inv = activation_forward_quant_np(inp.array(), activation, layout, stats[STAT_ABS_MAX], delayed)
        out_fp8.array()[...] = q
        stats[STAT_SCALE], stats[STAT_SCALE_INV] = s, s_inv
        if scale is not None:
            write_twin_results((), out_fp8.abs_max, activation_forward_np(inp.array(), activation, layout))
        return
    if N * H == 0:
        return
    check_aligned(what, inp)
    check_aligned(what, out_fp8, nbytes=16 // inp.dtype.itemsize)  # one E4M3 byte per element of a vector
    _launch("forward_quant", (out_fp8, inp, out_fp8.stats, scale), inp, activation, layout, N, H, dev, stream)


def _check_recompute_output(name: str, out, dtype, shape, activation: str, dinp, dout, inp) -> None:
    """`out` (activation_backward's out or out_fp8_tp) as the gated backward can write it."""
    what = f"activation_backward {name}"
    if activation not in GATED:
        raise ValueError(f"{what}: only gated activations write the forward's output, not {activation!r}")
    expect(out, what, dtype, shape)
    if overlaps(out, inp) or overlaps(out, dinp) or overlaps(out, dout):
        raise ValueError(f"{what}: tensor {out.name!r} overlaps inp, dinp or dout")


def activation_backward(dinp, dout, inp, activation: str, layout: str = "split", abs_max=None, stream=None,
                        out=None, out_fp8_tp=None, *, out_scale=None, dinp_tp=None,
                        dinp_scale=None) -> None:  # fmt: skip
    """dinp = d activation(inp) / d inp . dout, in inp's shape and layout.

    Args:
        dinp: like inp, written (=); may be inp itself (in place). Or, gated activations only, FP8 (e4m3
            or e5m2) with a stats slot, given with dinp_tp and dinp_scale: delayed scaling of the gradient.
            dinp then gets fp8(round(gradient) * scale) (round: to inp's dtype; clipped, nearest even),
            its stats scale and scale_inv the delayed scale and its inverse, and its abs-max max-accumulates
            |round(gradient)|: the two FP8 copies the up projection's backward GEMMs read, from the pass
            that computes the gradient (no gradient in inp's dtype, no quantise pass).
        dout: (N, H) gradient of the output, inp's dtype.
        inp: (N, H) plain or (N, 2H) gated, the forward's input.
        activation, layout: as for activation_forward.
        abs_max: optional (1,) fp32; max-accumulates |dinp|. Not with an FP8 dinp (its own slot records).
        out: optional (N, H), gated activations only: also written (=) with activation(inp), the bits
            activation_forward writes. A training step that dropped the output recomputes it here, in
            the pass that already reads the gate and up values, instead of in a pass of its own.
        out_fp8_tp: optional (H, N) e4m3 with an FP8 stats slot, gated activations only, not with `out`:
            written (=) with the transpose of what activation_forward_quant writes, stats too. The FP8
            step's recompute of its dropped output, in the layout its weight-gradient GEMM reads.
        out_scale: optional (1,) fp32, with out_fp8_tp: its delayed scale (activation_forward_quant's `scale`),
            so the recompute has the forward's bits; out_fp8_tp's abs-max is then left as it is.
        dinp_tp: (2H, N), dinp's dtype, with an FP8 dinp: written (=) with dinp transposed (stats are dinp's).
        dinp_scale: (1,) fp32, with an FP8 dinp: the delayed scale.
    NumPy equivalent: activation_backward_np (and activation_forward_np for out, activation_forward_quant_np
    transposed for out_fp8_tp, fp8.quantize_with_scale_reference of the gradient for an FP8 dinp).
    """
    what = "activation_backward"
    N, H = _shapes(what, ("dout", dout, None), inp, activation, layout)
    quant_dinp = dinp.dtype.is_fp8
    expect(dinp, f"{what} dinp", (FP8_E4M3, FP8_E5M2) if quant_dinp else inp.dtype, inp.shape)
    if quant_dinp:
        _check_quant_dinp(dinp, dinp_tp, dinp_scale, abs_max, out, activation, (2 * H, N), dout, inp)
    elif dinp_tp is not None or dinp_scale is not None:
        raise ValueError(f"{what}: dinp_tp and dinp_scale go with an FP8 dinp, got {dinp.dtype} {dinp.name!r}")
    if abs_max is not None:
        expect(abs_max, f"{what} abs_max", FP32, (1,))
    if out is not None:
        _check_recompute_output("out", out, inp.dtype, dout.shape, activation, dinp, dout, inp)
    if out_fp8_tp is not None:
        if out is not None:
            raise ValueError(f"{what}: give out or out_fp8_tp, not both")
        _check_recompute_output("out_fp8_tp", out_fp8_tp, FP8_E4M3, (H, N), activation, dinp, dout, inp)
        if out_fp8_tp.stats is None:
            raise ValueError(f"{what} out_fp8_tp: tensor {out_fp8_tp.name!r} carries no FP8 stats slot")
    elif out_scale is not None:
        raise ValueError(f"{what}: out_scale goes with out_fp8_tp")
    _check_scale(f"{what} out_scale", out_scale)
    stats = None if out_fp8_tp is None else out_fp8_tp.stats
    dev = same_device(dinp, dout, inp, abs_max, out, out_fp8_tp, stats, out_scale, dinp_tp, dinp_scale)
    if dev.is_cpu:
        x = inp.array()
        value = None if out is None and out_fp8_tp is None else activation_forward_np(x, activation, layout)
        results = [] if out is None else [(out, value)]
        if out_fp8_tp is not None:
            s = stats.array()
            delayed = None if out_scale is None else out_scale.array()[0]
            q, s[STAT_SCALE], s[STAT_SCALE_INV] = _e4m3_of(value, s[STAT_ABS_MAX], delayed)
            out_fp8_tp.array()[...] = q.reshape(N, H).T
        dx = activation_backward_np(dout.array(), x, activation, layout)
        if quant_dinp:
            scale = dinp_scale.array()[0]
            q = quantize_with_scale_reference(dx, scale, dinp.dtype)
            results += [(dinp, q), (dinp_tp, q.reshape(N, 2 * H).T)]
            st = dinp.stats.array()
            st[STAT_SCALE], st[STAT_SCALE_INV] = scale, np.float32(1) / scale
            abs_max = dinp.abs_max
        else:
            results.append((dinp, dx))
        write_twin_results(results, abs_max, dx)
        return
    if N * H == 0:
        return
    check_aligned(what, dinp, dout, inp, out, out_fp8_tp, dinp_tp)  # None skipped
    if quant_dinp:
        tensors = (dinp, dinp_tp, dinp.stats, dinp_scale, out_fp8_tp, stats, out_scale, dout, inp)
        e5m2 = np.int32(dinp.dtype == FP8_E5M2)
        _launch("backward_q_tp", tensors, inp, activation, layout, N, H, dev, stream, extra=(e5m2,))
    elif out_fp8_tp is not None:
        tensors = (dinp, out_fp8_tp, stats, out_scale, dout, inp, abs_max)
        _launch("backward_quant_tp", tensors, inp, activation, layout, N, H, dev, stream)
    elif activation in GATED:
        _launch("backward", (dinp, out, dout, inp, abs_max), inp, activation, layout, N, H, dev, stream)
    else:
        _launch("backward", (dinp, dout, inp, abs_max), inp, activation, layout, N, H, dev, stream)


def _check_quant_dinp(dinp, dinp_tp, dinp_scale, abs_max, out, activation, tp_shape, dout, inp) -> None:
    """An FP8 dinp as activation_backward writes it: gated, with its transpose, its stats and a delayed scale."""
    what = "activation_backward"
    if activation not in GATED:
        raise ValueError(f"{what}: an FP8 dinp needs a gated activation, not {activation!r}")
    if dinp_tp is None or dinp_scale is None:
        raise ValueError(f"{what}: an FP8 dinp needs dinp_tp and dinp_scale (delayed scaling)")
    if dinp.stats is None:
        raise ValueError(f"{what} dinp: tensor {dinp.name!r} carries no FP8 stats slot")
    if abs_max is not None or out is not None:
        raise ValueError(f"{what}: an FP8 dinp records its abs-max in its own stats and takes no out")
    expect(dinp_tp, f"{what} dinp_tp", dinp.dtype, tp_shape)
    _check_scale(f"{what} dinp_scale", dinp_scale)
    for t in (dinp, dinp_tp):
        if overlaps(t, inp) or overlaps(t, dout):
            raise ValueError(f"{what}: tensor {t.name!r} overlaps inp or dout")
    if overlaps(dinp, dinp_tp):
        raise ValueError(f"{what}: dinp and dinp_tp overlap")


# The model's FFN names: SwiGLU on its packed [gate | up] projection, the same kernels as ops.mlp's.
def swiglu_forward(out, inp, abs_max=None, stream=None) -> None:
    """SwiGLU on the split layout: out (N, H) = silu(inp[:, :H]) * inp[:, H:]. See activation_forward."""
    activation_forward(out, inp, "swiglu", "split", abs_max, stream)


def swiglu_backward(dinp, dout, inp, abs_max=None, stream=None, out=None, out_fp8_tp=None, **delayed) -> None:
    """Gradient of swiglu_forward into dinp (N, 2H), may be inp itself; with `out` (or `out_fp8_tp`),
    swiglu_forward's output (or its E4M3 copy transposed) too: the recompute of a dropped output. `delayed`:
    activation_backward's out_scale, dinp_tp and dinp_scale. See activation_backward."""
    activation_backward(dinp, dout, inp, "swiglu", "split", abs_max, stream, out, out_fp8_tp, **delayed)
