"""The MLP op (cuengine.ops.mlp, seed 002): fc1 -> activation -> fc2 with recompute and fuse_grad_accum.

The reference is a float64 formula written here, independent of the engine's launchers and twins;
its own gradients are checked against finite differences first.
"""

import math

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, rng

import cuengine as ce
from cuengine.ops import mlp, mlp_backward, mlp_forward, mlp_grad, mlp_numpy, mlp_stack_bytes

GATED_ACTS = ("swiglu", "swiglu_oai", "reglu", "geglu", "glu")
PLAIN_ACTS = ("gelu_tanh_approx", "relu", "relu_sq", "silu")  # silu: not in seed 002, but the kernels have it
ACTS = PLAIN_ACTS + GATED_ACTS


# ---- float64 reference -------------------------------------------------------------------------
def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


_C = math.sqrt(2.0 / math.pi)


def _gelu(v):
    return 0.5 * v * (1.0 + np.tanh(_C * (v + 0.044715 * v**3)))


def _dgelu(v):
    t = np.tanh(_C * (v + 0.044715 * v**3))
    return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * v * v)


def _silu_a(g, a):  # g * sigmoid(a g) and its derivative
    s = _sigmoid(a * g)
    return g * s, s + a * g * s * (1.0 - s)


# plain: f(y), f'(y); gated: f(gate, up) and (df/dgate, df/dup)
PLAIN = {
    "silu": (lambda y: _silu_a(y, 1.0)[0], lambda y: _silu_a(y, 1.0)[1]),
    "gelu_tanh_approx": (_gelu, _dgelu),
    "relu": (lambda y: np.maximum(y, 0.0), lambda y: (y > 0).astype(np.float64)),
    "relu_sq": (lambda y: np.maximum(y, 0.0) ** 2, lambda y: 2.0 * np.maximum(y, 0.0)),
}
GATED = {
    "swiglu": (lambda g, u: _silu_a(g, 1.0)[0] * u, lambda g, u: (_silu_a(g, 1.0)[1] * u, _silu_a(g, 1.0)[0])),
    "swiglu_oai": (
        lambda g, u: _silu_a(g, 1.702)[0] * (u + 1.0),
        lambda g, u: (_silu_a(g, 1.702)[1] * (u + 1.0), _silu_a(g, 1.702)[0]),
    ),
    "reglu": (lambda g, u: np.maximum(g, 0.0) * u, lambda g, u: ((g > 0) * u, np.maximum(g, 0.0))),
    "geglu": (lambda g, u: _gelu(g) * u, lambda g, u: (_dgelu(g) * u, _gelu(g))),
    "glu": (lambda g, u: _sigmoid(g) * u, lambda g, u: (_sigmoid(g) * (1.0 - _sigmoid(g)) * u, _sigmoid(g))),
}


def ref_act(name, y):
    if name in GATED:  # interleaved (d two): gate = y[:, 0::2], up = y[:, 1::2]
        return GATED[name][0](y[:, 0::2], y[:, 1::2])
    return PLAIN[name][0](y)


def ref_act_grad(name, y, dh):
    if name in GATED:
        dg, du = GATED[name][1](y[:, 0::2], y[:, 1::2])
        dy = np.empty_like(y)
        dy[:, 0::2], dy[:, 1::2] = dg * dh, du * dh
        return dy
    return PLAIN[name][1](y) * dh


def ref_mlp(x, w1, w2, act, dout):
    """float64 out, dx, dw1, dw2 of out = act(x w1ᵀ) w2ᵀ for the loss sum(out * dout)."""
    x, w1, w2, dout = (np.asarray(a, np.float64) for a in (x, w1, w2, dout))
    pre = x @ w1.T
    post = ref_act(act, pre)
    dpre = ref_act_grad(act, pre, dout @ w2)
    return post @ w2.T, dpre @ w1, dpre.T @ x, dout.T @ post


def make_inputs(act, n, inp, hidden, out, seed=0, lead=None):
    r = rng(seed)
    f1 = 2 * hidden if act in GATED else hidden
    return {
        "x": r.standard_normal((lead or (n,)) + (inp,)).astype(np.float32),
        "w1": (r.standard_normal((f1, inp)) / math.sqrt(inp)).astype(np.float32),
        "w2": (r.standard_normal((out, hidden)) / math.sqrt(hidden)).astype(np.float32),
        "dout": r.standard_normal((lead or (n,)) + (out,)).astype(np.float32),
        "dw1": r.standard_normal((f1, inp)).astype(np.float32),  # existing gradients for fuse_grad_accum
        "dw2": r.standard_normal((out, hidden)).astype(np.float32),
    }


def run_mlp(arrays, act, dtype, device, recompute=False, fuse=False, grad_dtype=None, matmul_dtype=None):
    """Out-first forward and backward on `device` from NumPy arrays; returns NumPy results."""
    dev = ce.device(device)
    grad_dtype = grad_dtype or dtype
    dtypes = {k: grad_dtype if k in ("dw1", "dw2") else dtype for k in arrays}
    t = {k: ce.Tensor.from_numpy(v, dev, name=k, dtype=dtypes[k]) for k, v in arrays.items()}
    x, w1, w2 = t["x"], t["w1"], t["w2"]
    n = math.prod(x.shape[:-1])
    alloc = ce.TensorAllocator(dev)
    out = alloc.allocate(dtype, "out", t["dout"].shape)
    preact = None if recompute else alloc.allocate(dtype, "preact", (n, w1.shape[0]))
    dx = alloc.allocate(dtype, "dx", x.shape)
    dw1 = t["dw1"] if fuse else alloc.allocate(grad_dtype, "dw1", w1.shape)
    dw2 = t["dw2"] if fuse else alloc.allocate(grad_dtype, "dw2", w2.shape)
    size = mlp_stack_bytes(n, x.shape[-1], w2.shape[1], w2.shape[0], act, recompute, dtype, matmul_dtype)
    stack = ce.DeviceMemoryStack(alloc.allocate(ce.BYTE, "stack", (size,)))
    ctx = mlp_forward(out, preact, x, w1, w2, act, stack, matmul_dtype=matmul_dtype, fuse_grad_accum=fuse)
    assert stack.used == 0
    saved = None if recompute else preact.numpy()  # before backward overwrites it with its gradient
    mlp_backward(dx, dw1, dw2, t["dout"], ctx, stack)
    assert stack.used == 0 and stack.high_water_mark == size
    assert ctx.consumed != recompute
    res = {k: v.numpy() for k, v in {"out": out, "dx": dx, "dw1": dw1, "dw2": dw2}.items()}
    res["preact"] = saved
    return res


def rounded(arrays, dtype):
    """The inputs as the engine stores them (bf16-rounded), back in float64."""
    return {k: v.astype(ce.dtype(dtype).np).astype(np.float64) for k, v in arrays.items()}


def assert_near(actual, expected, rel, what):
    """|a - e| <= rel * (|e| + max|e|): relative to the tensor's scale, NaN never passes."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    np.testing.assert_allclose(a, e, rtol=rel, atol=rel * np.max(np.abs(e)), err_msg=what)


# ---- the reference itself -----------------------------------------------------------------------
@pytest.mark.parametrize("act", ACTS)
def test_reference_gradients_match_finite_differences(act):
    a = {k: v.astype(np.float64) for k, v in make_inputs(act, 5, 8, 8, 8, seed=1).items()}
    _, dx, dw1, dw2 = ref_mlp(a["x"], a["w1"], a["w2"], act, a["dout"])
    loss = lambda x, w1, w2: np.sum(ref_mlp(x, w1, w2, act, a["dout"])[0] * a["dout"])
    h = 1e-6
    for name, grad in (("x", dx), ("w1", dw1), ("w2", dw2)):
        for idx in [(0, 0), (1, 3), (4, 7), (2, 5)]:
            args = {k: a[k].copy() for k in ("x", "w1", "w2")}
            args[name][idx] += h
            up = loss(**args)
            args[name][idx] -= 2 * h
            down = loss(**args)
            assert abs((up - down) / (2 * h) - grad[idx]) < 1e-6 * max(1.0, abs(grad[idx])), (name, idx)


# ---- the op against the reference (cpu: the twins) ----------------------------------------------
@pytest.mark.parametrize("fuse", [False, True], ids=["write", "fuse_grad_accum"])
@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype,rel", [("fp32", 2e-5), ("bf16", 3e-2)])
def test_mlp_matches_float64(dtype, rel, act, recompute, fuse):
    arrays = make_inputs(act, 38, 24, 40, 16, lead=(2, 19))  # leading dims flatten to N = 38 rows
    got = run_mlp(arrays, act, dtype, "cpu", recompute=recompute, fuse=fuse)
    r = rounded(arrays, dtype)
    out, dx, dw1, dw2 = ref_mlp(r["x"].reshape(38, 24), r["w1"], r["w2"], act, r["dout"].reshape(38, 16))
    if fuse:
        dw1, dw2 = dw1 + r["dw1"], dw2 + r["dw2"]
    assert_near(got["out"].reshape(38, 16), out, rel, "out")
    assert_near(got["dx"].reshape(38, 24), dx, rel, "dx")
    assert_near(got["dw1"], dw1, rel, "dw1")
    assert_near(got["dw2"], dw2, rel, "dw2")


@pytest.mark.parametrize("fuse", [False, True], ids=["write", "fuse_grad_accum"])
def test_fp32_gradients_of_bf16_weights(fuse):
    arrays = make_inputs("swiglu", 37, 16, 24, 8, seed=7)
    got = run_mlp(arrays, "swiglu", "bf16", "cpu", fuse=fuse, grad_dtype="fp32")
    assert got["dw1"].dtype == np.float32 and got["dx"].dtype == ce.BF16.np
    r = rounded(arrays, "bf16")
    _, _, dw1, dw2 = ref_mlp(r["x"], r["w1"], r["w2"], "swiglu", r["dout"])
    if fuse:  # the existing fp32 gradient is not rounded to bf16
        dw1, dw2 = dw1 + arrays["dw1"], dw2 + arrays["dw2"]
    assert_near(got["dw1"], dw1, 3e-2, "dw1")
    assert_near(got["dw2"], dw2, 3e-2, "dw2")
    if fuse:
        return
    # written, the fp32 gradient is the bf16 one before its rounding
    bf16 = run_mlp(arrays, "swiglu", "bf16", "cpu")
    for k in ("dw1", "dw2"):
        np.testing.assert_array_equal(got[k].astype(ce.BF16.np).view(np.uint16), bf16[k].view(np.uint16), k)


def ref_e4m3(v):
    """float64 per-tensor e4m3 quantise-dequantise: scale to 448 at max|v|, saturate, round to nearest even."""
    amax = np.max(np.abs(v))
    q = np.clip(v * (448.0 / amax), -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float64) * (amax / 448.0)


@pytest.mark.parametrize("act", ACTS)
def test_fp8_forward_matches_quantised_float64(act):
    arrays = make_inputs(act, 64, 32, 48, 16, seed=8)
    got = run_mlp(arrays, act, "bf16", "cpu", matmul_dtype="e4m3")
    r = rounded(arrays, "bf16")
    pre = got["preact"].astype(np.float64)
    pre_fp8, pre_plain = ref_e4m3(r["x"]) @ ref_e4m3(r["w1"]).T, r["x"] @ r["w1"].T
    assert_near(pre, pre_fp8, 1e-2, "preact")
    rms = lambda a: np.sqrt(np.mean(a**2))
    assert rms(pre - pre_fp8) < 0.25 * rms(pre - pre_plain), "fc1 is no closer to the e4m3 product than the plain one"
    # fc2 from the engine's own pre-activation, with the post-activation rounded to bf16 before it is
    # quantised, as documented: e4m3 rounding is a discontinuity that would turn a bf16 rounding
    # difference into a whole e4m3 step (1/16 of the value)
    post = ref_act(act, pre).astype(ml_dtypes.bfloat16).astype(np.float64)
    out_fp8, out_plain = ref_e4m3(post) @ ref_e4m3(r["w2"]).T, post @ r["w2"].T
    assert_near(got["out"], out_fp8, 3e-2, "out")
    assert rms(got["out"] - out_fp8) < 0.3 * rms(got["out"] - out_plain), "fc2 did not run on e4m3 copies"
    # backward: the bf16 graph's gradients at the saved (FP8 forward's) pre-activation
    dpre = ref_act_grad(act, pre, r["dout"] @ r["w2"])
    assert_near(got["dx"], dpre @ r["w1"], 3e-2, "dx")
    assert_near(got["dw1"], dpre.T @ r["x"], 3e-2, "dw1")
    assert_near(got["dw2"], r["dout"].T @ ref_act(act, pre), 3e-2, "dw2")


@pytest.mark.parametrize("recompute,fuse", [(False, False), (True, True)])
@pytest.mark.parametrize("act", ["swiglu", "relu_sq"])
@pytest.mark.parametrize("dtype,matmul_dtype,grad_dtype", [("fp32", None, None), ("bf16", None, "fp32"),
                                                           ("bf16", "e4m3", None)])  # fmt: skip
def test_numpy_twin_is_the_cpu_device(dtype, matmul_dtype, grad_dtype, act, recompute, fuse):
    arrays = make_inputs(act, 38, 32, 48, 16, seed=13, lead=(2, 19))
    got = run_mlp(arrays, act, dtype, "cpu", recompute, fuse, grad_dtype=grad_dtype, matmul_dtype=matmul_dtype)
    a = {
        k: v.astype(ce.dtype(grad_dtype if k in ("dw1", "dw2") and grad_dtype else dtype).np) for k, v in arrays.items()
    }
    dws = (a["dw1"], a["dw2"]) if fuse else (None, None)
    gdt = ce.dtype(grad_dtype or dtype).np
    twin = mlp_numpy(a["x"], a["w1"], a["w2"], act, a["dout"], *dws, matmul_dtype=matmul_dtype, grad_dtype=gdt)
    for k, v in zip(("out", "dx", "dw1", "dw2"), twin):
        assert v.dtype == got[k].dtype and v.shape == got[k].shape, k
        np.testing.assert_array_equal(v.view(np.uint8), got[k].view(np.uint8), err_msg=k)
    assert mlp_numpy(a["x"], a["w1"], a["w2"], act, matmul_dtype=matmul_dtype)[1:] == (None, None, None)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype,matmul_dtype", [("fp32", None), ("bf16", None), ("bf16", "e4m3")])
def test_recompute_is_bitwise_equal_to_saved(dev, dtype, matmul_dtype, act):
    arrays = make_inputs(act, 199, 64, 96, 48, seed=2)
    for fuse in (False, True):
        saved = run_mlp(arrays, act, dtype, dev, recompute=False, fuse=fuse, matmul_dtype=matmul_dtype)
        recomputed = run_mlp(arrays, act, dtype, dev, recompute=True, fuse=fuse, matmul_dtype=matmul_dtype)
        for k in ("out", "dx", "dw1", "dw2"):
            bits = saved[k].view(np.uint8), recomputed[k].view(np.uint8)
            assert np.array_equal(*bits), f"{k} differs between recompute and saved (fuse={fuse})"


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("act", ["swiglu", "relu_sq"])
def test_partial_gradients_equal_full(act, recompute):
    arrays = make_inputs(act, 37, 16, 24, 8, seed=3)
    full = run_mlp(arrays, act, "bf16", "cpu", recompute=recompute)
    dev = ce.device("cpu")
    t = {k: ce.Tensor.from_numpy(v, dev, name=k, dtype="bf16") for k, v in arrays.items()}
    for want in ("dx", "dw1", "dw2"):
        out = ce.Tensor.empty("bf16", (37, 8), dev)
        pre = None if recompute else ce.Tensor.empty("bf16", (37, t["w1"].shape[0]), dev)
        stack = ce.DeviceMemoryStack(ce.Tensor.empty(ce.BYTE, (1 << 16,), dev))
        ctx = mlp_forward(out, pre, t["x"], t["w1"], t["w2"], act, stack)
        grads = {k: ce.Tensor.empty("bf16", full[k].shape, dev) if k == want else None for k in ("dx", "dw1", "dw2")}
        mlp_backward(grads["dx"], grads["dw1"], grads["dw2"], t["dout"], ctx, stack)
        assert stack.used == 0
        assert np.array_equal(grads[want].numpy().view(np.uint16), full[want].view(np.uint16)), want


@pytest.mark.parametrize("recompute", [False, True])
def test_dx_may_overwrite_x(recompute):
    arrays = make_inputs("swiglu", 37, 16, 24, 8, seed=11)
    ref = run_mlp(arrays, "swiglu", "bf16", "cpu", recompute=recompute)
    t = {k: ce.Tensor.from_numpy(v, "cpu", name=k, dtype="bf16") for k, v in arrays.items()}
    out, ctx = mlp(t["x"], t["w1"], t["w2"], "swiglu", recompute=recompute)
    dw1, dw2 = ce.Tensor.empty("bf16", t["w1"].shape), ce.Tensor.empty("bf16", t["w2"].shape)
    stack = ce.DeviceMemoryStack(ce.Tensor.empty(ce.BYTE, (1 << 16,)))
    mlp_backward(t["x"], dw1, dw2, t["dout"], ctx, stack)
    for k, v in {"dx": t["x"], "dw1": dw1, "dw2": dw2}.items():
        np.testing.assert_array_equal(v.numpy().view(np.uint16), ref[k].view(np.uint16), err_msg=k)


def test_a_saved_context_serves_one_backward():
    arrays = make_inputs("reglu", 37, 16, 24, 8, seed=12)
    t = {k: ce.Tensor.from_numpy(v, "cpu", name=k, dtype="bf16") for k, v in arrays.items()}
    _, ctx = mlp(t["x"], t["w1"], t["w2"], "reglu")
    stack = ce.DeviceMemoryStack(ce.Tensor.empty(ce.BYTE, (1 << 16,)))
    mlp_backward(None, None, t["dw2"], t["dout"], ctx, stack)  # dw2 alone leaves preact as it is
    assert not ctx.consumed
    first = mlp_grad(t["dout"], ctx)
    with pytest.raises(ValueError, match="already holds its gradient from an earlier backward"):
        mlp_grad(t["dout"], ctx)
    _, ctx = mlp(t["x"], t["w1"], t["w2"], "reglu", recompute=True)
    for _ in range(2):  # a recompute context keeps nothing that backward overwrites
        again = mlp_grad(t["dout"], ctx)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a.numpy().view(np.uint16), b.numpy().view(np.uint16))


def test_no_gradient_wanted_does_nothing():
    arrays = make_inputs("swiglu", 8, 8, 8, 8)
    t = {k: ce.Tensor.from_numpy(v, "cpu", name=k) for k, v in arrays.items()}
    stack = ce.DeviceMemoryStack.simulate()
    ctx = mlp_forward(ce.Tensor.empty("fp32", (8, 8)), None, t["x"], t["w1"], t["w2"], "swiglu", stack)
    before = stack.high_water_mark
    stack.high_water_mark = 0
    mlp_backward(None, None, None, t["dout"], ctx, stack)
    assert stack.high_water_mark == 0 and before > 0


def test_convenience_wrappers_match_out_first():
    arrays = make_inputs("geglu", 37, 16, 24, 8, seed=4)
    ref = run_mlp(arrays, "geglu", "bf16", "cpu", recompute=True, fuse=True)
    t = {k: ce.Tensor.from_numpy(v, "cpu", name=k, dtype="bf16") for k, v in arrays.items()}
    out, ctx = mlp(t["x"], t["w1"], t["w2"], "geglu", recompute=True, fuse_grad_accum=True)
    assert ctx.recompute and ctx.saved_bytes == 0
    dx, dw1, dw2 = mlp_grad(t["dout"], ctx, dw1=t["dw1"], dw2=t["dw2"])
    assert dw1 is t["dw1"] and dw2 is t["dw2"]  # accumulated in place
    for k, v in {"out": out, "dx": dx, "dw1": dw1, "dw2": dw2}.items():
        np.testing.assert_array_equal(v.numpy().view(np.uint16), ref[k].view(np.uint16), err_msg=k)
    # fuse_grad_accum with no existing gradient writes it, like the seed with weight.grad None
    written = run_mlp(arrays, "geglu", "bf16", "cpu", recompute=False)
    out, ctx = mlp(t["x"], t["w1"], t["w2"], "geglu", fuse_grad_accum=True)
    assert not ctx.recompute and ctx.saved_bytes == 37 * 48 * 2
    _, dw1, dw2 = mlp_grad(t["dout"], ctx)
    np.testing.assert_array_equal(dw1.numpy().view(np.uint16), written["dw1"].view(np.uint16))
    np.testing.assert_array_equal(dw2.numpy().view(np.uint16), written["dw2"].view(np.uint16))


@pytest.mark.parametrize("matmul_dtype", [None, "e4m3"])
def test_step_replays_from_a_graph(dev, matmul_dtype):
    # nothing in forward or backward allocates or syncs, so the whole step captures into one graph
    arrays = make_inputs("swiglu", 64, 64, 96, 32, seed=10)
    eager = run_mlp(arrays, "swiglu", "bf16", dev, recompute=True, fuse=True, matmul_dtype=matmul_dtype)  # warms plans
    t = {k: ce.Tensor.from_numpy(v, dev, name=k, dtype="bf16") for k, v in arrays.items()}
    alloc = ce.TensorAllocator(dev)
    out, dx = alloc.allocate("bf16", "out", (64, 32)), alloc.allocate("bf16", "dx", (64, 64))
    size = mlp_stack_bytes(64, 64, 96, 32, "swiglu", True, "bf16", matmul_dtype)
    stack = ce.DeviceMemoryStack(alloc.allocate(ce.BYTE, "stack", (size,)))

    def step():
        ctx = mlp_forward(out, None, t["x"], t["w1"], t["w2"], "swiglu", stack, matmul_dtype=matmul_dtype,
                          fuse_grad_accum=True)  # fmt: skip
        mlp_backward(dx, t["dw1"], t["dw2"], t["dout"], ctx, stack)

    graph = dev.capture(step)
    graph.launch()
    dev.synchronize()
    for k, v in {"out": out, "dx": dx, "dw1": t["dw1"], "dw2": t["dw2"]}.items():
        np.testing.assert_array_equal(v.numpy().view(np.uint16), eager[k].view(np.uint16), err_msg=k)


# ---- memory -------------------------------------------------------------------------------------
def _align(n):
    return (n + 255) // 256 * 256


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("act", ["swiglu", "gelu_tanh_approx"])
def test_stack_bytes(act, recompute):
    n, inp, hidden, out = 37, 16, 32, 8
    f1 = 2 * hidden if act in GATED else hidden
    size = mlp_stack_bytes(n, inp, hidden, out, act, recompute, "bf16")
    assert size == (_align(n * f1 * 2) if recompute else 0) + _align(n * hidden * 2)
    # the real functions against a simulated stack: same size, nothing launched, nothing written
    arrays = make_inputs(act, n, inp, hidden, out)
    t = {k: ce.Tensor.from_numpy(v, "cpu", name=k, dtype="bf16") for k, v in arrays.items()}
    o = ce.Tensor.from_numpy(np.full((n, out), 7.0), "cpu", dtype="bf16")
    dx = ce.Tensor.from_numpy(np.full((n, inp), 7.0), "cpu", dtype="bf16")
    pre = None if recompute else ce.Tensor.empty("bf16", (n, f1))
    sim = ce.DeviceMemoryStack.simulate()
    ctx = mlp_forward(o, pre, t["x"], t["w1"], t["w2"], act, sim)
    assert sim.max_utilization() == size
    mlp_backward(dx, t["dw1"], t["dw2"], t["dout"], ctx, sim)
    assert sim.max_utilization() == size and sim.used == 0
    assert mlp_stack_bytes(n, inp, hidden, out, act, recompute, "bf16", "e4m3") > size  # + the e4m3 copies
    assert np.all(o.numpy() == 7.0) and np.all(dx.numpy() == 7.0)
    np.testing.assert_array_equal(t["dw1"].numpy(), arrays["dw1"].astype(t["dw1"].dtype.np))
    # a stack one byte short is a clear MemoryError, raised before anything is written
    stack = ce.DeviceMemoryStack(ce.Tensor.empty(ce.BYTE, (size - 1,)))
    with pytest.raises(MemoryError, match=f"mlp_forward needs {size} bytes of temporaries but {size - 1} of its"):
        mlp_forward(o, pre, t["x"], t["w1"], t["w2"], act, stack)
    stack = ce.DeviceMemoryStack(ce.Tensor.empty(ce.BYTE, (size,)))
    ctx = mlp_forward(o, pre, t["x"], t["w1"], t["w2"], act, stack, fuse_grad_accum=True)
    o.copy_from_numpy(np.full((n, out), 7.0))
    stack.allocate(ce.BYTE, (1,), "someone else's")
    with pytest.raises(MemoryError, match=f"mlp_backward needs {size} bytes of temporaries but {size - 256} of"):
        mlp_backward(dx, t["dw1"], t["dw2"], t["dout"], ctx, stack)
    assert not ctx.consumed and np.all(o.numpy() == 7.0) and np.all(dx.numpy() == 7.0)
    for k in ("dw1", "dw2"):
        np.testing.assert_array_equal(t[k].numpy(), arrays[k].astype(ce.BF16.np), err_msg=k)


# ---- errors -------------------------------------------------------------------------------------
def _t(shape, dtype="bf16", name="t"):
    return ce.Tensor.from_numpy(rng(5).standard_normal(shape).astype(np.float32), "cpu", name=name, dtype=dtype)


FWD_ERRORS = [
    ("gelu", {}, "unknown activation 'gelu'"),
    ("swiglu", {"x": (4, 20), "w1": (16, 20)}, "in_features = 20 must be a multiple of 8"),
    ("relu", {"w1": (20, 16), "w2": (8, 20), "preact": (4, 20)}, "hidden_features = 20 must be a multiple of 8"),
    ("swiglu", {"w1": (40, 16), "w2": (8, 20), "preact": (4, 40)}, "hidden_features = 20 must be a multiple of 8"),
    ("relu", {"w2": (12, 8), "w1": (8, 16), "out": (4, 12)}, "out_features = 12 must be a multiple of 8"),
    ("swiglu", {"w1": (8, 16)}, r"mlp w1 \(2\*hidden, in\) for swiglu: expected shape \(16, 16\)"),
    ("relu", {"w1": (8, 24)}, r"mlp w1 \(hidden, in\) for relu: expected shape \(8, 16\)"),
    ("swiglu", {"w2": ("fp32", (8, 8))}, "mlp w2 .*: expected dtype bf16, got tensor 'w2' fp32"),
    ("swiglu", {"x": ("fp16", (4, 16))}, "mlp x: expected dtype bf16/fp32"),
    ("swiglu", {"x": ("e4m3", (4, 16))}, "mlp x: tensor 'x' is e4m3; pass bf16 or fp32 tensors and matmul_dtype"),
    ("swiglu", {"w1": ("e4m3", (16, 16))}, "mlp w1: tensor 'w1' is e4m3"),
    ("swiglu", {"x": (16,)}, "at least 2 dimensions"),
    ("swiglu", {"x": (0, 16), "out": (0, 8), "preact": (0, 16)}, "has no rows"),
    ("swiglu", {"out": (4, 16)}, r"mlp_forward out: expected shape \(4, 8\)"),
    ("swiglu", {"out": ("fp32", (4, 8))}, "mlp_forward out: expected dtype bf16"),
    ("swiglu", {"preact": (4, 8)}, r"mlp_forward preact: expected shape \(4, 16\)"),
    ("swiglu", {"matmul_dtype": "e5m2"}, "matmul_dtype must be None .* or 'e4m3', got 'e5m2'"),
    (
        "swiglu",
        {"matmul_dtype": "e4m3", "w2": (8, 24), "w1": (48, 16), "preact": (4, 48)},
        "hidden_features = 24 must be a multiple of 16 for matmul_dtype='e4m3'",
    ),
    (
        "relu",
        {"matmul_dtype": "e4m3", "x": (4, 8), "w1": (8, 8), "preact": (4, 8)},
        "in_features = 8 must be a multiple of 16 for matmul_dtype='e4m3'",
    ),
]


def _fwd_args(overrides):
    shapes = {"x": (4, 16), "w1": (16, 16), "w2": (8, 8), "out": (4, 8), "preact": (4, 16)}
    args = {"matmul_dtype": overrides.get("matmul_dtype")}
    for k, default in shapes.items():
        v = overrides.get(k, default)
        dtype, shape = v if isinstance(v[0], str) else ("bf16", v)
        args[k] = _t(shape, dtype, k)
    return args


@pytest.mark.parametrize("act,overrides,match", FWD_ERRORS)
def test_forward_errors(act, overrides, match):
    a = _fwd_args(overrides)
    a["out"].copy_from_numpy(np.full(a["out"].shape, 3.0))
    stack = ce.DeviceMemoryStack(ce.Tensor.empty(ce.BYTE, (1 << 16,)))
    with pytest.raises(ValueError, match=match):
        mlp_forward(a["out"], a["preact"], a["x"], a["w1"], a["w2"], act, stack, matmul_dtype=a["matmul_dtype"])
    assert stack.used == 0 and stack.high_water_mark == 0
    assert np.all(a["out"].numpy() == 3.0)  # bad input changes nothing


def test_forward_rejects_non_tensors():
    a = _fwd_args({})
    with pytest.raises(ValueError, match="mlp x: expected a cuengine Tensor, got ndarray"):
        mlp(np.zeros((4, 16)), a["w1"], a["w2"], "swiglu")


BWD_ERRORS = [
    ({"dout": (4, 16)}, r"mlp_backward dout: expected shape \(4, 8\)"),
    ({"dout": ("fp32", (4, 8))}, "mlp_backward dout: expected dtype bf16"),
    ({"dx": (4, 8)}, r"mlp_backward dx: expected shape \(4, 16\)"),
    ({"dw1": (8, 16)}, r"mlp_backward dw1: expected shape \(16, 16\)"),
    ({"dw1": ("fp16", (16, 16))}, "mlp_backward dw1: expected dtype bf16/fp32"),
    ({"dw2": (8, 16)}, r"mlp_backward dw2: expected shape \(8, 8\)"),
]


@pytest.mark.parametrize("overrides,match", BWD_ERRORS)
def test_backward_errors(overrides, match):
    a = _fwd_args({})
    stack = ce.DeviceMemoryStack(ce.Tensor.empty(ce.BYTE, (1 << 16,)))
    ctx = mlp_forward(a["out"], None, a["x"], a["w1"], a["w2"], "swiglu", stack)
    shapes = {"dx": (4, 16), "dw1": (16, 16), "dw2": (8, 8), "dout": (4, 8)}
    g = {}
    for k, default in shapes.items():
        v = overrides.get(k, default)
        dtype, shape = v if isinstance(v[0], str) else ("bf16", v)
        g[k] = _t(shape, dtype, k)
    before = g["dw1"].numpy().copy()
    stack.high_water_mark = 0
    with pytest.raises(ValueError, match=match):
        mlp_backward(g["dx"], g["dw1"], g["dw2"], g["dout"], ctx, stack)
    assert stack.used == 0 and stack.high_water_mark == 0
    np.testing.assert_array_equal(g["dw1"].numpy().view(np.uint16), before.view(np.uint16))


# ---- cuda against the cpu twin ------------------------------------------------------------------
GPU_CASES = [(act, (1, 64, 96, 64)) for act in ACTS] + [(act, (37, 200, 344, 136)) for act in ACTS]
GPU_CASES += [(act, (760, 1024, 2816, 1024)) for act in ("swiglu", "gelu_tanh_approx")]


@pytest.mark.gpu
@pytest.mark.parametrize("recompute,fuse", [(False, False), (True, True)], ids=["saved", "recompute+fuse"])
@pytest.mark.parametrize("act,shape", GPU_CASES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_mlp_cuda_matches_cpu(dtype, act, shape, recompute, fuse):
    compare_devices(make_inputs(act, *shape, seed=6), act, dtype, recompute, fuse)


def compare_devices(arrays, act, dtype, recompute, fuse, matmul_dtype=None):
    cpu = run_mlp(arrays, act, dtype, "cpu", recompute=recompute, fuse=fuse, matmul_dtype=matmul_dtype)
    cuda = run_mlp(arrays, act, dtype, "cuda", recompute=recompute, fuse=fuse, matmul_dtype=matmul_dtype)
    for k in ("out", "dx", "dw1", "dw2"):
        e = cpu[k].astype(np.float64)
        if matmul_dtype is not None:
            # One fp8 rounding flip of a hidden value (its fp32 input differs by an ulp between the
            # devices) moves a whole output row by a fp8 ulp times the weights: compare in norm.
            err = np.linalg.norm(cuda[k].astype(np.float64) - e) / np.linalg.norm(e)
            assert err < 2e-2, f"{k}: relative error {err:.3g} between cuda and cpu"
            continue
        assert_close(cuda[k].astype(np.float64), e, dtype, what=k, scale=max(1.0, float(np.max(np.abs(e)))))


@pytest.mark.gpu
@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
@pytest.mark.parametrize("act,shape", [(a, (37, 64, 96, 64)) for a in ACTS] + [("swiglu", (760, 1024, 2816, 1024))])
def test_mlp_fp8_cuda_matches_cpu(act, shape, recompute):
    compare_devices(make_inputs(act, *shape, seed=9), act, "bf16", recompute, False, matmul_dtype="e4m3")
