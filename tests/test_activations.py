"""Activations, plain and gated, both layouts: twins against float64, finite differences, cpu vs cuda."""

import math

import numpy as np
import pytest
from conftest import ROWS, assert_close, check_op, finite_difference, garbage, rng, tensors

import cuengine as ce
from cuengine.kernels.activations import (
    ACTIVATIONS,
    GATED,
    activation_backward,
    activation_backward_np,
    activation_forward,
    activation_forward_np,
    activation_forward_quant,
    swiglu_backward,
    swiglu_forward,
)
from cuengine.kernels.fp8 import quantize_with_scale_reference

PLAIN = tuple(a for a in ACTIVATIONS if a not in GATED)
VARIANTS = [(a, "split") for a in PLAIN] + [(a, lay) for a in GATED for lay in ("split", "interleaved")]


# ---- float64 reference, written independently of the twins ----------------------------------------
def _sig(v):
    return 1.0 / (1.0 + np.exp(-v))


def _gelu(v):
    return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))


def ref64(x, activation, layout="split"):
    """The activation in float64, straight from its definition."""
    x = x.astype(np.float64)
    plain = {
        "silu": lambda v: v * _sig(v),
        "gelu_tanh_approx": _gelu,
        "relu": lambda v: np.maximum(v, 0.0),
        "relu_sq": lambda v: np.maximum(v, 0.0) ** 2,
    }
    if activation in plain:
        return plain[activation](x)
    h = x.shape[-1] // 2
    g, u = (x[..., :h], x[..., h:]) if layout == "split" else (x[..., 0::2], x[..., 1::2])
    if activation == "swiglu_oai":
        g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
        return g * _sig(1.702 * g) * (u + 1.0)
    gate = {"swiglu": lambda v: v * _sig(v), "reglu": lambda v: np.maximum(v, 0.0), "geglu": _gelu, "glu": _sig}
    return gate[activation](g) * u


def away_from_kinks(x, activation):
    """Move values off the points where the derivative jumps, so finite differences are exact there."""
    x = np.where(np.abs(x) < 1e-2, 0.5, x)
    if activation == "swiglu_oai":
        x = np.where(np.abs(np.abs(x) - 7.0) < 1e-2, 6.0, x)
    return x


# ---- cpu: the twins against float64 -----------------------------------------------------------
@pytest.mark.parametrize("activation,layout", VARIANTS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_forward_twin_matches_float64(activation, layout, dtype):
    np_dt = ce.dtype(dtype).np
    x = (rng(1).standard_normal((37, 48)) * 4).astype(np_dt)  # +-4 sigma reaches swiglu_oai's clamps
    y = activation_forward_np(x, activation, layout)
    assert y.dtype == np_dt and y.shape == ((37, 24) if activation in GATED else (37, 48))
    assert_close(y, ref64(x, activation, layout), dtype, activation)


@pytest.mark.parametrize("activation,layout", VARIANTS)
def test_backward_twin_matches_finite_differences(activation, layout):
    x = away_from_kinks((rng(2).standard_normal((5, 32)) * 4).astype(np.float32), activation)
    dout = rng(3).standard_normal((5, 16 if activation in GATED else 32)).astype(np.float32)
    dx = activation_backward_np(dout, x, activation, layout)
    fd = finite_difference(lambda x64: np.sum(dout * ref64(x64, activation, layout)), x)
    np.testing.assert_allclose(dx, fd, rtol=1e-4, atol=1e-5)


def test_gradient_at_kinks_follows_pytorch():
    x = np.array([[0.0, -1.0, 7.0, 7.5, 0.0, 7.0, -7.0, 8.0]], np.float32)  # split: gate [:4], up [4:]
    d = np.ones((1, 4), np.float32)
    assert activation_backward_np(d, x[:, :4], "relu", "split")[0, 0] == 0.0
    dx = activation_backward_np(d, x, "swiglu_oai", "split")
    assert dx[0, 2] != 0 and dx[0, 3] == 0  # gate clamp: gradient at 7, none above
    assert dx[0, 5] != 0 and dx[0, 6] != 0 and dx[0, 7] == 0  # up clamp: gradient at +-7, none beyond


def test_layouts_agree():
    r = rng(4)
    g, u = r.standard_normal((7, 16)).astype(np.float32), r.standard_normal((7, 16)).astype(np.float32)
    split = np.concatenate([g, u], axis=1)
    inter = np.stack([g, u], axis=-1).reshape(7, 32)
    d = r.standard_normal((7, 16)).astype(np.float32)
    for act in GATED:
        np.testing.assert_array_equal(
            activation_forward_np(split, act, "split"), activation_forward_np(inter, act, "interleaved")
        )
        ds, di = activation_backward_np(d, split, act, "split"), activation_backward_np(d, inter, act, "interleaved")
        np.testing.assert_array_equal(ds, np.concatenate([di[:, 0::2], di[:, 1::2]], axis=1))


# ---- launchers: both devices -------------------------------------------------------------------
@pytest.mark.parametrize("activation,layout", [("swiglu", "split"), ("geglu", "interleaved"), ("relu_sq", "split")])
def test_launchers_write_twin_results_and_abs_max(dev, activation, layout):
    r = rng(5)
    x = (r.standard_normal((3, 11, 32)) * 2).astype(np.float32)  # leading dims flatten to rows
    h = 16 if activation in GATED else 32
    d = r.standard_normal((3, 11, h)).astype(np.float32)
    t = tensors(
        dev,
        x=x,
        d=d,
        out=np.zeros((3, 11, h), np.float32),
        dx=np.zeros_like(x),
        amax=np.zeros(1, np.float32),
        damax=np.array([1e6], np.float32),
    )
    activation_forward(t["out"], t["x"], activation, layout, abs_max=t["amax"])
    activation_backward(t["dx"], t["d"], t["x"], activation, layout, abs_max=t["damax"])
    y, dx = activation_forward_np(x, activation, layout), activation_backward_np(d, x, activation, layout)
    assert_close(t["out"].numpy(), y, "fp32", "out")
    assert_close(t["dx"].numpy(), dx, "fp32", "dinp")
    assert_close(t["amax"].numpy(), [np.abs(y).max()], "fp32", "abs_max")
    assert t["damax"].numpy()[0] == 1e6  # max-accumulate: a larger value already there stays


@pytest.mark.parametrize("activation,layout", [("swiglu", "split"), ("swiglu_oai", "interleaved"), ("silu", "split")])
def test_backward_in_place(dev, activation, layout):
    r = rng(6)
    x = (r.standard_normal((37, 32)) * 3).astype(ce.BF16.np)
    d = r.standard_normal((37, 16 if activation in GATED else 32)).astype(ce.BF16.np)
    t = tensors(dev, x=x, d=d)
    activation_backward(t["x"], t["d"], t["x"], activation, layout)
    assert_close(t["x"].numpy(), activation_backward_np(d, x, activation, layout), "bf16", "dinp in place")


def test_swiglu_names_are_the_split_layout(dev):
    r = rng(7)
    x, d = r.standard_normal((9, 32)).astype(np.float32), r.standard_normal((9, 16)).astype(np.float32)
    t = tensors(dev, x=x, d=d, out=np.zeros((9, 16), np.float32), dx=np.zeros_like(x), amax=np.zeros(1, np.float32))
    swiglu_forward(t["out"], t["x"])
    swiglu_backward(t["dx"], t["d"], t["x"], abs_max=t["amax"])
    dx = activation_backward_np(d, x, "swiglu", "split")
    assert_close(t["out"].numpy(), activation_forward_np(x, "swiglu", "split"), "fp32", "out")
    assert_close(t["dx"].numpy(), dx, "fp32", "dinp")
    assert_close(t["amax"].numpy(), [np.abs(dx).max()], "fp32", "abs_max of dinp")


@pytest.mark.parametrize("activation,layout", [("swiglu", "split"), ("swiglu_oai", "interleaved"), ("geglu", "split")])
@pytest.mark.parametrize("in_place", [False, True])
def test_gated_backward_recomputes_the_output(dev, activation, layout, in_place):
    """With `out` the gated backward also writes the forward's output, the bits activation_forward writes
    (the train step's recompute of a dropped SwiGLU output), and dinp is unchanged, in place too."""
    r = rng(12)
    x = (r.standard_normal((37, 64)) * 3).astype(ce.BF16.np)
    d = r.standard_normal((37, 32)).astype(ce.BF16.np)
    t = tensors(dev, x=x, x2=x, d=d, y=np.zeros((37, 32), ce.BF16.np), dx=np.zeros_like(x))
    t["out"] = ce.Tensor.from_numpy(np.full((37, 32), np.nan, ce.BF16.np), dev, name="out")
    activation_forward(t["y"], t["x"], activation, layout)
    activation_backward(t["dx"], t["d"], t["x"], activation, layout)
    dinp = t["x2"] if in_place else ce.Tensor.from_numpy(np.zeros_like(x), dev, name="dinp")
    activation_backward(dinp, t["d"], t["x2"], activation, layout, out=t["out"])
    np.testing.assert_array_equal(t["out"].numpy().view(np.uint16), t["y"].numpy().view(np.uint16))
    np.testing.assert_array_equal(dinp.numpy().view(np.uint16), t["dx"].numpy().view(np.uint16))
    assert_close(t["out"].numpy(), activation_forward_np(x, activation, layout), "bf16", "recomputed out")


@pytest.mark.parametrize("activation,layout", [("swiglu", "split"), ("swiglu_oai", "interleaved")])
@pytest.mark.parametrize("n,h", [(37, 40), (160, 136)])  # N % 16 != 0 (byte stores), partial tiles; 16-byte runs
@pytest.mark.parametrize("in_place", [False, True])
def test_gated_backward_writes_the_transposed_fp8_output(dev, activation, layout, n, h, in_place):
    """With `out_fp8_tp` the gated backward also writes the forward's E4M3 copy transposed (H, N), the bits
    activation_forward_quant writes, with its stats, and dinp and its abs-max are unchanged (the FP8 step's
    recompute of a dropped SwiGLU output)."""
    r = rng(14)
    x = (r.standard_normal((n, 2 * h)) * 3).astype(ce.BF16.np)
    d = r.standard_normal((n, h)).astype(ce.BF16.np)
    t = tensors(dev, x=x, x2=x, d=d, dx=np.zeros_like(x), amax=np.zeros(1, np.float32),
                amax2=np.zeros(1, np.float32))  # fmt: skip
    activation_backward(t["dx"], t["d"], t["x"], activation, layout, abs_max=t["amax"])
    q = ce.Tensor.empty(ce.FP8_E4M3, (n, h), dev, name="q")
    q.set_fp8_stats(5.0, 0.0, 0.0)
    activation_forward_quant(q, t["x"], activation, layout)
    qt = garbage(ce.Tensor.empty(ce.FP8_E4M3, (h, n), dev, name="qt")).set_fp8_stats(5.0, 0.0, 0.0)
    dinp = t["x2"] if in_place else ce.Tensor.from_numpy(np.zeros_like(x), dev, name="dinp")
    activation_backward(dinp, t["d"], t["x2"], activation, layout, abs_max=t["amax2"], out_fp8_tp=qt)
    np.testing.assert_array_equal(qt.numpy().view(np.uint8), q.numpy().view(np.uint8).T)
    np.testing.assert_array_equal(qt.fp8_stats(), q.fp8_stats())
    np.testing.assert_array_equal(dinp.numpy().view(np.uint16), t["dx"].numpy().view(np.uint16))
    np.testing.assert_array_equal(t["amax2"].numpy(), t["amax"].numpy())
    _, scale, _ = ce.tensor.stats_values(5.0, ce.FP8_E4M3)
    want = np.clip(activation_forward_np(x, activation, layout).astype(np.float32) * np.float32(scale), -448, 448)
    assert_close(qt.numpy().astype(np.float32).T, want, "e4m3", "transposed fp8 output")


@pytest.mark.parametrize("activation,layout", [("swiglu", "split"), ("geglu", "interleaved"), ("relu_sq", "split")])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("amax", [0.0, 3.0, 1e-3])
def test_forward_quant(dev, activation, layout, dtype, amax):
    x = (rng(8).standard_normal((37, 64)) * 2).astype(ce.dtype(dtype).np)
    y = activation_forward_np(x, activation, layout).astype(np.float32)  # what activation_forward stores
    out = ce.Tensor.empty(ce.FP8_E4M3, y.shape, dev, name="q")
    out.abs_max.copy_from_numpy(np.array([amax], np.float32))
    inp = ce.Tensor.from_numpy(x, dev, name="x")
    activation_forward_quant(out, inp, activation, layout)
    scale = np.float32(448.0) / np.float32(amax) if amax else np.float32(1)
    stats = out.fp8_stats()
    np.testing.assert_array_equal(stats, np.array([amax, scale, np.float32(1) / scale], np.float32))
    want = np.clip(y * scale, -448, 448).astype(ce.FP8_E4M3.np)
    got = out.numpy()
    if dev.is_cuda:  # the device's expf may move a value across a rounding boundary of the 16-bit swiglu
        assert_close(got, want, "e4m3", "fp8 values")
    else:
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    if amax == 1e-3:
        assert np.abs(got.astype(np.float32)).max() == 448  # saturates, no inf or NaN


@pytest.mark.parametrize("activation,layout", [("swiglu", "split"), ("geglu", "interleaved"), ("relu_sq", "split")])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_forward_quant_with_a_delayed_scale(dev, activation, layout, dtype):
    """With `scale` the forward quantises with it, not with the slot's abs-max, publishes it and its inverse,
    and max-accumulates the abs-max of the values it rounded (the abs-max later scales are made from)."""
    x = (rng(16).standard_normal((41, 80)) * 2).astype(ce.dtype(dtype).np)
    inp = ce.Tensor.from_numpy(x, dev, name="x")
    h = 40 if activation in GATED else 80
    y = ce.Tensor.empty(dtype, (41, h), dev, name="y")
    activation_forward(y, inp, activation, layout)  # the values this device rounds
    out = garbage(ce.Tensor.empty(ce.FP8_E4M3, (41, h), dev, name="q")).set_fp8_stats(0.25, 0.0, 0.0)
    scale = ce.Tensor.from_numpy(np.array([37.5], np.float32), dev, name="scale")
    activation_forward_quant(out, inp, activation, layout, scale=scale)
    yv = y.numpy().astype(np.float32)
    want_amax = max(np.float32(0.25), np.abs(yv).max())
    np.testing.assert_array_equal(out.fp8_stats(), np.array([want_amax, 37.5, np.float32(1) / np.float32(37.5)]))
    want = quantize_with_scale_reference(yv, 37.5, ce.FP8_E4M3)
    np.testing.assert_array_equal(out.numpy().view(np.uint8), want.view(np.uint8))
    assert np.abs(out.numpy().astype(np.float32)).max() == 448  # 37.5 saturates the largest values


@pytest.mark.parametrize("activation,layout", [("swiglu", "split"), ("swiglu_oai", "interleaved")])
@pytest.mark.parametrize("grad", ["e5m2", "e4m3"])
@pytest.mark.parametrize("n,h", [(37, 40), (160, 136)])  # N % 16 != 0 (byte stores), partial tiles; 16-byte runs
@pytest.mark.parametrize("recompute", [False, True])
def test_gated_backward_writes_the_fp8_gradient_with_a_delayed_scale(dev, activation, layout, grad, n, h, recompute):
    """An FP8 dinp with a delayed scale gets the gradient (rounded to bf16) quantised with that scale, dinp_tp
    its transpose, its stats the scale, its inverse and the max of the abs-max it held and that of the
    gradient; with out_fp8_tp and out_scale the recomputed output is the forward's with that scale."""
    r = rng(17)
    x = (r.standard_normal((n, 2 * h)) * 3).astype(ce.BF16.np)
    d = r.standard_normal((n, h)).astype(ce.BF16.np)
    t = tensors(dev, x=x, d=d, dx=np.zeros_like(x))
    activation_backward(t["dx"], t["d"], t["x"], activation, layout)  # the gradient this device rounds
    dx = t["dx"].numpy().astype(np.float32)
    gdt = ce.dtype(grad)
    scale_value = np.float32(gdt.fp8_max) / (np.float32(0.75) * np.abs(dx).max())  # saturates the largest
    q = garbage(ce.Tensor.empty(gdt, (n, 2 * h), dev, name="q")).set_fp8_stats(1e-3, 0.0, 0.0)
    qt = garbage(ce.Tensor.empty(gdt, (2 * h, n), dev, name="qt"))
    scale = ce.Tensor.from_numpy(np.array([scale_value], np.float32), dev, name="scale")
    delayed = {"dinp_tp": qt, "dinp_scale": scale}
    if recompute:
        out_scale = ce.Tensor.from_numpy(np.array([11.0], np.float32), dev, name="out_scale")
        yq = ce.Tensor.empty(ce.FP8_E4M3, (n, h), dev, name="yq").set_fp8_stats(0.0, 0.0, 0.0)
        activation_forward_quant(yq, t["x"], activation, layout, scale=out_scale)
        yt = garbage(ce.Tensor.empty(ce.FP8_E4M3, (h, n), dev, name="yt")).set_fp8_stats(2.0, 0.0, 0.0)
        delayed |= {"out_fp8_tp": yt, "out_scale": out_scale}
    activation_backward(q, t["d"], t["x"], activation, layout, **delayed)
    want = quantize_with_scale_reference(dx, scale_value, gdt)
    np.testing.assert_array_equal(q.numpy().view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(qt.numpy().view(np.uint8), want.view(np.uint8).T)
    assert np.abs(q.numpy().astype(np.float32)).max() == gdt.fp8_max
    stats = np.array([np.abs(dx).max(), scale_value, np.float32(1) / scale_value], np.float32)
    np.testing.assert_array_equal(q.fp8_stats(), stats)
    if recompute:
        np.testing.assert_array_equal(yt.numpy().view(np.uint8), yq.numpy().view(np.uint8).T)
        np.testing.assert_array_equal(yt.fp8_stats(), [2.0, 11.0, np.float32(1) / np.float32(11.0)])


# ---- errors --------------------------------------------------------------------------------------
def _t(shape, dtype=np.float32):
    return ce.Tensor.from_numpy(np.zeros(shape, dtype), "cpu", name="t")


def _fp8(shape, stats=True):
    t = ce.Tensor.empty(ce.FP8_E4M3, shape, "cpu", name="q")
    if not stats:
        t.stats = None
    return t


def _recompute_fp8_into_dout():
    d = _t((4, 8))
    swiglu_backward(_t((4, 16)), d, _t((4, 16)), out_fp8_tp=ce.Tensor(ce.FP8_E4M3, (8, 4), d.device, d.storage,
                                                                       name="d_bytes"))  # fmt: skip


def _q(shape, dtype=ce.FP8_E5M2, stats=True):
    t = ce.Tensor.empty(dtype, shape, "cpu", name="dq" if shape[0] == 4 else "dq_tp")
    if not stats:
        t.stats = None
    return t


def _delayed_backward(dinp=None, activation="swiglu", **kw):
    """An FP8-dinp backward of (4, 2*8) with the given arguments replaced."""
    args = {"dinp_tp": _q((16, 4)), "dinp_scale": _t((1,))} | kw
    activation_backward(_q((4, 16)) if dinp is None else dinp, _t((4, 8)), _t((4, 16)), activation, **args)


def _fp8_gradient_into_dout():
    d = _t((4, 8))
    activation_backward(_q((4, 16)), d, _t((4, 16)), "swiglu", dinp_scale=_t((1,)),
                        dinp_tp=ce.Tensor(ce.FP8_E5M2, (16, 4), d.device, d.storage, name="d_bytes"))  # fmt: skip


def _recompute_into_inp():
    x = _t((4, 16))
    swiglu_backward(_t((4, 16)), _t((4, 8)), x, out=ce.Tensor(x.dtype, (4, 8), x.device, x.storage, name="x_head"))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: activation_forward(_t((4, 8)), _t((4, 16)), "swish"), "unknown activation 'swish'"),
        (lambda: activation_forward(_t((4, 8)), _t((4, 16)), "swiglu", "blocked"), "unknown layout 'blocked'"),
        (lambda: activation_forward(_t((4, 8)), _t((4, 15)), "swiglu"), r"needs \(\.\.\., 2H\)"),
        (lambda: activation_forward(_t((4, 6)), _t((4, 12)), "swiglu"), "H = 6 must be a multiple of 4"),
        (lambda: activation_forward(_t((4, 12), ce.BF16.np), _t((4, 12), ce.BF16.np), "relu"), "multiple of 8"),
        (lambda: activation_forward(_t((4, 16)), _t((4, 16)), "swiglu"), r"out: expected shape \(4, 8\)"),
        (lambda: activation_forward(_t((4, 8), ce.BF16.np), _t((4, 16)), "swiglu"), "expected dtype fp32"),
        (lambda: activation_forward(_t((4, 8)), _t((4, 8), np.int32), "relu"), "expected dtype fp32/bf16/fp16"),
        (lambda: activation_forward(_t((4, 8)), _t((4, 16)), "swiglu", abs_max=_t((2,))), r"abs_max: expected shape"),
        (lambda: activation_backward(_t((4, 8)), _t((4, 8)), _t((4, 16)), "glu"), r"dinp: expected shape \(4, 16\)"),
        (lambda: activation_backward(_t((4, 16)), _t((4, 16)), _t((4, 16)), "glu"), r"dout: expected shape \(4, 8\)"),
        (lambda: activation_forward_quant(_t((4, 8)), _t((4, 16)), "swiglu"), "expected dtype e4m3"),
        (lambda: activation_forward_quant(_t((4, 8)), _t((4, 15)), "swiglu"), r"needs \(\.\.\., 2H\)"),
        (lambda: activation_forward_quant(_t((4, 8)), _t((4, 12)), "swiglu"), "H = 6 must be a multiple of 4"),
        (
            lambda: activation_forward_quant(ce.Tensor.empty(ce.FP8_E4M3, (4, 4), "cpu"), _t((4, 16)), "swiglu"),
            r"out_fp8: expected shape \(4, 8\)",
        ),
        (lambda: activation_forward_quant(_t((4, 8)), _t((4, 8)), "relu", "rows"), "unknown layout 'rows'"),
        (lambda: activation_backward(_t((4, 8)), _t((4, 8)), _t((4, 8)), "relu", out=_t((4, 8))), "only gated"),
        (
            lambda: swiglu_backward(_t((4, 16)), _t((4, 8)), _t((4, 16)), out=_t((4, 16))),
            r"out: expected shape \(4, 8\)",
        ),
        (
            lambda: swiglu_backward(_t((4, 16)), _t((4, 8)), _t((4, 16)), out=_t((4, 8), ce.BF16.np)),
            "expected dtype fp32",
        ),
        (_recompute_into_inp, "overlaps inp, dinp or dout"),
        (_recompute_fp8_into_dout, "out_fp8_tp: tensor 'd_bytes' overlaps inp, dinp or dout"),
        (
            lambda: swiglu_backward(_t((4, 16)), _t((4, 8)), _t((4, 16)), out=_t((4, 8)), out_fp8_tp=_fp8((8, 4))),
            "out or out_fp8_tp, not both",
        ),
        (
            lambda: swiglu_backward(_t((4, 16)), _t((4, 8)), _t((4, 16)), out_fp8_tp=_fp8((4, 8))),
            r"expected shape \(8, 4\)",
        ),
        (lambda: swiglu_backward(_t((4, 16)), _t((4, 8)), _t((4, 16)), out_fp8_tp=_t((8, 4))), "expected dtype e4m3"),
        (
            lambda: swiglu_backward(_t((4, 16)), _t((4, 8)), _t((4, 16)), out_fp8_tp=_fp8((8, 4), stats=False)),
            "carries no FP8 stats",
        ),
        (
            lambda: activation_backward(_t((4, 8)), _t((4, 8)), _t((4, 8)), "relu", out_fp8_tp=_fp8((8, 4))),
            "out_fp8_tp: only gated",
        ),
        (lambda: activation_forward_quant(_fp8((4, 8)), _t((4, 16)), "swiglu", scale=_t((2,))), r"scale: expected"),
        (lambda: _delayed_backward(dinp_tp=None), "an FP8 dinp needs dinp_tp and dinp_scale"),
        (lambda: _delayed_backward(dinp_scale=None), "an FP8 dinp needs dinp_tp and dinp_scale"),
        (lambda: _delayed_backward(dinp_scale=_t((1,), np.int32)), "dinp_scale: expected dtype fp32"),
        (lambda: _delayed_backward(dinp_tp=_q((4, 16))), r"dinp_tp: expected shape \(16, 4\)"),
        (lambda: _delayed_backward(dinp_tp=_q((16, 4), ce.FP8_E4M3)), "dinp_tp: expected dtype e5m2"),
        (lambda: _delayed_backward(dinp=_q((4, 16), stats=False)), "dinp: tensor 'dq' carries no FP8 stats"),
        (lambda: _delayed_backward(abs_max=_t((1,))), "records its abs-max in its own stats"),
        (lambda: _delayed_backward(out=_t((4, 8))), "records its abs-max in its own stats"),
        (
            lambda: activation_backward(
                _q((4, 8)), _t((4, 8)), _t((4, 8)), "relu", dinp_tp=_q((8, 4)), dinp_scale=_t((1,))
            ),  # fmt: skip
            "an FP8 dinp needs a gated activation",
        ),
        (_fp8_gradient_into_dout, "tensor 'd_bytes' overlaps inp or dout"),
        (lambda: swiglu_backward(_t((4, 16)), _t((4, 8)), _t((4, 16)), dinp_tp=_q((16, 4))), "go with an FP8 dinp"),
        (lambda: swiglu_backward(_t((4, 16)), _t((4, 8)), _t((4, 16)), out_scale=_t((1,))), "goes with out_fp8_tp"),
        (
            lambda: swiglu_backward(_t((4, 16)), _t((4, 8)), _t((4, 16)), out_fp8_tp=_fp8((8, 4)), out_scale=_t((3,))),
            r"out_scale: expected shape \(1\)",
        ),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_quant_needs_stats():
    out = ce.Tensor.empty(ce.FP8_E4M3, (4, 8), "cpu", name="q")
    out.stats = None
    with pytest.raises(ValueError, match="carries no FP8 stats"):
        activation_forward_quant(out, _t((4, 16)), "swiglu")


# ---- gpu: cuda against the twin ---------------------------------------------------------------
def fwd_bwd(out, dinp, abs_max, inp, dout, activation, layout):
    activation_forward(out, inp, activation, layout, abs_max=abs_max)
    activation_backward(dinp, dout, inp, activation, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("activation,layout", VARIANTS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_matches_cpu_every_activation(activation, layout, dtype):
    r = rng(9)
    h = 1000
    x = (r.standard_normal((37, 2 * h if activation in GATED else h)) * 3).astype(np.float32)
    check_op(
        fwd_bwd,
        {"inp": x, "dout": r.standard_normal((37, h)).astype(np.float32)},
        {"out": np.zeros((37, h), np.float32), "dinp": np.zeros_like(x), "abs_max": np.zeros(1, np.float32)},
        dtypes={"inp": dtype, "dout": dtype, "out": dtype, "dinp": dtype},
        compare={"abs_max": dtype},
        activation=activation,
        layout=layout,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_matches_cpu_swiglu(rows, dtype):
    r, h = rng(rows), 896
    x = (r.standard_normal((rows, 2 * h)) * 2).astype(np.float32)
    check_op(
        fwd_bwd,
        {"inp": x, "dout": r.standard_normal((rows, h)).astype(np.float32)},
        {"out": np.zeros((rows, h), np.float32), "dinp": np.zeros_like(x), "abs_max": np.zeros(1, np.float32)},
        dtypes={"inp": dtype, "dout": dtype, "out": dtype, "dinp": dtype},
        compare={"abs_max": dtype},
        activation="swiglu",
        layout="split",
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "activation,layout", [("swiglu", "split"), ("swiglu_oai", "interleaved"), ("gelu_tanh_approx", "split")]
)
@pytest.mark.parametrize("rows", [37, 1128])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_forward_quant_equals_forward_then_quantise(cuda, activation, layout, rows, dtype):
    x = (rng(10).standard_normal((rows, 2 * 1000)) * 2).astype(ce.dtype(dtype).np)
    inp = ce.Tensor.from_numpy(x, cuda, name="x")
    h = 1000 if activation in GATED else 2000
    y = ce.Tensor.empty(dtype, (rows, h), cuda, name="y")
    amax = ce.Tensor.from_numpy(np.zeros(1, np.float32), cuda, name="amax")
    activation_forward(y, inp, activation, layout, abs_max=amax)
    q = ce.Tensor.empty(ce.FP8_E4M3, (rows, h), cuda, name="q")
    cuda.copy(q.abs_max, amax)
    activation_forward_quant(q, inp, activation, layout)
    a = float(amax.numpy()[0])
    scale = np.float32(448.0) / np.float32(a)
    np.testing.assert_array_equal(q.fp8_stats(), np.array([a, scale, np.float32(1) / scale], np.float32))
    want = np.clip(y.numpy().astype(np.float32) * scale, -448, 448).astype(ce.FP8_E4M3.np)
    np.testing.assert_array_equal(q.numpy().view(np.uint8), want.view(np.uint8))  # same bits as unfused


# ---- the gated backward on the host emulator (tests/kernel_emulator.py): tails, in place ----------------
@pytest.fixture(scope="module")
def act_lib(tmp_path_factory):
    import kernel_emulator as emu

    ways = ("backward", "forward", "backward_quant_tp", "backward_q_tp", "forward_quant")
    names = [
        f"gated_{way}_{lay}_{t}" for way in ways for lay in ("split", "interleaved") for t in ("f32", "bf16", "f16")
    ]
    return emu.or_skip(emu.build("activations", names, tmp_path_factory.mktemp("activations_emu")))


def _emulated_inputs(act_lib, monkeypatch, dtype, n, h, seed):
    """The activations launchers redirected to the emulator, recording their grids; (grids, x (n, 2h), d (n, h),
    and x and d as emulated tensors)."""
    import kernel_emulator as emu

    from cuengine.kernels import activations as A

    grids = []
    monkeypatch.setattr(A, "launch", lambda *a, **kw: grids.append(a[2]) or emu.launch(act_lib, *a))
    r = rng(seed)
    np_dt = ce.dtype(dtype).np
    x = (r.standard_normal((n, 2 * h)) * 4).astype(np_dt)
    d = r.standard_normal((n, h)).astype(np_dt)
    return grids, x, d, emu.tensor(x, dtype, "x"), emu.tensor(d, dtype, "d")


def _emulated_backward(act_lib, monkeypatch, dtype, activation, layout, n, h, in_place):
    """activation_backward through the real launcher on the emulator, one vector per thread, the last
    block partly past the end; (dinp, abs_max, the twin's dinp, margins untouched)."""
    import kernel_emulator as emu

    grids, x, d, xt, dt = _emulated_inputs(act_lib, monkeypatch, dtype, n, h, 11)
    amax = emu.tensor(np.zeros(1), "fp32", "amax")
    dx = xt if in_place else emu.tensor(np.zeros_like(x), dtype, "dx")
    activation_backward(dx, dt, xt, activation, layout, abs_max=amax)
    vecs = n * h // (16 // ce.dtype(dtype).itemsize)
    assert grids == [-(-vecs // 256)] and vecs % 256, (grids, vecs)  # every vector a thread, a partial block
    margins = all(emu.margins_ok(t) for t in (xt, dt, dx, amax))
    return dx.numpy(), amax.numpy()[0], activation_backward_np(d, x, activation, layout), margins


@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("layout", ["split", "interleaved"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_emulated_gated_backward_equals_the_twin(act_lib, monkeypatch, activation, layout, dtype):
    """Each activation's compiled-in body, both layouts, every dtype; the twin with the host's exp."""
    got, amax, want, margins = _emulated_backward(act_lib, monkeypatch, dtype, activation, layout, 37, 48, False)
    assert margins
    assert_close(got, want, dtype, "dinp")
    assert amax == np.abs(got.astype(np.float32)).max()


@pytest.mark.parametrize("dtype,h", [("bf16", 64), ("fp32", 36)])
@pytest.mark.parametrize("layout", ["split", "interleaved"])
def test_emulated_backward_in_place_same_bits(act_lib, monkeypatch, dtype, h, layout):
    """In place (dinp == inp) gives the bits of out of place, over several blocks with a partial last one
    (151 rows: 1208 or 1359 vectors), and nothing is written outside the tensors."""
    args = (act_lib, monkeypatch, dtype, "swiglu", layout, 151, h)
    ref, ref_amax, want, margins = _emulated_backward(*args, False)
    got, amax, _, margins_in_place = _emulated_backward(*args, True)
    assert margins and margins_in_place
    assert_close(ref, want, dtype, "dinp")
    np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))
    assert amax == ref_amax == np.abs(ref.astype(np.float32)).max()


@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("layout", ["split", "interleaved"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_emulated_backward_recomputes_the_forward_bits(act_lib, monkeypatch, activation, layout, dtype):
    """The gated backward's `out` is the compiled forward's output bit for bit (each activation's body, both
    layouts, in place, a partial last block), and writes nothing outside it."""
    import kernel_emulator as emu

    from cuengine.kernels import activations as A

    monkeypatch.setattr(A, "launch", lambda *a, **kw: emu.launch(act_lib, *a))
    n, h = 41, 48
    r = rng(13)
    np_dt = ce.dtype(dtype).np
    x = (r.standard_normal((n, 2 * h)) * 4).astype(np_dt)
    d = r.standard_normal((n, h)).astype(np_dt)
    xt, dt = emu.tensor(x, dtype, "x"), emu.tensor(d, dtype, "d")
    y, out = emu.tensor(np.zeros((n, h)), dtype, "y"), emu.tensor(np.zeros((n, h)), dtype, "out")
    activation_forward(y, xt, activation, layout)
    activation_backward(xt, dt, xt, activation, layout, out=out)
    assert all(emu.margins_ok(t) for t in (xt, dt, y, out))
    np.testing.assert_array_equal(out.numpy().view(np.uint8), y.numpy().view(np.uint8))
    assert_close(xt.numpy(), activation_backward_np(d, x, activation, layout), dtype, "dinp in place")


def _emu_fp8(shape, name, dtype="e4m3", abs_max=5.0):
    import kernel_emulator as emu

    t = emu.tensor(np.full(shape, np.nan), dtype, name)
    t.stats = emu.tensor(np.zeros(ce.tensor.STATS_SLOTS), "fp32", name + ".stats")
    t.stats.array()[ce.tensor.STAT_ABS_MAX] = abs_max
    return t


@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("layout", ["split", "interleaved"])
@pytest.mark.parametrize("dtype,n,h", [("bf16", 41, 48), ("bf16", 160, 136), ("fp32", 160, 36), ("fp32", 41, 132)])
def test_emulated_backward_writes_the_transposed_fp8_forward(act_lib, monkeypatch, activation, layout, dtype, n, h):
    """The tile variant's out_fp8_tp is the compiled forward_quant's output transposed, bit for bit (16-byte
    runs where N % 16 == 0, bytes where not; partial row and column tiles), its dinp and abs-max those of the
    one-vector-a-thread backward, in place, with nothing written outside the tensors."""
    import kernel_emulator as emu

    grids, x, d, xt, dt = _emulated_inputs(act_lib, monkeypatch, dtype, n, h, 15)
    dx = emu.tensor(np.zeros_like(x), dtype, "dx")
    amax, amax2 = emu.tensor(np.zeros(1), "fp32", "amax"), emu.tensor(np.zeros(1), "fp32", "amax2")
    q, qt = _emu_fp8((n, h), "q"), _emu_fp8((h, n), "qt")
    activation_forward_quant(q, xt, activation, layout)
    activation_backward(dx, dt, xt, activation, layout, abs_max=amax)
    activation_backward(xt, dt, xt, activation, layout, abs_max=amax2, out_fp8_tp=qt)
    assert grids[-1] == -(-n // 128) * -(-h // 64)
    assert all(emu.margins_ok(t) for t in (xt, dt, dx, q, qt, amax, amax2, q.stats, qt.stats))
    np.testing.assert_array_equal(qt.numpy().view(np.uint8), q.numpy().view(np.uint8).T)
    np.testing.assert_array_equal(qt.stats.numpy(), q.stats.numpy())
    np.testing.assert_array_equal(xt.numpy().view(np.uint8), dx.numpy().view(np.uint8))
    assert amax.numpy()[0] == amax2.numpy()[0] > 0


@pytest.mark.parametrize("activation", GATED)
@pytest.mark.parametrize("layout", ["split", "interleaved"])
@pytest.mark.parametrize(
    "dtype,n,h,grad",
    [("bf16", 41, 48, "e5m2"), ("bf16", 160, 136, "e4m3"), ("fp32", 160, 36, "e5m2"), ("fp32", 41, 132, "e4m3")],
)
@pytest.mark.parametrize("recompute", [False, True])
def test_emulated_backward_writes_the_fp8_gradient_with_a_delayed_scale(act_lib, monkeypatch, activation, layout, dtype,
                                                                        n, h, grad, recompute):  # fmt: skip
    """The compiled gated_backward_q_tp: dinp's FP8 rows and their transpose are the one-vector backward's
    gradient quantised with the delayed scale, bit for bit (partial tiles, byte and 16-byte runs), its abs-max
    that gradient's; the recomputed output (when asked) is the compiled forward_quant's with its delayed scale;
    nothing is written outside the tensors."""
    import kernel_emulator as emu

    grids, x, d, xt, dt = _emulated_inputs(act_lib, monkeypatch, dtype, n, h, 19)
    dx, amax = emu.tensor(np.zeros_like(x), dtype, "dx"), emu.tensor(np.zeros(1), "fp32", "amax")
    activation_backward(dx, dt, xt, activation, layout, abs_max=amax)
    g = dx.numpy().astype(np.float32)
    gdt = ce.dtype(grad)
    s = np.float32(gdt.fp8_max) / (np.float32(0.75) * np.abs(g).max())
    q, qt = _emu_fp8((n, 2 * h), "q", grad, 0.0), _emu_fp8((2 * h, n), "qt", grad)
    scale, out_scale = emu.tensor(np.array([s]), "fp32", "scale"), emu.tensor(np.array([11.0]), "fp32", "out_scale")
    yq, yt = _emu_fp8((n, h), "yq"), _emu_fp8((h, n), "yt")
    activation_forward_quant(yq, xt, activation, layout, scale=out_scale)
    extra = {"out_fp8_tp": yt, "out_scale": out_scale} if recompute else {}
    activation_backward(q, dt, xt, activation, layout, dinp_tp=qt, dinp_scale=scale, **extra)
    assert grids[-1] == -(-n // 128) * -(-h // 64)
    assert all(emu.margins_ok(t) for t in (xt, dt, q, qt, yq, yt, q.stats, qt.stats, yt.stats, scale, out_scale))
    want = quantize_with_scale_reference(g, s, gdt)
    np.testing.assert_array_equal(q.numpy().view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(qt.numpy().view(np.uint8), want.view(np.uint8).T)
    np.testing.assert_array_equal(q.stats.numpy()[[0, 4, 8]], [amax.numpy()[0], s, np.float32(1) / s])
    if recompute:
        np.testing.assert_array_equal(yt.numpy().view(np.uint8), yq.numpy().view(np.uint8).T)
        np.testing.assert_array_equal(yt.stats.numpy()[[0, 4, 8]], [5.0, 11.0, np.float32(1) / np.float32(11.0)])
    else:
        assert np.isnan(yt.numpy().astype(np.float32)).all()  # not written
