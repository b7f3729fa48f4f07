"""The one-launch decode MLP (kernels/decode_mlp.py) and the fixed-point accumulators it sums into
(kernels/gemv.py): the twin against float64 and against the two-GEMV arm, both devices against the
twin, the accumulator's rounding, flag and order, and every documented error."""

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, rng

import cuengine as ce
from cuengine.kernels import decode_mlp as dm
from cuengine.kernels import gemv as gv

EPS = 1e-6
BF = ml_dtypes.bfloat16


def case(C, H, dtype="bf16", fp8=False, seed=0):
    """x (1, C) and its norm weight, [gate | up] (2H, C) and down (C, H) scaled so outputs are O(1)."""
    r, np_dt = rng(seed), ce.dtype(dtype).np
    c = {
        "x": (r.normal(0, 1, (1, C)) * 1.5 + 0.25).astype(np_dt),
        "norm_weight": r.uniform(0.5, 1.5, C).astype(np_dt),
        "w_up": (r.normal(0, 1, (2 * H, C)) / np.sqrt(C)).astype(np_dt),
        "w_down": (r.normal(0, 1, (C, H)) / np.sqrt(H)).astype(np_dt),
    }
    if fp8:
        c["w_up"], c["up_scale"] = gv.quantize_rows_np(c["w_up"])
        c["w_down"], c["down_scale"] = gv.quantize_rows_np(c["w_down"])
    return c


def ref64(c, x=None):
    """x + the MLP of RMSNorm(x) in float64 from its definition (no intermediate rounding)."""
    x = (c["x"] if x is None else x).astype(np.float64)
    h = x / np.sqrt(np.mean(x**2, axis=1, keepdims=True) + EPS) * c["norm_weight"].astype(np.float64)
    wu, wd = c["w_up"].astype(np.float64), c["w_down"].astype(np.float64)
    if "up_scale" in c:
        wu, wd = wu * c["up_scale"][:, None], wd * c["down_scale"][:, None]
    g, u = np.split(h @ wu.T, 2, axis=1)
    return x + (g / (1 + np.exp(-g)) * u) @ wd.T


def scales(c):
    return {k: c[k] for k in ("up_scale", "down_scale") if k in c}


# ---- the accumulator ------------------------------------------------------------------------
def test_acc_fix_rounds_to_the_grid_and_flags_what_could_overflow():
    step = 2.0**-gv.ACC_SHIFT
    q, bad = gv.acc_fix_np(np.array([1.0, -2.5 * step, 1.5 * step, gv.ACC_LIMIT, np.inf, np.nan], np.float32))
    assert q.tolist() == [1 << gv.ACC_SHIFT, -2, 2, 0, 0, 0]  # half to even
    assert bad.tolist() == [False, False, False, True, True, True]
    acc = np.zeros(gv.acc_shape(2, 4), np.int64)
    acc[:, :4] = [[1 << gv.ACC_SHIFT, -3 << (gv.ACC_SHIFT - 1), 1, 0], [5, 6, 7, 8]]
    acc[1, 4] = 1  # the second row's flag
    y = gv.acc_values_np(acc)
    assert y[0].tolist() == [1.0, -1.5, np.float32(step), 0.0] and np.isnan(y[1]).all()


def test_acc_input_rounds_like_a_residual_epilogue():
    """x' = round(x + round(y)): 256 + 1.5 in bf16 is 256 + 2 rounded to 258 only through round(y) = 1.5
    exactly, and y = 1 + 2^-9 rounds to 1 first, so 256 + 1 stays 256 (one rounding of 257.002 gives 258)."""
    x = np.full((1, 2), 256, BF)
    acc = np.zeros(gv.acc_shape(1, 2), np.int64)
    acc[0, :2] = np.rint(np.array([1.5, 1 + 2.0**-9]) * 2.0**gv.ACC_SHIFT)
    assert gv.acc_input_np(x, acc).astype(np.float32).tolist() == [[258.0, 256.0]]


# ---- the twin ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_twin_matches_float64(dtype, fp8):
    c = case(64, 96, dtype, fp8)
    delta, xin = dm.decode_mlp_np(c["x"], c["norm_weight"], c["w_up"], c["w_down"], EPS, **scales(c))
    assert np.array_equal(xin, c["x"]) and delta[0, 64] == 0
    got = gv.acc_values_np(delta) + c["x"].astype(np.float32)
    assert_close(got, ref64(c), dtype, "x + mlp(x)", scale=np.abs(ref64(c)).max())


@pytest.mark.parametrize("fp8", [False, True])
def test_twin_is_the_two_gemv_arm_to_rounding(fp8):
    """The fused_up arm (gate/up GEMV with SiLU·mul, then the down GEMV with the residual) computes the same
    rounded values; only the down projection's sum differs (per-chunk fixed-point partials)."""
    c = case(128, 256, "bf16", fp8)
    delta, _ = dm.decode_mlp_np(c["x"], c["norm_weight"], c["w_up"], c["w_down"], EPS, **scales(c))
    act = gv.gemv_dual_np(c["x"], c["w_up"], c.get("up_scale"), norm_weight=c["norm_weight"], eps=EPS, act="swiglu")
    want = gv.gemv_np(act, c["w_down"], c.get("down_scale"), residual=c["x"])
    got = gv.acc_input_np(c["x"], delta)
    diff = np.abs(got.astype(np.float32) - want.astype(np.float32))
    ulp = np.abs(want.astype(np.float32)) * 2.0**-7
    assert (diff <= ulp).all() and (diff == 0).mean() > 0.9


def test_twin_adds_the_input_accumulator_first():
    c = case(64, 96, "fp32")
    acc = np.zeros(gv.acc_shape(1, 64), np.int64)
    acc[0, :64] = np.rint(rng(5).normal(0, 1, 64) * 2.0**gv.ACC_SHIFT)
    delta, xin = dm.decode_mlp_np(c["x"], c["norm_weight"], c["w_up"], c["w_down"], EPS, x_acc=acc)
    np.testing.assert_array_equal(xin, gv.acc_input_np(c["x"], acc))
    assert_close(gv.acc_values_np(delta) + xin, ref64(c, xin), "fp32", scale=4)


# ---- both devices against the twin --------------------------------------------------------------
def _tensors(dev, arrays):
    return {k: ce.Tensor.from_numpy(v, dev, name=k) for k, v in arrays.items()}


# (C, H): one chunk a block; the 0.5B shape (several chunks a block past the ring's stages, so stages are
# refilled); a grid smaller than the GPU (3 chunks); E4M3's 16-unit chunks
SHAPES = [(64, 96), (896, 4864), (256, 24), (128, 2048)]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("C,H", SHAPES)
def test_device_matches_twin(dev, C, H, dtype, fp8):
    if fp8 and H % 16:
        pytest.skip("E4M3 chunks are 16 hidden units")
    c = case(C, H, dtype, fp8)
    a_in = np.zeros(gv.acc_shape(1, C), np.int64)
    a_in[0, :C] = np.rint(rng(9).normal(0, 0.5, C) * 2.0**gv.ACC_SHIFT)
    t = _tensors(dev, {**c, "x_acc": a_in})
    start = np.rint(rng(8).normal(0, 1, gv.acc_shape(1, C)) * 2.0**gv.ACC_SHIFT).astype(np.int64)
    start[0, C:] = 0
    acc = ce.Tensor.from_numpy(start, dev, name="acc")
    x_out = ce.Tensor.from_numpy(np.zeros((1, C), c["x"].dtype), dev, name="x_out")
    dm.decode_mlp(acc, t["x"], t["norm_weight"], t["w_up"], t["w_down"], eps=EPS, up_scale=t.get("up_scale"),
                  down_scale=t.get("down_scale"), x_acc=t["x_acc"], x_out=x_out)  # fmt: skip
    delta, xin = dm.decode_mlp_np(c["x"], c["norm_weight"], c["w_up"], c["w_down"], EPS, x_acc=a_in, **scales(c))
    np.testing.assert_array_equal(x_out.numpy(), xin)
    got = gv.acc_values_np(acc.numpy()) - gv.acc_values_np(start)  # += onto what was there
    want = gv.acc_values_np(delta)
    assert acc.numpy()[0, C] == 0
    assert_close(got, want, dtype, f"decode_mlp {C}x{H}", scale=np.abs(want).max())


@pytest.mark.gpu
def test_device_sums_are_deterministic(cuda):
    """Integer atomics: the same inputs give the same bits whatever order the blocks finish in."""
    c = case(896, 4864, "bf16")
    t = _tensors(cuda, c)
    runs = []
    for _ in range(3):
        acc = ce.Tensor.from_numpy(np.zeros(gv.acc_shape(1, 896), np.int64), cuda, name="acc")
        dm.decode_mlp(acc, t["x"], t["norm_weight"], t["w_up"], t["w_down"], eps=EPS)
        runs.append(acc.numpy())
    assert np.array_equal(runs[0], runs[1]) and np.array_equal(runs[0], runs[2])


def test_a_partial_past_the_limit_flags_the_row(dev):
    """A down weight of 1e30 makes a chunk's partial overflow the fixed point: the row reads NaN, on both
    devices, and the next GEMV's prologue turns the residual into NaN rather than a wrapped number."""
    c = case(64, 96, "fp32")
    c["w_down"][3, 10] = 1e30
    t = _tensors(dev, c)
    acc = ce.Tensor.from_numpy(np.zeros(gv.acc_shape(1, 64), np.int64), dev, name="acc")
    dm.decode_mlp(acc, t["x"], t["norm_weight"], t["w_up"], t["w_down"], eps=EPS)
    assert acc.numpy()[0, 64] != 0 and np.isnan(gv.acc_values_np(acc.numpy())).all()
    out = ce.Tensor.empty(ce.FP32, (1, 8), dev, name="out")
    w = ce.Tensor.from_numpy(np.ones((8, 64), np.float32), dev, name="w")
    gv.gemv(out, t["x"], w, norm_weight=t["norm_weight"], x_acc=acc)
    assert np.isnan(out.numpy()).all()


# ---- errors -----------------------------------------------------------------------------------
def _call(dev=None, C=64, H=96, dtype="bf16", **change):
    dev = dev or ce.device("cpu")
    c = case(C, H, dtype)
    t = _tensors(dev, c)
    kw = {
        "acc": ce.Tensor.from_numpy(np.zeros(gv.acc_shape(1, C), np.int64), dev, name="acc"),
        "x": t["x"],
        "norm_weight": t["norm_weight"],
        "w_up": t["w_up"],
        "w_down": t["w_down"],
    }
    kw.update(change)
    dm.decode_mlp(kw.pop("acc"), kw.pop("x"), kw.pop("norm_weight"), kw.pop("w_up"), kw.pop("w_down"), **kw)


def _t(shape, dtype="bf16", name="t"):
    return ce.Tensor.from_numpy(np.zeros(shape, ce.dtype(dtype).np), "cpu", name=name)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"x": _t((2, 64))}, r"decode_mlp x: expected shape \(1, \*\)"),
        ({"x": _t((1, 64), "e4m3")}, "decode_mlp x: expected dtype fp32/bf16"),
        ({"norm_weight": _t((32,))}, r"decode_mlp norm_weight: expected shape \(64\)"),
        ({"w_up": _t((191, 64))}, r"w_up: expected \(2H, 64\)"),
        ({"w_down": _t((64, 95))}, r"decode_mlp w_down: expected shape \(64, 96\)"),
        ({"w_down": _t((64, 96), "fp32")}, "decode_mlp w_down: expected dtype bf16"),
        ({"w_up": _t((192, 64), "e4m3"), "w_down": _t((64, 96), "e4m3")}, "up_scale: e4m3 weight 't' needs"),
        ({"up_scale": _t((192,), "fp32")}, "up_scale: only e4m3 weights take row scales"),
        ({"acc": _t((1, 64), "int64")}, r"decode_mlp acc: expected shape \(1, 66\)"),
        ({"acc": _t((1, 66), "int32")}, "decode_mlp acc: expected dtype int64"),
        ({"x_acc": _t((1, 65), "int64")}, r"decode_mlp x_acc: expected shape \(1, 66\)"),
        ({"x_out": _t((1, 64))}, "x_out: tensor 't' is written only with x_acc"),
    ],
)
def test_errors(change, match):
    with pytest.raises(ValueError, match=match):
        _call(**change)


def test_unsupported_shapes_say_why():
    with pytest.raises(ValueError, match="intermediate size 100 must be a multiple of 8"):
        _call(H=100)
    with pytest.raises(ValueError, match="hidden size 4096 is past decode_mlp's 2048"):
        _call(C=4096, H=8)
    assert "must be a multiple of 16" in dm.unsupported(64, 24, ce.BF16, ce.FP8_E4M3)
    assert "hidden size 2048 is past decode_mlp's 1024" in dm.unsupported(2048, 64, ce.FP32, ce.FP32)
    assert "runs fp32/bf16 rows over model-dtype or e4m3 weights" in dm.unsupported(64, 96, ce.BF16, ce.FP32)
    assert dm.unsupported(896, 4864, ce.BF16, ce.FP8_E4M3) is None


def test_outputs_may_not_overlap_inputs():
    x = _t((1, 66), "int64", name="both")
    with pytest.raises(ValueError, match="decode_mlp: tensor 'both' overlaps 'both'"):
        _call(acc=x, x_acc=x)
    a_in = _t((1, 66), "int64", name="a_in")
    c = case(64, 96)
    x_bf = ce.Tensor.from_numpy(c["x"], "cpu", name="x")
    with pytest.raises(ValueError, match="decode_mlp: tensor 'x' overlaps 'x'"):
        _call(x=x_bf, x_acc=a_in, x_out=x_bf)


# ---- the kernel on the host (tests/kernel_emulator.py) ----------------------------------------
# decode_mlp.cu with a host stand-in for ring.cuh: copies land at issue (so a stage refilled while a warp
# still reads it, or a chunk read from the wrong stage, shows), and each mbarrier word holds the expected
# count, the arrivals of the current phase and the phases completed, which stage_wait's parity reads; gemv.cuh
# as test_gemv.py emulates it. Checked: the chunk ranges, ring slots and parities, the staging, the products,
# the SiLU·mul, the down partials and their fixed-point sum; not the hardware's asynchrony.
_EMU_RING = r"""
#pragma once
struct MbWord { unsigned short count, arrived; unsigned phases; };
inline MbWord& mb_(unsigned long long* full) { return *reinterpret_cast<MbWord*>(full); }
inline void ring_init(unsigned long long* full, int stages, unsigned count) {
    for (int s = 0; s < stages; ++s) mb_(full + s) = {(unsigned short)count, 0, 0};
}
inline void mb_arrive(unsigned long long* full) {
    MbWord& w = mb_(full);
    if (++w.arrived == w.count) { w.arrived = 0; w.phases++; }
    g_progress++;
}
inline void ring_expect(unsigned long long* full, unsigned) { mb_arrive(full); }
inline void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long*) {
    if ((uintptr_t)dst % 16 || (uintptr_t)src % 16 || bytes % 16) fail("misaligned bulk copy");
    memcpy(dst, src, bytes);
}
inline void copy16(void* dst, const void* src) {
    if ((uintptr_t)dst % 16 || (uintptr_t)src % 16) fail("misaligned cp.async");
    memcpy(dst, src, 16);
}
inline void ring_arrive(unsigned long long* full) { mb_arrive(full); }
inline void stage_wait(unsigned long long* full, unsigned parity) {
    while ((mb_(full).phases & 1u) == parity) yield_();
}
"""
# the emulated variants, under C names the emulator's kernel table can hold
_EMU_VARIANTS = {
    "decode_mlp<__nv_bfloat16, __nv_bfloat16, 1>": "decode_mlp_bf16_bf16_1",
    "decode_mlp<__nv_bfloat16, __nv_bfloat16, 4>": "decode_mlp_bf16_bf16_4",
    "decode_mlp<__nv_bfloat16, __nv_fp8_e4m3, 1>": "decode_mlp_bf16_e4m3_1",
}


@pytest.fixture(scope="module")
def mlp_emu(tmp_path_factory):
    """A `launch` running decode_mlp.cu's kernel on the host, or a skip without g++."""
    import functools
    from pathlib import Path

    import kernel_emulator as emu
    import test_gemv

    work = tmp_path_factory.mktemp("decode_mlp_emu")
    gemv_cuh = (emu.kernel_dir() / "gemv.cuh").read_text()
    for old, new in test_gemv._EMU_REPLACE.items():
        gemv_cuh = gemv_cuh.replace(old, new)
    (work / "gemv.cuh").write_text(gemv_cuh)
    (work / "ring.cuh").write_text(_EMU_RING)
    src = (emu.kernel_dir() / "decode_mlp.cu").read_text()
    src = src.replace("extern __shared__ __align__(128) unsigned char smem[];", "unsigned char* smem = g_smem;")
    src += "".join(f"\nauto {c} = &{n.replace('<', '<', 1)};" for n, c in _EMU_VARIANTS.items())
    kernel_dir = work / "src"
    kernel_dir.mkdir()
    (kernel_dir / "decode_mlp.cu").write_text(src)
    original = emu.kernel_dir
    emu.kernel_dir = lambda: Path(kernel_dir)
    try:
        lib = emu.build("decode_mlp", list(_EMU_VARIANTS.values()), work)
    finally:
        emu.kernel_dir = original
    run = emu.launch if lib is None else functools.partial(emu.launch, emu.or_skip(lib))

    def launch(family, name, *args, **kw):
        return run(family, _EMU_VARIANTS[name], *args, **kw)

    return launch if lib is not None else emu.or_skip(None)


@pytest.mark.parametrize("early", [0, 1, dm.EARLY_STAGES])  # ring stages filled before the wait
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("C,H", [(64, 96), (64, 2048), (128, 4096)])  # 3 chunks a block; ring refills; 8 chunks
def test_emulated_kernel_matches_twin(mlp_emu, monkeypatch, C, H, fp8, early):
    import kernel_emulator as emu

    monkeypatch.setattr(dm, "launch", mlp_emu)
    monkeypatch.setattr(dm, "EARLY_STAGES", early)
    monkeypatch.setattr(dm, "SMEM_BUDGET", 3 * dm._stage_bytes(C, H, ce.FP8_E4M3 if fp8 else ce.BF16) + 4096)
    c = case(C, H, "bf16", fp8)
    a_in = np.zeros(gv.acc_shape(1, C), np.int64)
    a_in[0, :C] = np.rint(rng(9).normal(0, 0.5, C) * 2.0**gv.ACC_SHIFT)
    t = {k: emu.tensor(v, "e4m3" if v.dtype == ml_dtypes.float8_e4m3fn else v.dtype, k) for k, v in c.items()}
    acc = emu.tensor(np.zeros(gv.acc_shape(1, C), np.int64), "int64", "acc")
    x_acc = emu.tensor(a_in, "int64", "x_acc")
    x_out = emu.tensor(np.zeros((1, C), BF), "bf16", "x_out")
    dm.decode_mlp(acc, t["x"], t["norm_weight"], t["w_up"], t["w_down"], eps=EPS, up_scale=t.get("up_scale"),
                  down_scale=t.get("down_scale"), x_acc=x_acc, x_out=x_out)  # fmt: skip
    delta, xin = dm.decode_mlp_np(c["x"], c["norm_weight"], c["w_up"], c["w_down"], EPS, x_acc=a_in, **scales(c))
    assert emu.margins_ok(acc) and emu.margins_ok(x_out)
    np.testing.assert_array_equal(x_out.numpy(), xin)
    want = gv.acc_values_np(delta)
    assert_close(gv.acc_values_np(acc.numpy()), want, "bf16", "emulated decode_mlp", scale=np.abs(want).max())
