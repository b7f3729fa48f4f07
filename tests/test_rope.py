"""RoPE on packed qkv (HF rotate-half, GQA): table, twin against float64 and finite differences,
in place and out of place, and cpu vs cuda."""

import numpy as np
import pytest
from conftest import assert_close, check_op, finite_difference, rng, tensors

import cuengine as ce
from cuengine.kernels.rope import rope_backward, rope_forward, rope_freqs, rope_np


# ---- float64 reference, HF's formulation ------------------------------------------------------------
def hf_tables(T, hs, theta):
    """cos and sin (T, hs) as HF builds them: inv_freq from arange(0, hs, 2), then emb = cat(freqs, freqs)."""
    inv_freq = 1.0 / theta ** (np.arange(0, hs, 2, dtype=np.float64) / hs)
    emb = np.concatenate([np.outer(np.arange(T), inv_freq)] * 2, axis=1)
    return np.cos(emb), np.sin(emb)


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def ref64(qkv, hq, hkv, hs, theta):
    """q * cos + rotate_half(q) * sin on the q and k heads, in float64."""
    B, T = qkv.shape[:2]
    x = qkv.astype(np.float64).reshape(B, T, hq + 2 * hkv, hs)
    cos, sin = hf_tables(T, hs, theta)
    y = x.copy()
    qk = x[:, :, : hq + hkv]
    y[:, :, : hq + hkv] = qk * cos[None, :, None] + rotate_half(qk) * sin[None, :, None]
    return y.reshape(qkv.shape)


# ---- cpu: the table and the twin ---------------------------------------------------------------
@pytest.mark.parametrize("hs,theta", [(64, 1e6), (128, 1e4), (16, 500.0)])
def test_freqs_match_hf(hs, theta):
    table = rope_freqs(300, hs, theta)
    cos, sin = hf_tables(300, hs, theta)
    assert table.shape == (300, hs) and table.dtype == np.float32
    np.testing.assert_allclose(table[:, : hs // 2], cos[:, : hs // 2], atol=1e-7)
    np.testing.assert_allclose(table[:, hs // 2 :], sin[:, : hs // 2], atol=1e-7)
    half = rope_freqs(300, hs, theta, np.float16)
    assert half.dtype == np.float16
    np.testing.assert_allclose(half[:, hs // 2 :], sin[:, : hs // 2], atol=5e-4)  # fp16: 11-bit mantissa


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (3, 1)])
def test_twin_matches_hf_float64(dtype, hq, hkv):
    hs, theta, B, T = 32, 1e4, 2, 45
    x = rng(0).standard_normal((B, T, (hq + 2 * hkv) * hs)).astype(ce.dtype(dtype).np)
    y = rope_np(x, rope_freqs(64, hs, theta), hq, hkv)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, ref64(x, hq, hkv, hs, theta), dtype, "rope")
    v = slice((hq + hkv) * hs, None)
    np.testing.assert_array_equal(y[..., v], x[..., v])  # v heads untouched


def test_backward_twin_matches_finite_differences():
    """d/dx of sum(dout * rope(x)) by central differences of the float64 reference."""
    hq, hkv, hs, theta = 2, 1, 8, 100.0
    x = rng(1).standard_normal((2, 3, (hq + 2 * hkv) * hs))
    dout = rng(2).standard_normal(x.shape)
    dx = rope_np(dout.astype(np.float32), rope_freqs(3, hs, theta), hq, hkv, inverse=True)
    fd = finite_difference(lambda x64: np.sum(dout * ref64(x64, hq, hkv, hs, theta)), x)
    np.testing.assert_allclose(dx, fd, rtol=1e-4, atol=1e-5)


def test_backward_undoes_forward():
    freqs = rope_freqs(50, 64, 1e4)
    x = rng(3).standard_normal((2, 50, 8, 64)).astype(np.float32)
    back = rope_np(rope_np(x, freqs, 4, 2), freqs, 4, 2, inverse=True)
    np.testing.assert_allclose(back, x, rtol=1e-5, atol=1e-5)  # a rotation is orthogonal


# ---- launchers: both devices -------------------------------------------------------------------
@pytest.mark.parametrize("in_place", [False, True])
def test_launchers_and_abs_max(dev, in_place):
    hq, hkv, hs = 4, 2, 32
    freqs = rope_freqs(40, hs, 1e4)
    x = rng(4).standard_normal((3, 37, hq + 2 * hkv, hs)).astype(np.float32)
    x[0, 5, hq + hkv + 1, 3] = 50.0  # the largest value sits in a v head: abs_max must still see it
    t = tensors(dev, x=x, f=freqs, out=np.zeros_like(x), amax=np.zeros(1, np.float32))
    out = t["x"] if in_place else t["out"]
    rope_forward(out, t["x"], t["f"], hq, hkv, abs_max=t["amax"])
    want = rope_np(x, freqs, hq, hkv)
    assert_close(out.numpy(), want, "fp32", "rope_forward")
    assert t["amax"].numpy()[0] == 50.0
    t["amax"].fill_zero()
    rope_backward(out, out, t["f"], hq, hkv, abs_max=t["amax"])
    assert_close(out.numpy(), x, "fp32", "rope_backward undoes rope_forward")
    assert t["amax"].numpy()[0] == 50.0


def test_flat_heads_and_fp16_table(dev):
    hq, hkv, hs = 6, 2, 64
    freqs = rope_freqs(64, hs, 1e6, np.float16)
    x = rng(5).standard_normal((2, 19, (hq + 2 * hkv) * hs)).astype(ce.BF16.np)
    t = tensors(dev, x=x, f=freqs, out=np.zeros_like(x))
    rope_forward(t["out"], t["x"], t["f"], hq, hkv)
    assert_close(t["out"].numpy(), rope_np(x, freqs, hq, hkv), "bf16", "rope, fp16 table")


# ---- errors --------------------------------------------------------------------------------------
def _t(shape, dtype=np.float32):
    return ce.Tensor.from_numpy(np.zeros(shape, dtype), "cpu", name="t")


def _call(fn=rope_forward, out=(2, 4, 32), inp=(2, 4, 32), freqs=(16, 8), hq=2, hkv=1, out_dt=np.float32,
          freqs_dt=np.float32, abs_max=None):  # fmt: skip
    """One launcher call on zero tensors: defaults are valid (2 q, 1 kv heads of 8), overrides are not."""
    amax = None if abs_max is None else _t(abs_max)
    fn(_t(out, out_dt), _t(inp), _t(freqs, freqs_dt), hq, hkv, abs_max=amax)


@pytest.mark.parametrize(
    "over,match",
    [
        ({"out": (2, 4, 24)}, r"out: expected shape \(2, 4, 32\)"),
        ({"out": (2, 4, 40), "inp": (2, 4, 40)}, r"inp: expected shape \(B, T, 32\) or \(B, T, 4, 8\)"),
        ({"out": (8, 32), "inp": (8, 32)}, r"expected shape \(B, T, 32\)"),
        ({"out": (2, 4, 4, 8), "inp": (2, 4, 4, 8), "hq": 1}, r"\(B, T, 3, 8\)"),
        ({"out": (2, 20, 32), "inp": (2, 20, 32)}, "table has 16 positions"),
        ({"out": (2, 4, 24), "inp": (2, 4, 24), "freqs": (16, 6)}, "head size = 6 must be a multiple of 8"),
        ({"freqs_dt": ce.BF16.np}, "freqs: expected dtype fp32/fp16"),
        ({"hq": 0}, "must be positive"),
        ({"out_dt": ce.BF16.np}, "out: expected dtype fp32"),
        ({"fn": rope_backward, "abs_max": (2,)}, r"abs_max: expected shape \(1\)"),
        ({"fn": rope_backward, "out": (2, 4, 16)}, r"dinp: expected shape \(2, 4, 32\)"),
    ],
)
def test_errors(over, match):
    _call()  # the defaults are fine
    with pytest.raises(ValueError, match=match):
        _call(**over)


def test_partial_overlap_is_refused():
    buf = ce.Tensor.from_numpy(np.zeros((3, 4, 32), np.float32), "cpu", name="buf")
    with pytest.raises(ValueError, match="partly overlaps"):
        rope_forward(buf[1:], buf[:2], _t((16, 8)), 2, 1)


def test_freqs_errors():
    with pytest.raises(ValueError, match="head_size = 7 must be positive and even"):
        rope_freqs(10, 7, 1e4)


# ---- gpu: cuda against the twin ---------------------------------------------------------------
def check_rope(x, freqs, hq, hkv):
    """Forward out of place, then backward in place on x (as the seed does), cuda against the twin."""

    def fwd_bwd(out, amax, dx, bamax, x, freqs):
        rope_forward(out, x, freqs, hq, hkv, abs_max=amax)
        rope_backward(dx, x, freqs, hq, hkv, abs_max=bamax)

    zero = np.zeros(1, np.float32)
    dt = ce.dtype(x.dtype).name
    check_op(fwd_bwd, {"x": x, "freqs": freqs}, {"out": np.zeros_like(x), "amax": zero, "bamax": zero},
             inplace={"dx": "x"}, compare={"amax": dt, "bamax": dt})  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 37, 199, 760, 1128, 4096])  # B = 2: up to 8192 rows
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_matches_cpu(T, dtype):
    hq, hkv, hs = 14, 2, 64  # Qwen2.5-0.5B heads
    freqs = rope_freqs(4096, hs, 1e6, np.float16 if dtype == "bf16" else np.float32)
    check_rope(rng(T).standard_normal((2, T, (hq + 2 * hkv) * hs)).astype(ce.dtype(dtype).np), freqs, hq, hkv)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,table", [("bf16", np.float32), ("fp32", np.float16), ("fp16", np.float16)])
def test_cuda_other_tables_and_head_size(dtype, table):
    hq, hkv, hs = 12, 4, 128
    freqs = rope_freqs(300, hs, 1e4, table)
    check_rope(rng(7).standard_normal((3, 300, hq + 2 * hkv, hs)).astype(ce.dtype(dtype).np), freqs, hq, hkv)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,hs", [(3, 1, 96), (2, 1, 64), (5, 2, 32)])
def test_cuda_odd_head_counts(hq, hkv, hs):
    """The kernel takes heads in pairs: Hq + 2 Hkv odd leaves the last pair one head short, Hq + Hkv odd
    pairs a k head with a v head (copied out of place, left alone in place); hs = 96 gives 6 vectors a half."""
    freqs = rope_freqs(300, hs, 1e4, np.float16)
    check_rope(rng(hq + hs).standard_normal((2, 300, (hq + 2 * hkv) * hs)).astype(ce.BF16.np), freqs, hq, hkv)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,table", [("bf16", np.float16), ("fp32", np.float32)])
def test_cuda_unaligned_table_equals_aligned(cuda, dtype, table):
    """A table that is not 16-byte aligned is read element by element: the same bits as the vector reads,
    forward out of place and backward in place, with abs_max."""
    hq, hkv, hs = 6, 2, 64
    freqs = rope_freqs(200, hs, 1e4, table)
    x = rng(8).standard_normal((2, 200, (hq + 2 * hkv) * hs)).astype(ce.dtype(dtype).np)
    flat = ce.Tensor.from_numpy(np.concatenate([np.zeros(1, table), freqs.reshape(-1)]), cuda, name="flat")
    tables = {"aligned": ce.Tensor.from_numpy(freqs, cuda, name="freqs"), "unaligned": flat[1:].reshape(freqs.shape)}
    assert tables["aligned"].ptr % 16 == 0 and tables["unaligned"].ptr % 16 != 0
    got = {}
    for k, f in tables.items():
        t = tensors(cuda, x=x, out=np.zeros_like(x), amax=np.zeros(1, np.float32), bamax=np.zeros(1, np.float32))
        rope_forward(t["out"], t["x"], f, hq, hkv, abs_max=t["amax"])
        rope_backward(t["x"], t["x"], f, hq, hkv, abs_max=t["bamax"])
        got[k] = {n: v.numpy() for n, v in t.items()}
    for n in got["aligned"]:
        np.testing.assert_array_equal(got["unaligned"][n].view(np.uint8), got["aligned"][n].view(np.uint8), err_msg=n)
    assert_close(got["aligned"]["out"], rope_np(x, freqs, hq, hkv), dtype, "rope_forward")
