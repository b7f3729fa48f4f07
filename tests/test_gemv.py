"""Decode GEMV, dual GEMV and per-row E4M3 quantisation: twins against float64, every option and
awkward shape on both devices, the FP8 arm against BF16, and the fused prologues against the
unfused kernels bit for bit."""

import functools
from types import SimpleNamespace

import kernel_emulator as emu
import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, check_op, rng

import cuengine as ce
from cuengine.kernels.activations import activation_forward_np, swiglu_forward
from cuengine.kernels.gemv import (
    ACC_SHIFT,
    _grid,
    _rows,
    _split,
    _tile,
    acc_input_np,
    acc_shape,
    gemv,
    gemv_dual,
    gemv_dual_np,
    gemv_np,
    quantize_rows,
    quantize_rows_np,
)
from cuengine.kernels.rmsnorm import rmsnorm_forward

EPS = 1e-6
E4M3 = ml_dtypes.float8_e4m3fn
FP8_REL_RMS = 0.04  # stated tolerance of the W8A16 arm: ||y_fp8 - y_bf16|| / ||y_bf16|| (about 0.025 expected)


@functools.cache
def _normal(shape, seed):
    a = rng(seed).standard_normal(shape, dtype=np.float32)
    a.flags.writeable = False
    return a


def case(b, K, N, dtype="bf16", wdtype=None, seed=0, act=None):
    """x (b, K) or (b, 2K) for act, w (N, K) scaled so outputs are O(1), and the optional operands."""
    np_dt = ce.dtype(dtype).np
    width = 2 * K if act else K
    c = {
        "x": (_normal((b, width), seed) * 1.5 + 0.25).astype(np_dt),
        "w": (_normal((N, K), seed + 1) / np.sqrt(K)).astype(np_dt),
        "bias": (0.5 * _normal((N,), seed + 2)).astype(np_dt),
        "residual": _normal((b, N), seed + 3).astype(np_dt),
        "norm_weight": (1 + 0.3 * _normal((K,), seed + 4)).astype(np_dt),
    }
    if wdtype == "e4m3":
        c["w"], c["w_scale"] = quantize_rows_np(c["w"])
    return c


def ref64(x, w, w_scale=None, bias=None, residual=None, norm_weight=None, act=None):
    """The layer in float64 from its definition, independent of the twin (no intermediate rounding)."""
    x = x.astype(np.float64)
    if act == "swiglu":
        g, u = np.split(x, 2, axis=1)
        x = g / (1 + np.exp(-g)) * u
    if norm_weight is not None:
        x = x / np.sqrt(np.mean(x**2, axis=1, keepdims=True) + EPS) * norm_weight.astype(np.float64)
    w = w.astype(np.float64)
    if w_scale is not None:
        w = w * w_scale.astype(np.float64)[:, None]
    y = x @ w.T
    if bias is not None:
        y = y + bias.astype(np.float64)
    if residual is not None:
        y = y + residual.astype(np.float64)
    return y


def tensors(dev, arrays):
    return {k: ce.Tensor.from_numpy(v, dev, name=k) for k, v in arrays.items()}


OPTIONS = {
    "plain": {},
    "bias": {"bias": True},
    "residual": {"residual": True},
    "norm": {"norm_weight": True},
    "swiglu": {"act": "swiglu"},
    "fp32 out": {"out": "fp32"},
    "norm+bias+residual, fp32 out": {"norm_weight": True, "bias": True, "residual": True, "out": "fp32"},
}


def operands(c, opt):
    """The keyword operands of option set `opt` taken from case `c`."""
    kw = {k: c[k] for k in ("bias", "residual", "norm_weight") if opt.get(k)}
    if "w_scale" in c:
        kw["w_scale"] = c["w_scale"]
    if opt.get("out") == "fp32" and "residual" in kw:
        kw["residual"] = kw["residual"].astype(np.float32)
    return kw


# ---- cpu: the twins against float64 -----------------------------------------------------------
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("wdtype", [None, "e4m3"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_twin_matches_float64(dtype, wdtype, option):
    opt = OPTIONS[option]
    c = case(5, 96, 40, dtype, wdtype, act=opt.get("act"))
    kw = operands(c, opt)
    out_dt = ce.dtype(opt.get("out", dtype))
    y = gemv_np(c["x"], c["w"], act=opt.get("act"), eps=EPS, out_dtype=out_dt.np, **kw)
    assert y.dtype == out_dt.np and y.shape == (5, 40)
    # the model dtype's tolerance: fp32 logits of bf16 inputs carry the bf16 rounding of the norm
    assert_close(y, ref64(c["x"], c["w"], act=opt.get("act"), **kw), dtype, option)


def test_bias_and_residual_are_added_after_rounding(dev):
    """256 + 1 (the product) lies halfway between bf16 neighbours 256 and 258: rounding it first gives
    256, then + 0.5 gives 256 again; one rounding of 257.5 would give 258. Same for the residual."""
    x = np.zeros((1, 8), ml_dtypes.bfloat16)
    x[0, :2] = [256, 1]
    w = np.zeros((8, 8), ml_dtypes.bfloat16)
    w[:, :2] = 1
    half = np.full(8, 0.5, ml_dtypes.bfloat16)
    assert set(gemv_np(x, w, bias=half).astype(np.float64).ravel()) == {256.0}
    assert set(gemv_np(x, w, residual=half.reshape(1, 8)).astype(np.float64).ravel()) == {256.0}
    t = tensors(dev, {"x": x, "w": w, "bias": half, "residual": half.reshape(1, 8)})
    out = ce.Tensor.empty(ce.BF16, (1, 8), dev, name="out")
    for kw in ({"bias": t["bias"]}, {"residual": t["residual"]}):
        gemv(out, t["x"], t["w"], **kw)
        assert set(out.numpy().astype(np.float64).ravel()) == {256.0}, kw


def test_dual_twin_is_the_gemv_of_the_packed_weight():
    c = case(3, 64, 48, "bf16")
    want = ref64(c["x"], c["w"], norm_weight=c["norm_weight"])
    got = gemv_dual_np(c["x"], c["w"], norm_weight=c["norm_weight"], eps=EPS)
    assert_close(got, want, "bf16", "dual")


def test_dual_swiglu_twin_is_swiglu_of_the_rounded_gate_and_up():
    c = case(3, 64, 48, "bf16")
    pair = gemv_dual_np(c["x"], c["w"], norm_weight=c["norm_weight"], eps=EPS)
    got = gemv_dual_np(c["x"], c["w"], norm_weight=c["norm_weight"], eps=EPS, act="swiglu")
    np.testing.assert_array_equal(got.view(np.uint16), activation_forward_np(pair, "swiglu").view(np.uint16))
    g, u = np.split(ref64(c["x"], c["w"], norm_weight=c["norm_weight"]), 2, axis=1)
    assert_close(got, g / (1 + np.exp(-g)) * u, "bf16", "dual swiglu vs float64")


def test_quantize_rows_np():
    w = (_normal((6, 64), 7) * np.float32(3)).astype(ml_dtypes.bfloat16)
    w[2] = 0  # an all-zero row has scale 1
    w[3, 5] = 1e-30  # a subnormal-range value in a row of large ones
    w8, s = quantize_rows_np(w)
    assert w8.dtype == E4M3 and s.dtype == np.float32
    w32 = w.astype(np.float32)
    amax = np.abs(w32).max(axis=1)
    np.testing.assert_array_equal(s, np.where(amax == 0, 1, amax / np.float32(448)).astype(np.float32))
    np.testing.assert_array_equal(np.abs(w8.astype(np.float32)).max(axis=1)[[0, 1, 3, 4, 5]], 448)
    deq = w8.astype(np.float64) * s[:, None]
    # E4M3 keeps 3 mantissa bits: half an ulp is 1/16 of a value, or 2^-10 of the scale in the subnormals
    err = np.abs(deq - w32)
    assert np.all(err <= np.maximum(np.abs(w32) / 16, s[:, None] * 2.0**-10) * (1 + 1e-6))
    assert w8[3, 5] == 0 and np.all(w8[2] == 0)


def test_quantize_rows_nonfinite_row_gives_nonfinite_scale():
    w = np.ones((2, 16), np.float32)
    w[1, 3] = np.nan
    w8, s = quantize_rows_np(w)
    assert s[0] == np.float32(1 / 448) and np.isnan(s[1])
    y = gemv_np(np.ones((1, 16), np.float32), w8, s)
    assert np.isfinite(y[0, 0]) and np.isnan(y[0, 1])


@pytest.mark.parametrize("K,N", [(896, 256), (4864, 64)])
def test_fp8_arm_within_stated_tolerance_of_bf16(K, N):
    c = case(4, K, N, "bf16")
    w8, s = quantize_rows_np(c["w"])
    y16 = gemv_np(c["x"], c["w"]).astype(np.float64)
    y8 = gemv_np(c["x"], w8, s).astype(np.float64)
    rel = np.linalg.norm(y8 - y16) / np.linalg.norm(y16)
    assert 1e-3 < rel < FP8_REL_RMS, rel  # the lower bound: the arm really runs on E4M3 weights


def test_split_is_chosen_by_shape_alone():
    """The K split fixes the summation order, so it must come from (N, K) only (not the GPU or b):
    each K-slice at least 32 vectors, at most 4 tiles per SM, and past one wave only for long slices."""
    assert _split(4864, 896 * 2 // 16) == 1  # 896 -> 4864: 304 blocks already
    assert _split(896, 4864 * 2 // 16) == 4  # 4864 -> 896: 224 blocks at S = 4; 448 at S = 8, a tail of short tiles
    assert _split(896, 4864 // 16) == 4  # the same in E4M3
    assert _split(2048, 1536 * 2 // 16) == 2  # 1.5B qkv: 256 blocks; 512 at S = 4, a slice of one round
    assert _split(4096, 14336 * 2 // 16) == 2  # 512 blocks: slices of 14 rounds at S = 1 split on
    assert _split(2048, 11008 * 2 // 16) == 4  # 3B down: 512 blocks, 6 rounds at S = 2
    assert _split(896, 64 * 2 // 16) == 1  # 8 vectors per row: nothing to split


def test_wide_rows_only_where_a_single_row_gemv_passes_one_wave():
    """Four weight rows a warp (the E4M3 _r4 kernels) where tiles of two would leave blocks a second tile."""
    assert _rows(9728, 1, 1, True) == 4  # 0.5B gate/up: 608 tiles of 2 rows a warp, 304 of 4
    assert _rows(9728, 1, 1, False) == 2  # bf16 weights keep two
    assert _rows(4864, 1, 1, True) == 2  # 304 tiles already
    assert _rows(9728, 4, 1, True) == 2  # multi-row passes keep R = 2
    assert _rows(896, 1, 4, True) == 2  # 224 tiles at S = 4
    assert _rows(151936, 1, 1, True) == 4  # the LM head


def test_input_tile_and_grid_sizes():
    """Input rows per pass: the smallest compiled tile holding b (at most 8) whose staged rows fit; the
    grid: one resident wave (3 single-row or 2 multi-row blocks per SM, fewer when shared memory runs
    out), two for a single row past 8 tiles a block."""
    assert [_tile(b, 896, 2) for b in (1, 2, 3, 4, 5, 8, 17, 64)] == [1, 4, 4, 4, 8, 8, 8, 8]
    assert _tile(8, 14336, 2) == 4 and _tile(8, 14336, 4) == 1  # 115 KB of bf16, or one fp32 row
    sm132 = SimpleNamespace(num_sms=132)
    assert _grid(sm132, 304, 1, 1792) == 304  # 896 -> 4864: one tile per block
    assert _grid(sm132, 3168, 1, 1792) == 396  # 8 tiles per block: one wave
    assert _grid(sm132, 4748, 1, 1792) == 792  # the LM head: two waves of 6 tiles a block, not one of 12
    assert _grid(sm132, 9496, 8, 8 * 1792) == 264  # batched: one wave
    assert _grid(sm132, 512, 4, 4 * 28672) == 264  # two blocks with 112 KB of staged input fit an SM
    assert _grid(sm132, 512, 1, 150 * 1024) == 132  # one with 150 KB


# ---- launchers: both devices -------------------------------------------------------------------
def run_gemv(dev, c, opt, **kw):
    """gemv on dev from case c with option set opt; returns (out, twin)."""
    ops = operands(c, opt)
    out_dt = ce.dtype(opt.get("out", ce.dtype(c["x"].dtype).name))
    t = tensors(dev, {"x": c["x"], "w": c["w"], **ops})
    out = ce.Tensor.empty(out_dt, (c["x"].shape[0], c["w"].shape[0]), dev, name="out")
    gemv(out, t["x"], t["w"], act=opt.get("act"), eps=EPS, **{k: t[k] for k in ops}, **kw)
    want = gemv_np(c["x"], c["w"], act=opt.get("act"), eps=EPS, out_dtype=out_dt.np, **ops)
    return out.numpy(), want


SHAPES = [(64, 200), (200, 64), (896, 4864), (4864, 896)]  # (K, N)


@pytest.mark.parametrize("wdtype", [None, "e4m3"])
@pytest.mark.parametrize("K,N", SHAPES)
@pytest.mark.parametrize("b", [1, 3, 8, 17, 64])
def test_gemv_shapes(dev, b, K, N, wdtype):
    if wdtype == "e4m3" and K % 16:
        pytest.skip("e4m3 rows need K % 16 == 0")
    if dev.is_cpu and K * N > 1e6 and (b, wdtype) != (1, None):
        pytest.skip("on cpu the launcher is the twin (checked against float64 above): large shapes once")
    got, want = run_gemv(dev, case(b, K, N, "bf16", wdtype, seed=b), {"residual": True})
    assert_close(got, want, "bf16", f"gemv b={b} K={K} N={N}")


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("wdtype", [None, "e4m3"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gemv_options(dev, dtype, wdtype, option):
    opt = OPTIONS[option]
    got, want = run_gemv(dev, case(17, 256, 200, dtype, wdtype, act=opt.get("act")), opt)
    # fp32: the device sums 256 products of order 1 in another order than the twin; near-cancelling
    # outputs then differ by a few 1e-5 in absolute terms (seen on the H200 with e4m3 weights)
    assert_close(got, want, dtype, option, scale=4.0 if dtype == "fp32" else 1.0)


@pytest.mark.parametrize("wdtype", [None, "e4m3"])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("b,K,H", [(1, 64, 96), (3, 896, 4864), (17, 128, 200), (64, 256, 64)])
def test_gemv_dual(dev, b, K, H, norm, wdtype):
    if dev.is_cpu and K * H > 1e6:
        pytest.skip("on cpu the launcher is the twin (checked against float64 above): small shapes only")
    c = case(b, K, 2 * H, "bf16", wdtype)
    t = tensors(dev, {k: c[k] for k in ("x", "w", "norm_weight", "w_scale") if k in c})
    out = ce.Tensor.empty(ce.BF16, (b, 2 * H), dev, name="out")
    nw = c["norm_weight"] if norm else None
    gemv_dual(out, t["x"], t["w"], w_scale=t.get("w_scale"), norm_weight=t["norm_weight"] if norm else None, eps=EPS)
    assert_close(out.numpy(), gemv_dual_np(c["x"], c["w"], c.get("w_scale"), nw, EPS), "bf16", "dual")
    assert_close(out.numpy(), ref64(c["x"], c["w"], c.get("w_scale"), norm_weight=nw), "bf16", "dual vs float64")
    act = ce.Tensor.empty(ce.BF16, (b, H), dev, name="act")
    gemv_dual(act, t["x"], t["w"], w_scale=t.get("w_scale"), norm_weight=t["norm_weight"] if norm else None, eps=EPS,
              act="swiglu")  # fmt: skip
    want = gemv_dual_np(c["x"], c["w"], c.get("w_scale"), nw, EPS, act="swiglu")
    assert_close(act.numpy(), want, "bf16", "dual swiglu")


def test_residual_may_be_out(dev):
    c = case(3, 64, 32, "bf16")
    t = tensors(dev, {"x": c["x"], "w": c["w"], "out": c["residual"]})
    gemv(t["out"], t["x"], t["w"], residual=t["out"])
    assert_close(t["out"].numpy(), gemv_np(c["x"], c["w"], residual=c["residual"]), "bf16", "in place")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_quantize_rows_launcher(dev, dtype):
    """Exact on both devices: the max is exact and the divisions are IEEE."""
    w = (_normal((37, 96), 9) * np.float32(2)).astype(ce.dtype(dtype).np)
    w[4] = 0
    t = tensors(dev, {"w": w})
    w8 = ce.Tensor.empty(ce.FP8_E4M3, (37, 96), dev, name="w8")
    s = ce.Tensor.empty(ce.FP32, (37,), dev, name="w_scale")
    quantize_rows(w8, s, t["w"])
    want8, want_s = quantize_rows_np(w)
    np.testing.assert_array_equal(s.numpy(), want_s)
    np.testing.assert_array_equal(w8.numpy().view(np.uint8), want8.view(np.uint8))


# ---- cuda only: against the cpu twin, and the fused prologues bit for bit ----------------------
@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", [None, "e4m3"])
def test_lm_head_check_op(wdtype):
    """The LM-head shape: 896 -> 151936 with fp32 logits, norm prologue, through check_op."""
    c = case(2, 896, 151936, "bf16", wdtype)
    ins = {k: c[k] for k in ("x", "w", "norm_weight", "w_scale") if k in c}
    check_op(gemv, ins, {"out": np.zeros((2, 151936), np.float32)}, compare={"out": ce.BF16}, eps=EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [1, 2, 4, 8])
def test_every_split_matches_the_twin(cuda, split):
    for wdtype in (None, "e4m3"):
        got, want = run_gemv(cuda, case(9, 4864, 96, "bf16", wdtype), {"bias": True}, split=split)
        assert_close(got, want, "bf16", f"split {split}")


@pytest.mark.gpu
def test_wide_tiles_keep_the_bits(cuda, monkeypatch):
    """The 0.5B gate/up GEMV (896 -> 2 x 4864, the norm prologue, [gate | up] and its SwiGLU) and the
    LM head (896 -> 151936 fp32) give the same bits from the _r4 kernels as from the two-row ones."""
    from cuengine.kernels import gemv as G

    c = case(1, 896, 9728, "bf16", "e4m3")
    head = case(1, 896, 151936, "bf16", "e4m3", seed=7)
    t = tensors(cuda, {k: c[k] for k in ("x", "w", "w_scale", "norm_weight")})
    th = tensors(cuda, {k: head[k] for k in ("w", "w_scale")})
    names = []
    launch = G.launch
    monkeypatch.setattr(G, "launch", lambda fam, name, *a, **kw: (names.append(name), launch(fam, name, *a, **kw)))
    got = {}
    for rows, wave in ((2, 10**9), (4, G._WAVE)):
        monkeypatch.setattr(G, "_WAVE", wave)
        pair = ce.Tensor.empty(ce.BF16, (1, 9728), cuda, name="pair")
        gemv_dual(pair, t["x"], t["w"], w_scale=t["w_scale"], norm_weight=t["norm_weight"], eps=EPS)
        act = ce.Tensor.empty(ce.BF16, (1, 4864), cuda, name="act")
        gemv_dual(act, t["x"], t["w"], w_scale=t["w_scale"], norm_weight=t["norm_weight"], eps=EPS, act="swiglu")
        logits = ce.Tensor.empty(ce.FP32, (1, 151936), cuda, name="logits")
        gemv(logits, t["x"], th["w"], w_scale=th["w_scale"], norm_weight=t["norm_weight"], eps=EPS)
        got[rows] = [pair.numpy().view(np.uint16), act.numpy().view(np.uint16), logits.numpy().view(np.uint32)]
    assert [n.endswith("_r4") for n in names] == [False] * 3 + [True] * 3, names
    for a, b in zip(got[2], got[4]):
        np.testing.assert_array_equal(a, b)
    want = gemv_dual_np(c["x"], c["w"], c["w_scale"], c["norm_weight"], EPS)
    assert_close(got[4][0].view(ml_dtypes.bfloat16), want, "bf16", "wide gate/up")


@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", [None, "e4m3"])
def test_deterministic_and_batch_invariant(cuda, wdtype):
    """Rows do not depend on b or on the run: row i of a b = 17 call equals a b = 1 call on row i."""
    c = case(17, 4864, 896, "bf16", wdtype)
    t = tensors(cuda, {k: c[k] for k in ("x", "w", "w_scale") if k in c})
    outs = []
    for _ in range(2):
        out = ce.Tensor.empty(ce.BF16, (17, 896), cuda, name="out")
        gemv(out, t["x"], t["w"], w_scale=t.get("w_scale"))
        outs.append(out.numpy().view(np.uint16))
    np.testing.assert_array_equal(outs[0], outs[1])
    one = ce.Tensor.empty(ce.BF16, (1, 896), cuda, name="one")
    for i in (0, 5, 16):
        gemv(one, t["x"].rows(i, i + 1), t["w"], w_scale=t.get("w_scale"))
        np.testing.assert_array_equal(one.numpy().view(np.uint16)[0], outs[0][i])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("b", [1, 5, 64])
def test_norm_prologue_equals_rmsnorm_forward_then_gemv(cuda, dtype, b):
    c = case(b, 896, 256, dtype)
    t = tensors(cuda, {k: c[k] for k in ("x", "w", "norm_weight")})
    fused = ce.Tensor.empty(dtype, (b, 256), cuda, name="fused")
    gemv(fused, t["x"], t["w"], norm_weight=t["norm_weight"], eps=EPS)
    xn = ce.Tensor.empty(dtype, (b, 896), cuda, name="xn")
    rmsnorm_forward(xn, ce.Tensor.empty(ce.FP32, (b,), cuda, name="rstd"), t["x"], t["norm_weight"], EPS)
    split = ce.Tensor.empty(dtype, (b, 256), cuda, name="split")
    gemv(split, xn, t["w"])
    np.testing.assert_array_equal(fused.numpy(), split.numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", [None, "e4m3"])
@pytest.mark.parametrize("b", [1, 5, 64])
def test_swiglu_prologue_equals_swiglu_forward_then_gemv(cuda, wdtype, b):
    """The fused and the split FFN arms give the same bits."""
    c = case(b, 4864, 128, "bf16", wdtype, act="swiglu")
    t = tensors(cuda, {k: c[k] for k in ("x", "w", "w_scale") if k in c})
    fused = ce.Tensor.empty(ce.BF16, (b, 128), cuda, name="fused")
    gemv(fused, t["x"], t["w"], w_scale=t.get("w_scale"), act="swiglu")
    h = ce.Tensor.empty(ce.BF16, (b, 4864), cuda, name="h")
    swiglu_forward(h, t["x"])
    split = ce.Tensor.empty(ce.BF16, (b, 128), cuda, name="split")
    gemv(split, h, t["w"], w_scale=t.get("w_scale"))
    np.testing.assert_array_equal(fused.numpy().view(np.uint16), split.numpy().view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", [None, "e4m3"])
@pytest.mark.parametrize("H", [128, 4864])  # K split in two (a sum of slices in shared memory) and not split
@pytest.mark.parametrize("b", [1, 5, 64])
def test_swiglu_epilogue_equals_dual_then_swiglu_forward(cuda, wdtype, H, b):
    """The "fused_up" arm's gate/up GEMV gives the bits of the "split" arm's two launches."""
    c = case(b, 896, 2 * H, "bf16", wdtype)
    t = tensors(cuda, {k: c[k] for k in ("x", "w", "w_scale", "norm_weight") if k in c})
    kw = dict(w_scale=t.get("w_scale"), norm_weight=t["norm_weight"], eps=EPS)
    fused = ce.Tensor.empty(ce.BF16, (b, H), cuda, name="fused")
    gemv_dual(fused, t["x"], t["w"], act="swiglu", **kw)
    pair = ce.Tensor.empty(ce.BF16, (b, 2 * H), cuda, name="pair")
    gemv_dual(pair, t["x"], t["w"], **kw)
    split = ce.Tensor.empty(ce.BF16, (b, H), cuda, name="split")
    swiglu_forward(split, pair)
    np.testing.assert_array_equal(fused.numpy().view(np.uint16), split.numpy().view(np.uint16))


@pytest.mark.gpu
def test_norm_prologue_unstaged_when_the_weight_does_not_fit(cuda):
    """K too large to stage the norm weight beside the input row: the prologue reads it from global
    memory instead, with the same bits as rmsnorm_forward then the GEMV."""
    K = 30720  # the fp32 row and its bf16 copy fit gemv._SMEM_ROW, the norm weight beside them does not
    c = case(1, K, 16, "bf16")
    t = tensors(cuda, {k: c[k] for k in ("x", "w", "norm_weight")})
    fused = ce.Tensor.empty(ce.BF16, (1, 16), cuda, name="fused")
    gemv(fused, t["x"], t["w"], norm_weight=t["norm_weight"], eps=EPS)
    xn = ce.Tensor.empty(ce.BF16, (1, K), cuda, name="xn")
    rmsnorm_forward(xn, ce.Tensor.empty(ce.FP32, (1,), cuda, name="rstd"), t["x"], t["norm_weight"], EPS)
    split = ce.Tensor.empty(ce.BF16, (1, 16), cuda, name="split")
    gemv(split, xn, t["w"])
    np.testing.assert_array_equal(fused.numpy().view(np.uint16), split.numpy().view(np.uint16))


@pytest.mark.gpu
def test_capturable_in_a_graph(cuda):
    """No allocation or host sync inside: a captured gemv_dual + fused-SwiGLU gemv replays to the eager bits."""
    c = case(3, 896, 2 * 256, "bf16", "e4m3")
    t = tensors(cuda, {k: c[k] for k in ("x", "w", "w_scale", "norm_weight")})
    down = case(3, 256, 896, "bf16", "e4m3", seed=5)
    td = tensors(cuda, {"w": down["w"], "w_scale": down["w_scale"], "res": c["x"]})
    up = ce.Tensor.empty(ce.BF16, (3, 512), cuda, name="up")

    def step():
        gemv_dual(up, t["x"], t["w"], w_scale=t["w_scale"], norm_weight=t["norm_weight"], eps=EPS)
        gemv(td["res"], up, td["w"], w_scale=td["w_scale"], act="swiglu", residual=td["res"])

    step()
    eager = td["res"].numpy()
    td["res"].copy_from_numpy(c["x"])
    graph = cuda.capture(step)
    graph.launch()
    np.testing.assert_array_equal(td["res"].numpy().view(np.uint16), eager.view(np.uint16))


def test_dependent_launch_can_be_switched_off(monkeypatch):
    """CUENGINE_DEPENDENT_LAUNCH=0 gives ordinary launches (checked before any GPU query)."""
    from cuengine.kernels import _build

    monkeypatch.setenv("CUENGINE_DEPENDENT_LAUNCH", "0")
    _build._dependent_launch_supported.cache_clear()
    try:
        assert _build._dependent_launch_supported(0) is False
    finally:
        _build._dependent_launch_supported.cache_clear()


def test_launch_packs_each_parameter_in_its_slot():
    """A launch hands cuLaunchKernelEx one 8-byte slot per parameter (pointer, int, float), each at
    the address the pointer array names; types it cannot pass are a clear error."""
    import struct

    from cuengine.kernels import _build

    class Kernel:  # stands in for a compiled function: only hashed here
        pass

    args = [np.uint64(0xDEADBEEF12), np.uint64(0), np.int32(-7), np.float32(1.5), np.int64(-(1 << 40))]
    struct.pack_into(_build._param_format(Kernel(), args), _build._slots.values, 0, *args)
    slots = _build._slots.values
    assert [int(p) - slots.ctypes.data for p in _build._slots.pointers[:5]] == [0, 8, 16, 24, 32]
    assert slots[0] == 0xDEADBEEF12 and slots[1] == 0
    assert slots[2:3].view(np.int32)[0] == -7 and slots[3:4].view(np.float32)[0] == 1.5
    assert slots[4:5].view(np.int64)[0] == -(1 << 40)
    with pytest.raises(TypeError, match="parameter types"):
        _build._param_format(Kernel(), [np.int16(1)])
    with pytest.raises(ValueError, match="at most 64 parameters, got 65"):
        _build._param_format(Kernel(), [np.int32(0)] * 65)


def test_launch_config_allows_overlap_only_for_dependent_launches():
    """Only a dependent launch's config carries programmatic stream serialization; each config is made once
    per launch shape and reused."""
    pytest.importorskip("cuda.bindings")
    from cuda.bindings import driver

    from cuengine.kernels import _build

    class Kernel:  # stands in for a compiled function: its handle is read, never launched
        kernel = type("Function", (), {"ptr": 0})

    fn = Kernel()
    plain, _ = _build._launch_config(fn, (3, 2), (128,), 0, 1024, False)
    dependent, _ = _build._launch_config(fn, (3, 2), (128,), 0, 1024, True)
    for config in (plain, dependent):
        assert (config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX) == (3, 2, 1, 128)
        assert config.sharedMemBytes == 1024
    assert plain.numAttrs == 0 and dependent.numAttrs == 1
    attr = dependent.attrs[0]
    assert attr.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1
    assert _build._launch_config(fn, (3, 2), (128,), 0, 1024, True)[0] is dependent


@pytest.mark.gpu
@pytest.mark.parametrize("captured", [False, True])
def test_dependent_launches_wait_for_their_predecessor(cuda, monkeypatch, captured):
    """GEMVs go out as programmatic dependent launches (their weight prefetch overlaps the previous
    kernel): a chain in which each reads the last one's output at once must still equal the twin's
    chain, eagerly and replayed from a graph. A kernel that read before griddepcontrol.wait would see
    the state of an earlier link."""
    from cuengine.kernels import _build

    calls = []
    real = _build._launch_packed
    monkeypatch.setattr(_build, "_launch_packed", lambda *a: (a[-1] and calls.append(a[1]), real(*a)))
    K, links = 896, 24
    c = case(1, K, K, "fp32")
    w = c["w"] * np.float32(0.5)
    t = tensors(cuda, {"w": w, "norm_weight": c["norm_weight"]})
    ys = [ce.Tensor.from_numpy(c["x"], cuda, name=f"y{i}") for i in range(2)]

    def chain():
        for i in range(links):  # y[next] = y[this] + W rmsnorm(y[this])
            src, dst = ys[i % 2], ys[(i + 1) % 2]
            gemv(dst, src, t["w"], residual=src, norm_weight=t["norm_weight"], eps=EPS)

    if captured:
        chain()  # compile outside the capture
        ys[0].copy_from_numpy(c["x"])
        cuda.capture(chain).launch()
    else:
        chain()
    y = c["x"]
    for _ in range(links):
        y = gemv_np(y, w, residual=y, norm_weight=c["norm_weight"], eps=EPS)
    assert len(calls) >= links, "the GEMVs did not go out as dependent launches"
    assert_close(ys[links % 2].numpy(), y, "fp32", "chained dependent GEMVs", scale=links)


@pytest.mark.gpu
def test_misaligned_device_pointer(cuda):
    x = ce.Tensor.empty(ce.BF16, (1, 72), cuda, name="x")
    bad = ce.Tensor(ce.BF16, (1, 64), cuda, x.storage, offset=2, name="x_off")
    w = ce.Tensor.empty(ce.BF16, (32, 64), cuda, name="w")
    with pytest.raises(ValueError, match="'x_off'.*not 16-byte aligned"):
        gemv(ce.Tensor.empty(ce.BF16, (1, 32), cuda, name="out"), bad, w)


# ---- the accumulator prologue (the "ksplit" decode arm) -------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("b", [1, 3])
def test_acc_prologue_is_the_gemv_of_the_summed_input(dev, b, dtype):
    """gemv(x, x_acc=acc) is gemv of x' = acc_input_np(x, acc), and x_out receives x' (both devices)."""
    K, N = 136 if dtype == "bf16" else 132, 40
    c = case(b, K, N, dtype)
    acc = np.zeros(acc_shape(b, K), np.int64)
    acc[:, :K] = np.rint(rng(4).normal(0, 2, (b, K)) * 2.0**ACC_SHIFT)
    xin = acc_input_np(c["x"], acc)
    t = tensors(dev, {"x": c["x"], "w": c["w"], "nw": c["norm_weight"], "bias": c["bias"], "acc": acc})
    out = ce.Tensor.empty(ce.dtype(dtype), (b, N), dev, name="out")
    x_out = ce.Tensor.empty(ce.dtype(dtype), (b, K), dev, name="x_out")
    gemv(out, t["x"], t["w"], bias=t["bias"], norm_weight=t["nw"], eps=EPS, x_acc=t["acc"], x_out=x_out)
    np.testing.assert_array_equal(x_out.numpy(), xin)
    want = gemv_np(xin, c["w"], bias=c["bias"], norm_weight=c["norm_weight"], eps=EPS)
    assert_close(out.numpy(), want, dtype, "gemv with x_acc")
    assert not np.allclose(want, gemv_np(c["x"], c["w"], bias=c["bias"], norm_weight=c["norm_weight"], eps=EPS))


# ---- errors ------------------------------------------------------------------------------------
def _t(dtype, shape, name="t"):
    return ce.Tensor.empty(dtype, shape, "cpu", name=name)


def _args(b=2, K=64, N=32, dtype="bf16", wdtype=None, out=None, **kw):
    a = {"out": _t(out or dtype, (b, N), "out"), "x": _t(dtype, (b, K), "x"), "w": _t(wdtype or dtype, (N, K), "w")}
    a.update(kw)
    return a


_SHARED = _t("bf16", (4, 64), "shared")
GEMV_ERRORS = {
    "fp16 x": (lambda: _args(dtype="fp16"), "gemv x: expected dtype fp32/bf16"),
    "3-d x": (lambda: _args() | {"x": _t("bf16", (1, 2, 64), "x")}, r"gemv x: expected shape \(\*, \*\)"),
    "unknown act": (lambda: _args(act="gelu"), "act='gelu' is not supported"),
    "norm with act": (lambda: _args(act="swiglu", norm_weight=_t("bf16", (32,))), "cannot be combined"),
    "odd swiglu width": (lambda: _args(K=63, act="swiglu"), r"\(b, 2K\) = \[gate \| up\]"),
    "weight dtype": (lambda: _args() | {"w": _t("fp32", (32, 64), "w")}, "gemv w: expected dtype bf16/e4m3"),
    "weight K": (lambda: _args() | {"w": _t("bf16", (32, 72), "w")}, r"gemv w: expected shape \(\*, 64\)"),
    "K alignment": (lambda: _args(K=60), "K = 60 must be a multiple of 8 for 16-byte bf16"),
    "e4m3 K alignment": (lambda: _args(K=72, wdtype="e4m3", w_scale=_t("fp32", (32,))), "multiple of 16"),
    "K = 0": (lambda: _args(K=0), "K = 0"),
    "K too large": (lambda: _args(K=1 << 17), "K = 131072 is too large"),
    "e4m3 without scale": (lambda: _args(wdtype="e4m3"), "needs its \\(32,\\) fp32 row scales"),
    "scale without e4m3": (lambda: _args(w_scale=_t("fp32", (32,))), "only e4m3 weights take row scales"),
    "scale shape": (lambda: _args(wdtype="e4m3", w_scale=_t("fp32", (31,))), r"w_scale: expected shape \(32\)"),
    "scale dtype": (lambda: _args(wdtype="e4m3", w_scale=_t("bf16", (32,))), "w_scale: expected dtype fp32"),
    "out dtype": (lambda: _args(out="fp16"), "gemv out: expected dtype bf16/fp32"),
    "out shape": (lambda: _args() | {"out": _t("bf16", (2, 31), "out")}, r"gemv out: expected shape \(2, 32\)"),
    "bias dtype": (lambda: _args(bias=_t("fp32", (32,))), "gemv bias: expected dtype bf16"),
    "bias shape": (lambda: _args(bias=_t("bf16", (64,))), r"gemv bias: expected shape \(32\)"),
    "residual dtype": (lambda: _args(out="fp32", residual=_t("bf16", (2, 32))), "residual: expected dtype fp32"),
    "residual shape": (lambda: _args(residual=_t("bf16", (1, 32))), r"residual: expected shape \(2, 32\)"),
    "norm shape": (lambda: _args(norm_weight=_t("bf16", (32,))), r"norm_weight: expected shape \(64\)"),
    "out overlaps x": (
        lambda: _args(N=64) | {"out": _SHARED.rows(0, 2), "x": _SHARED.rows(1, 3)},
        "overlaps input 'shared'",
    ),
    "residual partly overlaps out": (
        lambda: _args(N=64) | {"out": _SHARED.rows(0, 2), "residual": _SHARED.rows(1, 3)},
        "partly overlaps out",
    ),
    "split": (lambda: _args(split=3), "split=3"),
    "x_acc without norm": (lambda: _args(x_acc=_t("int64", (2, 66), "acc")), "x_acc: accumulator 'acc' is added in"),
    "x_acc shape": (
        lambda: _args(norm_weight=_t("bf16", (64,)), x_acc=_t("int64", (2, 64))),
        r"gemv x_acc: expected shape \(2, 66\)",
    ),
    "x_acc dtype": (
        lambda: _args(norm_weight=_t("bf16", (64,)), x_acc=_t("int32", (2, 66))),
        "gemv x_acc: expected dtype int64",
    ),
    "x_out without x_acc": (lambda: _args(x_out=_t("bf16", (2, 64), "xo")), "x_out: tensor 'xo' is written only"),
    "x_out shape": (
        lambda: _args(norm_weight=_t("bf16", (64,)), x_acc=_t("int64", (2, 66)), x_out=_t("bf16", (2, 32))),
        r"gemv x_out: expected shape \(2, 64\)",
    ),
    "x_out overlaps x": (
        lambda: (
            _args(N=64, norm_weight=_t("bf16", (64,)), x_acc=_t("int64", (2, 66)))
            | {"x": _SHARED.rows(0, 2), "x_out": _SHARED.rows(1, 3)}
        ),
        "x_out: tensor 'shared' overlaps 'shared'",
    ),
    "device": (lambda: _args() | {"w": ce.Tensor.empty("bf16", (32, 64), "cuda", name="w")}, "is on"),
}


@pytest.mark.parametrize("name", GEMV_ERRORS)
def test_gemv_errors(name):
    make, match = GEMV_ERRORS[name]
    if name == "device" and not ce.cuda_available():
        pytest.skip("needs a second device")
    kw = make()
    with pytest.raises(ValueError, match=match):
        gemv(kw.pop("out"), kw.pop("x"), kw.pop("w"), **kw)


def test_gemv_dual_errors():
    with pytest.raises(ValueError, match=r"gemv_dual w_up: expected \(2H, K\)"):
        gemv_dual(_t("bf16", (2, 31)), _t("bf16", (2, 64)), _t("bf16", (31, 64)))
    with pytest.raises(ValueError, match="gemv_dual w_scale: only e4m3"):
        gemv_dual(_t("bf16", (2, 32)), _t("bf16", (2, 64)), _t("bf16", (32, 64)), w_scale=_t("fp32", (32,)))
    with pytest.raises(ValueError, match=r"gemv_dual out: expected shape \(2, 16\)"):
        gemv_dual(_t("bf16", (2, 32)), _t("bf16", (2, 64)), _t("bf16", (32, 64)), act="swiglu")
    with pytest.raises(ValueError, match="gemv_dual out: expected dtype bf16"):
        gemv_dual(_t("fp32", (2, 16)), _t("bf16", (2, 64)), _t("bf16", (32, 64)), act="swiglu")
    with pytest.raises(ValueError, match="gemv_dual: act='gelu' is not supported"):
        gemv_dual(_t("bf16", (2, 16)), _t("bf16", (2, 64)), _t("bf16", (32, 64)), act="gelu")


@pytest.mark.parametrize(
    "w8,s,w,match",
    [
        (("e4m3", (4, 16)), ("fp32", (4,)), ("fp16", (4, 16)), "quantize_rows w: expected dtype fp32/bf16"),
        (("bf16", (4, 16)), ("fp32", (4,)), ("bf16", (4, 16)), "quantize_rows w8: expected dtype e4m3"),
        (("e4m3", (4, 8)), ("fp32", (4,)), ("bf16", (4, 16)), r"quantize_rows w8: expected shape \(4, 16\)"),
        (("e4m3", (4, 16)), ("fp32", (5,)), ("bf16", (4, 16)), r"quantize_rows w_scale: expected shape \(4\)"),
    ],
)
def test_quantize_rows_errors(w8, s, w, match):
    with pytest.raises(ValueError, match=match):
        quantize_rows(_t(*w8), _t(*s), _t(*w))


# ---- the kernels on the host (tests/kernel_emulator.py) ----------------------------------------
# gemv.cuh's weight loads, the dynamic shared memory, shuffles down a warp, the
# paired E4M3 -> half conversion (two of the emulator's exact decodes) and the MUFU exp and division (host
# expf and /), after the emulator's common.cuh.
_EMU_HELPERS = r"""
inline float __expf(float x) { return expf(x); }
inline float __fdividef(float a, float b) { return a / b; }
struct __half2_raw { unsigned short x, y; };
typedef unsigned short __nv_fp8x2_storage_t;
inline __half2_raw __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t v, __nv_fp8_interpretation_t k) {
    return {__half_as_ushort((half)fp8_decode(v & 0xff, k)), __half_as_ushort((half)fp8_decode(v >> 8, k))};
}
struct alignas(16) longlong2 { long long x, y; };
inline long long __float2ll_rn(float f) { return llrintf(f); }  // the host rounds half to even too
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { auto o = *p; *p += v; return o; }
inline unsigned long long atomicOr(unsigned long long* p, unsigned long long v) { auto o = *p; *p |= v; return o; }
inline float __shfl_down_sync(unsigned, float v, int d) {
    WarpX& w = warp_(); int l = lane_();
    w.f[l] = v; wbar(); float r = l + d < 32 ? w.f[l + d] : v; wbar(); return r;
}
"""
_EMU_REPLACE = {
    '#include "common.cuh"': '#include "common.cuh"' + _EMU_HELPERS,
    """    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));""": '    if ((uintptr_t)p % 16) fail("misaligned weight load");\n    memcpy(&v, p, 16);',
    "extern __shared__ __align__(16) unsigned char smem[];": "unsigned char* smem = g_smem;",
}
_EMU_KERNELS = [f"gemv_{s}_{bt}" for s in ("bf16_bf16_bf16", "bf16_e4m3_bf16") for bt in (1, 4, 8)]
_EMU_KERNELS.append("gemv_bf16_e4m3_bf16_1_r4")


@pytest.fixture(scope="module")
def gemv_emu(tmp_path_factory):
    """A `launch` running gemv.cu's kernels on the host, or a skip without g++."""
    work = tmp_path_factory.mktemp("gemv_emu")
    text = (emu.kernel_dir() / "gemv.cuh").read_text()
    for old, new in _EMU_REPLACE.items():
        assert old in text, f"gemv.cuh no longer has {old[:40]!r}: update the emulation"
        text = text.replace(old, new)
    (work / "gemv.cuh").write_text(text)
    return functools.partial(emu.launch, emu.or_skip(emu.build("gemv", _EMU_KERNELS, work)))


def _emulated(gemv_emu, monkeypatch, fn, arrays, out_shape):
    """Run fn(out, **tensors) through the emulated kernels; out as a NumPy array, and whether nothing was
    written outside out."""
    from cuengine.kernels import gemv as G

    monkeypatch.setattr(G, "launch", gemv_emu)
    t = {k: emu.tensor(v, v.dtype if v.dtype != E4M3 else "e4m3", k) for k, v in arrays.items()}
    out = emu.tensor(np.zeros(out_shape, ml_dtypes.bfloat16), "bf16", "out")
    fn(out, **t)
    return out.numpy(), emu.margins_ok(out)


def _identity(n):
    return np.eye(n, dtype=ml_dtypes.bfloat16)


@pytest.mark.parametrize("b", [1, 3, 9])  # one pass of BT = 1, one of BT = 4, two passes of BT = 8
def test_emulated_staging_is_exact(gemv_emu, monkeypatch, b):
    """Through an identity weight a GEMV returns its staged input, so the input's staging (through
    registers, and the norm weight into shared memory before the wait) shows bit for bit."""
    K = 136  # 17 vectors: a ragged last vector round over the block's threads
    c = case(b, K, K, "bf16")
    got, clean = _emulated(gemv_emu, monkeypatch, lambda out, x, w: gemv(out, x, w), {"x": c["x"], "w": _identity(K)},
                           (b, K))  # fmt: skip
    np.testing.assert_array_equal(got.view(np.uint16), c["x"].view(np.uint16))
    assert clean
    arrays = {"x": c["x"], "w": _identity(K), "nw": c["norm_weight"]}

    def normed(out, x, w, nw):
        gemv(out, x, w, norm_weight=nw, eps=EPS)

    staged, _ = _emulated(gemv_emu, monkeypatch, normed, arrays, (b, K))
    assert_close(staged, gemv_np(c["x"], _identity(K), norm_weight=c["norm_weight"], eps=EPS), "bf16", "norm")
    from cuengine.kernels import gemv as G

    # room for the input rows alone: the norm weight is read from global memory instead
    monkeypatch.setattr(G, "_SMEM_ROW", G._staged_bytes(G._tile(b, K, 2), K, 2, True))
    unstaged, _ = _emulated(gemv_emu, monkeypatch, normed, arrays, (b, K))
    np.testing.assert_array_equal(staged.view(np.uint16), unstaged.view(np.uint16))


@pytest.mark.parametrize("b", [1, 3, 9])
def test_emulated_acc_prologue_adds_before_the_norm(gemv_emu, monkeypatch, b):
    """With x_acc the prologue normalises x' = r(x + r(y)) (y the accumulator's values), bit for bit what
    it makes of x' itself (read back through an identity weight), and block 0 writes x' to x_out."""
    K = 136
    c = case(b, K, K, "bf16")
    acc = np.zeros(acc_shape(b, K), np.int64)
    acc[:, :K] = np.rint(rng(4).normal(0, 2, (b, K)) * 2.0**ACC_SHIFT)
    xin = acc_input_np(c["x"], acc)
    x_out = emu.tensor(np.zeros((b, K), ml_dtypes.bfloat16), "bf16", "x_out")

    def with_acc(out, x, w, nw, acc):
        gemv(out, x, w, norm_weight=nw, eps=EPS, x_acc=acc, x_out=x_out)

    def normed(out, x, w, nw):
        gemv(out, x, w, norm_weight=nw, eps=EPS)

    got, clean = _emulated(gemv_emu, monkeypatch, with_acc,
                           {"x": c["x"], "w": _identity(K), "nw": c["norm_weight"], "acc": acc}, (b, K))  # fmt: skip
    want, _ = _emulated(gemv_emu, monkeypatch, normed, {"x": xin, "w": _identity(K), "nw": c["norm_weight"]}, (b, K))
    assert clean and emu.margins_ok(x_out)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    np.testing.assert_array_equal(x_out.numpy().view(np.uint16), xin.view(np.uint16))


@pytest.mark.parametrize("wdtype", [None, "e4m3"])
# K = 512 splits K in two (the slices summed in shared memory, the finishers a block's first threads),
# K = 64 does not (the finishers are lanes of each warp); b = 5 and 9 take one and two passes of BT = 8
@pytest.mark.parametrize("b,K,H", [(1, 64, 40), (1, 512, 8), (5, 64, 24), (9, 512, 8)])
def test_emulated_swiglu_epilogue_equals_the_down_prologue(gemv_emu, monkeypatch, b, K, H, wdtype):
    """gemv_dual(act="swiglu") writes the values the down GEMV's SwiGLU prologue stages from [gate | up]
    (read back through an identity weight), bit for bit: the "fused_up" arm is the "fused" one."""
    assert _split(2 * H, K * (1 if wdtype else 2) // 16) == (2 if K == 512 and not wdtype else 1)
    c = case(b, K, 2 * H, "bf16", wdtype)
    arrays = {"x": c["x"], "w": c["w"]} | ({"s": c["w_scale"]} if wdtype else {})
    pair, clean = _emulated(gemv_emu, monkeypatch, lambda out, x, w, s=None: gemv_dual(out, x, w, w_scale=s), arrays,
                            (b, 2 * H))  # fmt: skip
    assert clean
    epilogue, clean = _emulated(gemv_emu, monkeypatch,
                                lambda out, x, w, s=None: gemv_dual(out, x, w, w_scale=s, act="swiglu"), arrays,
                                (b, H))  # fmt: skip
    assert clean
    prologue, _ = _emulated(gemv_emu, monkeypatch, lambda out, x, w: gemv(out, x, w, act="swiglu"),
                            {"x": pair, "w": _identity(H)}, (b, H))  # fmt: skip
    np.testing.assert_array_equal(epilogue.view(np.uint16), prologue.view(np.uint16))
    want = gemv_dual_np(c["x"], c["w"], c.get("w_scale"), act="swiglu")
    assert_close(epilogue, want, "bf16", "dual swiglu vs the twin")


# K = 1024 E4M3 splits K in two (S = 2: finishers after the slices' sum), K = 64 does not (S = 1: lanes)
@pytest.mark.parametrize("K", [64, 1024])
def test_emulated_wide_tiles_keep_the_bits(gemv_emu, monkeypatch, K):
    """The E4M3 _r4 kernels (four weight rows a warp, one vector a row in flight) give the bits of the
    two-row kernels, for the plain, dual and SwiGLU-epilogue GEMVs and every epilogue; a row count
    that is not a whole tile leaves a partial last tile."""
    from cuengine.kernels import gemv as G

    N = 2 * 27  # dual: 27 gate/up pairs
    assert _split(N, K // 16) == (2 if K == 1024 else 1)
    c = case(1, K, N, "bf16", "e4m3")
    arrays = {"x": c["x"], "w": c["w"], "b": c["bias"], "r": c["residual"], "nw": c["norm_weight"]}
    scale = {"w_scale": emu.tensor(c["w_scale"], "fp32", "w_scale")}
    calls = {
        "gemv": (lambda out, x, w, b, r, nw: gemv(out, x, w, bias=b, residual=r, norm_weight=nw, eps=EPS, **scale),
                 (1, N)),
        "dual": (lambda out, x, w, b, r, nw: gemv_dual(out, x, w, norm_weight=nw, eps=EPS, **scale), (1, N)),
        "dual swiglu": (lambda out, x, w, b, r, nw: gemv_dual(out, x, w, act="swiglu", **scale), (1, N // 2)),
    }  # fmt: skip
    w_scale = c["w_scale"]
    calls_np = {
        "gemv": lambda: gemv_np(c["x"], c["w"], w_scale, c["bias"], c["residual"], c["norm_weight"], EPS),
        "dual": lambda: gemv_dual_np(c["x"], c["w"], w_scale, c["norm_weight"], EPS),
        "dual swiglu": lambda: gemv_dual_np(c["x"], c["w"], w_scale, act="swiglu"),
    }
    names = []

    def recording(family, name, *args, **kw):
        names.append(name)
        gemv_emu(family, name, *args, **kw)

    for what, (fn, shape) in calls.items():
        got = {}
        for rows in (G._ROWS, G._WIDE_ROWS):  # the split (so the sum order) stays the shape's
            monkeypatch.setattr(G, "_rows", lambda *shape, rows=rows: rows)
            got[rows], clean = _emulated(recording, monkeypatch, fn, arrays, shape)
            assert clean
        assert names[-1].endswith("_1_r4") and not names[-2].endswith("_r4"), names[-2:]
        np.testing.assert_array_equal(got[2].view(np.uint16), got[4].view(np.uint16), err_msg=what)
        assert_close(got[4], calls_np[what](), "bf16", what)


def test_emulated_two_waves_keep_the_bits(gemv_emu, monkeypatch):
    """A single-row GEMV past _LONG_WAVE tiles a block launches two waves of blocks (the FP8 LM head's
    rule, gemv._grid): the bits of one wave, over every epilogue, with a partial last tile."""
    from cuengine.kernels import gemv as G

    K, N = 64, 1560  # 98 tiles of 16 rows: past 8 a block of the emulated device's one wave of 12
    c = case(1, K, N, "bf16")
    arrays = {"x": c["x"], "w": c["w"], "b": c["bias"], "r": c["residual"], "nw": c["norm_weight"]}
    grids = []

    def recording(family, name, grid, *args, **kw):
        grids.append(grid)
        gemv_emu(family, name, grid, *args, **kw)

    def call(out, x, w, b, r, nw):
        gemv(out, x, w, bias=b, residual=r, norm_weight=nw, eps=EPS)

    two, clean = _emulated(recording, monkeypatch, call, arrays, (1, N))
    assert clean
    monkeypatch.setattr(G, "_LONG_WAVE", 10**6)
    one, clean = _emulated(recording, monkeypatch, call, arrays, (1, N))
    assert clean and grids == [24, 12], grids
    np.testing.assert_array_equal(two.view(np.uint16), one.view(np.uint16))
    assert_close(two, gemv_np(c["x"], c["w"], None, c["bias"], c["residual"], c["norm_weight"], EPS), "bf16", "two")
