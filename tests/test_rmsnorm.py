"""RMSNorm forward, fused residual forward and backward: twins against float64 and finite differences,
aliasing, deterministic dweight, and cpu vs cuda."""

import numpy as np
import pytest
from conftest import ROWS, assert_close, check_op, finite_difference, rng, tensors

import cuengine as ce
from cuengine.kernels.rmsnorm import (
    fused_residual_rmsnorm_forward,
    fused_residual_rmsnorm_forward_np,
    rmsnorm_backward,
    rmsnorm_backward_np,
    rmsnorm_backward_partials_np,
    rmsnorm_forward,
    rmsnorm_forward_np,
    rmsnorm_scratch_shape,
)

EPS = 1e-5


def ref64(x, w, eps=EPS):
    """RMSNorm in float64, from its definition."""
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


def make(n, c, dtype, seed=0):
    """x, weight, dout, dresidual in `dtype` (weights around 1, with a spread)."""
    r = rng(seed)
    np_dt = ce.dtype(dtype).np
    x = (r.standard_normal((n, c)) * 2 + 0.5).astype(np_dt)
    w = (1 + 0.3 * r.standard_normal(c)).astype(np_dt)
    g = r.standard_normal((n, c)).astype(np_dt)
    dres = r.standard_normal((n, c)).astype(np_dt)
    return x, w, g, dres


# ---- cpu: the twins against float64 -----------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_forward_twin_matches_float64(dtype):
    x, w, _, _ = make(37, 96, dtype)
    out, rstd = rmsnorm_forward_np(x, w, EPS)
    assert out.dtype == x.dtype and rstd.dtype == np.float32
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(np.mean(x64**2, axis=-1) + EPS), rtol=1e-6)
    assert_close(out, ref64(x, w), dtype, "out")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_twin_normalises_the_rounded_residual(dtype):
    x, w, g, _ = make(37, 96, dtype)
    res, out, rstd = fused_residual_rmsnorm_forward_np(x, g, w, EPS)
    want_res = (x.astype(np.float64) + g.astype(np.float64)).astype(x.dtype)
    np.testing.assert_array_equal(res, want_res)  # one rounding of an exact fp32 sum
    assert_close(out, ref64(res, w), dtype, "out")
    np.testing.assert_allclose(rstd, 1 / np.sqrt(np.mean(res.astype(np.float64) ** 2, axis=-1) + EPS), rtol=1e-6)


def test_backward_twin_matches_finite_differences():
    """d/dx and d/dw of sum(dout * rmsnorm(x, w)) by central differences of the float64 formula."""
    x, w, g, dres = make(3, 16, "fp32", seed=1)
    _, rstd = rmsnorm_forward_np(x, w, EPS)
    dinp, dweight = rmsnorm_backward_np(dres, g, x, w, rstd)

    def loss(x_, w_):
        return np.sum(g.astype(np.float64) * ref64(x_, w_))

    fdx = finite_difference(lambda x64: loss(x64, w.astype(np.float64)), x)
    fdw = finite_difference(lambda w64: loss(x.astype(np.float64), w64), w)
    np.testing.assert_allclose(dinp, dres + fdx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dweight, fdw, rtol=1e-4, atol=1e-5)


# ---- launchers: both devices -------------------------------------------------------------------
def test_forward_launchers_and_abs_max(dev):
    x, w, g, _ = make(2 * 19, 64, "fp32", seed=2)
    x3, g3 = x.reshape(2, 19, 64), g.reshape(2, 19, 64)  # leading dims flatten to rows
    t = tensors(dev, x=x3, w=w, g=g3, out=np.zeros_like(x3), res=np.zeros_like(x3), out2=np.zeros_like(x3),
                rstd=np.zeros((2, 19), np.float32), rstd2=np.zeros((2, 19), np.float32),
                amax=np.zeros(1, np.float32), amax2=np.array([1e6], np.float32))  # fmt: skip
    rmsnorm_forward(t["out"], t["rstd"], t["x"], t["w"], EPS, abs_max=t["amax"])
    fused_residual_rmsnorm_forward(t["res"], t["out2"], t["rstd2"], t["x"], t["g"], t["w"], EPS, abs_max=t["amax2"])
    out, rstd = rmsnorm_forward_np(x3, w, EPS)
    res, out2, rstd2 = fused_residual_rmsnorm_forward_np(x3, g3, w, EPS)
    for k, v in (("out", out), ("rstd", rstd), ("res", res), ("out2", out2), ("rstd2", rstd2)):
        assert_close(t[k].numpy(), v, "fp32", k)
    assert_close(t["amax"].numpy(), [np.abs(out).max()], "fp32", "abs_max")
    assert t["amax2"].numpy()[0] == 1e6  # max-accumulate keeps a larger value


@pytest.mark.parametrize("res_alias,out_alias", [("x", None), ("g", None), (None, "g"), ("x", "g"), ("g", "x")])
def test_fused_residual_outputs_may_alias_inputs(dev, res_alias, out_alias):
    x, w, g, _ = make(37, 64, "bf16", seed=3)
    t = tensors(dev, x=x, g=g, w=w, res=np.zeros_like(x), out=np.zeros_like(x), rstd=np.zeros(37, np.float32))
    res, out = t[res_alias or "res"], t[out_alias or "out"]
    fused_residual_rmsnorm_forward(res, out, t["rstd"], t["x"], t["g"], t["w"], EPS)
    want_res, want_out, _ = fused_residual_rmsnorm_forward_np(x, g, w, EPS)
    assert_close(res.numpy(), want_res, "bf16", "residual")
    assert_close(out.numpy(), want_out, "bf16", "out")


def test_backward_in_place_and_accumulating(dev):
    """dinp aliasing dresidual (as the seed does), and dweight += across two calls."""
    n, c = 37, 64
    x, w, g, dres = make(n, c, "fp32", seed=4)
    _, rstd = rmsnorm_forward_np(x, w, EPS)
    dw0 = rng(5).standard_normal(c).astype(np.float32)
    t = tensors(dev, x=x, w=w, g=g, d=dres, rstd=rstd, dw=dw0, amax=np.zeros(1, np.float32),
                scratch=np.zeros(rmsnorm_scratch_shape(n, c), np.float32))  # fmt: skip
    rmsnorm_backward(t["d"], t["dw"], t["scratch"], t["d"], t["g"], t["x"], t["w"], t["rstd"], abs_max=t["amax"])
    dinp, dweight = rmsnorm_backward_np(dres, g, x, w, rstd)
    assert_close(t["d"].numpy(), dinp, "fp32", "dinp in place")
    assert_close(t["amax"].numpy(), [np.abs(dinp).max()], "fp32", "abs_max")
    rmsnorm_backward(t["d"], t["dw"], t["scratch"], t["d"], t["g"], t["x"], t["w"], t["rstd"])
    assert_close(t["dw"].numpy(), dw0 + 2 * dweight, "fp32", "dweight after two calls")


def test_scratch_shape():
    assert rmsnorm_scratch_shape(1, 896) == (1, 896)
    assert rmsnorm_scratch_shape(37, 896) == (5, 896)  # 8 rows per block
    assert rmsnorm_scratch_shape(1048, 1536) == (131, 1536)
    assert rmsnorm_scratch_shape(8192, 896) == (132, 896)  # capped at one block per H200 SM: long-lived blocks
    assert rmsnorm_scratch_shape(32768, 1536, "bf16") == (132, 1536)
    assert rmsnorm_scratch_shape(37, 8192) == (13, 8192)  # 3 warps: 96 KiB of shared partials
    assert rmsnorm_scratch_shape(37, 24576) == (37, 24576)  # 1 warp


def test_scratch_shape_caps_the_looping_kernel_at_264_blocks():
    """Rows of at most 4096 bytes (the register variants) take 132 blocks, wider rows (the looping kernel,
    which reads rows twice and needs two blocks a SM) 264; without a dtype, enough for any dtype."""
    cases = [(1536, "bf16", 132), (2048, "bf16", 132), (2056, "bf16", 264), (3584, "bf16", 264),
             (1024, "fp32", 132), (1032, "fp32", 264), (1536, "fp32", 264), (2048, "fp16", 132)]  # fmt: skip
    for c, dtype, p in cases:
        assert rmsnorm_scratch_shape(8192, c, dtype) == (p, c), (c, dtype)
    assert rmsnorm_scratch_shape(32768, 3584, "bf16") == (264, 3584)
    assert rmsnorm_scratch_shape(8192, 1536) == (264, 1536)  # fp32's rows are the widest
    assert rmsnorm_scratch_shape(8192, 896) == (132, 896)
    assert rmsnorm_scratch_shape(37, 8192, "bf16") == (13, 8192)  # fewer rows than the cap


def test_backward_takes_a_larger_scratch_and_refuses_a_smaller_one(dev):
    n, c = 8192, 1536  # bf16: 132 blocks; the dtype-free scratch has 264 rows
    x, w, g, dres = make(n, c, "bf16", seed=6)
    _, rstd = rmsnorm_forward_np(x, w, EPS)
    for rows in (rmsnorm_scratch_shape(n, c)[0], rmsnorm_scratch_shape(n, c, "bf16")[0]):
        t = tensors(dev, x=x, w=w, g=g, d=dres, rstd=rstd, dw=np.zeros(c, x.dtype),
                    scratch=np.zeros((rows, c), np.float32))  # fmt: skip
        rmsnorm_backward(t["d"], t["dw"], t["scratch"], t["d"], t["g"], t["x"], t["w"], t["rstd"])
    t["scratch"] = tensors(dev, s=np.zeros((131, c), np.float32))["s"]
    with pytest.raises(ValueError, match="fewer than 132 rows"):
        rmsnorm_backward(t["d"], t["dw"], t["scratch"], t["d"], t["g"], t["x"], t["w"], t["rstd"])


# ---- errors --------------------------------------------------------------------------------------
BF, F32 = ce.BF16.np, np.float32
FWD = {"out": (4, 8), "rstd": (4,), "inp": (4, 8), "weight": (8,)}
FUSED = {"residual": (4, 8), "out": (4, 8), "rstd": (4,), "inp1": (4, 8), "inp2": (4, 8), "weight": (8,)}
BWD = {"dinp": (4, 8), "dweight": (8,), "scratch": (1, 8), "dresidual": (4, 8), "dout": (4, 8), "inp": (4, 8),
       "weight": (8,), "rstd": (4,)}  # fmt: skip


@pytest.mark.parametrize(
    "fn,spec,over,match",
    [
        (rmsnorm_forward, FWD, {"out": ((4, 12), BF), "inp": ((4, 12), BF), "weight": ((12,), BF)},
         "C = 12 must be a multiple of 8"),
        (rmsnorm_forward, FWD, {"out": ((4, 0), F32), "inp": ((4, 0), F32), "weight": ((0,), F32)}, "has no channels"),
        (rmsnorm_forward, FWD, {"weight": ((16,), F32)}, r"weight: expected shape \(8\)"),
        (rmsnorm_forward, FWD, {"weight": ((8,), BF)}, "weight: expected dtype fp32"),
        (rmsnorm_forward, FWD, {"rstd": ((4,), BF)}, "rstd: expected dtype fp32"),
        (rmsnorm_forward, FWD, {"rstd": ((5,), F32)}, r"rstd: expected shape \(4\)"),
        (rmsnorm_forward, FWD, {"out": ((4, 8), BF)}, "out: expected dtype fp32"),
        (rmsnorm_forward, FWD, {"inp": ((4, 8), np.int32)}, "inp: expected dtype fp32/bf16/fp16"),
        (rmsnorm_forward, FWD, {"abs_max": ((3,), F32)}, r"abs_max: expected shape \(1\)"),
        (fused_residual_rmsnorm_forward, FUSED, {"inp2": ((3, 8), F32)}, r"inp2: expected shape \(4, 8\)"),
        (fused_residual_rmsnorm_forward, FUSED, {"residual": ((4, 16), F32)}, r"residual: expected shape \(4, 8\)"),
        (rmsnorm_backward, BWD, {"scratch": ((1, 16), F32)}, r"scratch: expected shape \(\*, 8\)"),
        (rmsnorm_backward, BWD, {"scratch": ((1, 8), BF)}, "scratch: expected dtype fp32"),
        (rmsnorm_backward, BWD, {"dweight": ((9,), F32)}, r"dweight: expected shape \(8\)"),
        (rmsnorm_backward, BWD, {"dout": ((4, 9), F32)}, r"dout: expected shape \(4, 8\)"),
        (rmsnorm_backward, BWD, {"dresidual": ((4, 8), BF)}, "dresidual: expected dtype fp32"),
    ],
)  # fmt: skip
def test_errors(fn, spec, over, match):
    args = {k: ce.Tensor.from_numpy(np.zeros(*over.get(k, (shape, F32))), "cpu", name=k) for k, shape in spec.items()}
    args.update({k: ce.Tensor.from_numpy(np.zeros(*v), "cpu", name=k) for k, v in over.items() if k not in spec})
    eps = {} if fn is rmsnorm_backward else {"eps": EPS}
    with pytest.raises(ValueError, match=match):
        fn(**args, **eps)


@pytest.mark.parametrize("n,c", [(5, 64), (37, 96), (3000, 64), (2000, 4096)])  # (2000, 4096): 264 blocks
def test_partials_twin_groups_every_row_once(n, c):
    """rmsnorm_backward_partials_np (the scratch's bits in the host emulation) adds up to dweight: each row
    in exactly one block's partial; row (k * P + b) * warps + w in block b's."""
    x, w, g, _ = make(n, c, "fp32", seed=n)
    _, rstd = rmsnorm_forward_np(x, w, EPS)
    partials = rmsnorm_backward_partials_np(g, x, rstd)
    P, warps = partials.shape[0], min(8, 24576 // c)
    assert partials.shape == rmsnorm_scratch_shape(n, c, "fp32")
    np.testing.assert_allclose(partials.sum(0, dtype=np.float64), rmsnorm_backward_np(x, g, x, w, rstd)[1],
                               rtol=1e-4, atol=1e-4 * np.sqrt(n))  # fmt: skip
    terms = g.astype(np.float64) * x * rstd[:, None]
    block = np.arange(n) // warps % P
    want = np.stack([terms[block == b].sum(0) for b in range(P)])
    np.testing.assert_allclose(partials, want, rtol=1e-4, atol=1e-4)


def test_too_wide_for_the_backward():
    with pytest.raises(ValueError, match="C = 30000 is too large"):
        rmsnorm_scratch_shape(4, 30000)


# ---- gpu: cuda against the twin ---------------------------------------------------------------
def check_backward(n, c, dtype, seed=0):
    """cuda against the twin, in place on dresidual (as the model runs it), over garbage scratch, and
    bitwise repeatable; dweight sums n rows, so its fp32 summation-order error grows like sqrt(n)."""
    x, w, g, dres = make(n, c, dtype, seed)
    _, rstd = rmsnorm_forward_np(x, w, EPS)
    dw0 = rng(seed + 1).standard_normal(c).astype(ce.dtype(dtype).np)
    check_op(rmsnorm_backward, {"dresidual": dres, "dout": g, "inp": x, "weight": w, "rstd": rstd},
             {"dweight": dw0, "abs_max": np.zeros(1, np.float32)}, inplace={"dinp": "dresidual"},
             scratch={"scratch": ("fp32", rmsnorm_scratch_shape(n, c))}, compare={"abs_max": dtype},
             scale={"dweight": max(1.0, np.sqrt(n))}, repeat=True)  # fmt: skip


def forward_both(out, rstd, residual, out2, rstd2, abs_max, inp, inp2, weight, eps):
    rmsnorm_forward(out, rstd, inp, weight, eps, abs_max=abs_max)
    fused_residual_rmsnorm_forward(residual, out2, rstd2, inp, inp2, weight, eps)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("c", [1000, 1536])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_matches_cpu(rows, c, dtype):
    x, w, g, _ = make(rows, c, dtype, seed=rows)
    z = np.zeros((rows, c), np.float32)
    r0 = np.zeros(rows, np.float32)
    check_op(forward_both, {"inp": x, "inp2": g, "weight": w},
             {"out": z, "rstd": r0, "residual": z, "out2": z, "rstd2": r0, "abs_max": np.zeros(1, np.float32)},
             dtypes={"out": dtype, "residual": dtype, "out2": dtype},
             compare={"rstd": "fp32", "rstd2": "fp32", "abs_max": dtype}, eps=EPS)  # fmt: skip
    check_backward(rows, c, dtype, seed=rows)


@pytest.mark.gpu
@pytest.mark.parametrize("c", [8192, 16384])  # fewer warps per backward block; 64 KiB of dynamic shared memory
def test_cuda_wide_rows(c):
    check_backward(37, c, "bf16")
    x, w, _, _ = make(37, c, "bf16")
    outs = {"out": np.zeros((37, c), np.float32), "rstd": np.zeros(37, np.float32)}
    check_op(rmsnorm_forward, {"inp": x, "weight": w}, outs, dtypes={"out": "bf16"}, compare={"rstd": "fp32"}, eps=EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("c,dtype", [(896, "bf16"), (1000, "bf16"), (1536, "bf16"), (2048, "bf16"), (264, "bf16"),
                                     (64, "bf16"), (1536, "fp16"), (1024, "fp32"), (768, "fp32"),
                                     (100, "fp32")])  # fmt: skip
@pytest.mark.parametrize("rows", [37, 8192])
def test_cuda_register_rows_bitwise_equal_to_the_looping_kernel(c, dtype, rows, monkeypatch):
    """rmsnorm_backward_v<V> (staged rows, weights and partials in registers) gives the bits of the kernel
    that reads rows from global memory twice (rmsnorm_backward_*, used for wide rows), the partials are
    grouped as rmsnorm_backward_partials_np groups them (to an ulp or so: the GPU fuses multiply-adds),
    and dweight is the partials added in order."""
    import cuengine.kernels.rmsnorm as R

    x, w, g, dres = make(rows, c, dtype, seed=c)
    _, rstd = rmsnorm_forward_np(x, w, EPS)
    dw0 = rng(1).standard_normal(c).astype(ce.dtype(dtype).np)
    got = {}
    for regs in (R._REG_VECTORS, ()):
        monkeypatch.setattr(R, "_REG_VECTORS", regs)
        scratch = np.zeros(rmsnorm_scratch_shape(rows, c, dtype), np.float32)
        t = tensors(ce.device("cuda"), dinp=dres, dweight=dw0, dout=g, inp=x, weight=w, rstd=rstd,
                    abs_max=np.zeros(1, np.float32), scratch=scratch)  # fmt: skip
        rmsnorm_backward(t["dinp"], t["dweight"], t["scratch"], t["dinp"], t["dout"], t["inp"], t["weight"],
                         t["rstd"], abs_max=t["abs_max"])  # fmt: skip
        got[regs] = {k: t[k].numpy() for k in ("dinp", "dweight", "abs_max", "scratch")}
        partials = rmsnorm_backward_partials_np(g, x, rstd)
        np.testing.assert_allclose(got[regs]["scratch"], partials, rtol=1e-5, atol=1e-3, err_msg="partials")
        acc = np.zeros(c, np.float32)
        for p in got[regs]["scratch"]:
            acc += p
        want = (dw0.astype(np.float32) + acc).astype(dw0.dtype)
        np.testing.assert_array_equal(got[regs]["dweight"].view(np.uint8), want.view(np.uint8))
    fast, loop = got.values()
    for k in fast:
        np.testing.assert_array_equal(fast[k].view(np.uint8), loop[k].view(np.uint8), err_msg=k)
