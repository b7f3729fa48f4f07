"""FP8 family: abs-max, quantise (plain and transposed, both at once, over a table), transpose, bias gradient."""

import math

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, check_op, rng

import cuengine as ce
from cuengine.kernels import fp8
from cuengine.tensor import stats_values

FP8 = ["e4m3", "e5m2"]
_BITS = {1: np.uint8, 2: np.uint16}


def nearest_fp8_codes(y, fp8_name):
    """Independent SATFINITE RNE: clamp in float64, then pick the nearest finite fp8 value by
    searching the table of all 256 codes (ties go to the even code)."""
    dt = ce.dtype(fp8_name)
    codes = np.arange(256, dtype=np.uint8)
    vals = codes.view(dt.np).astype(np.float64)
    ok = np.isfinite(vals) & ~((vals == 0) & (codes == 0x80))  # one zero (+0) per magnitude
    vals, codes = vals[ok], codes[ok]
    order = np.argsort(vals, kind="stable")
    vals, codes = vals[order], codes[order]
    y = np.clip(np.asarray(y, np.float64), -dt.fp8_max, dt.fp8_max).reshape(-1)
    hi = np.clip(np.searchsorted(vals, y), 1, len(vals) - 1)
    lo = hi - 1
    d_lo, d_hi = y - vals[lo], vals[hi] - y
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    out = np.where(pick_hi, codes[hi], codes[lo])
    value = np.where(pick_hi, vals[hi], vals[lo])
    out = np.where(value == 0, np.where(np.signbit(y), 0x80, 0), out)  # a zero keeps the sign of y
    return out.astype(np.uint8)


def fp8_close(actual, expected):
    """Equal codes, or adjacent ones (one fp8 ulp) of the same sign."""
    a = np.asarray(actual).view(np.uint8).astype(np.int32)
    e = np.asarray(expected).view(np.uint8).astype(np.int32)
    same_sign = (a & 0x80) == (e & 0x80)
    assert np.all(same_sign & (np.abs((a & 0x7F) - (e & 0x7F)) <= 1)), "fp8 values differ by more than one ulp"


def data(shape, dtype="fp32", seed=0, scale=3.0):
    return (rng(seed).standard_normal(shape) * scale).astype(ce.dtype(dtype).np)


# ---- cpu: twins against independent references ------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_abs_max_accumulates(dtype):
    cpu = ce.device("cpu")
    x = data((37, 29), dtype)
    expect = np.abs(x.astype(np.float64)).max()
    amax = ce.Tensor.from_numpy(np.zeros(1, np.float32), cpu)
    fp8.abs_max(amax, ce.Tensor.from_numpy(x, cpu))
    assert amax.numpy()[0] == np.float32(expect)
    amax.copy_from_numpy(np.array([1e6], np.float32))  # a larger value already there stays
    fp8.abs_max(amax, ce.Tensor.from_numpy(x, cpu))
    assert amax.numpy()[0] == np.float32(1e6)


def test_abs_max_reports_nan():
    cpu = ce.device("cpu")
    x = data((100,))
    x[17] = np.nan
    amax = ce.Tensor.from_numpy(np.zeros(1, np.float32), cpu)
    fp8.abs_max(amax, ce.Tensor.from_numpy(x, cpu))
    assert np.isnan(amax.numpy()[0])


@pytest.mark.parametrize("fp8_name", FP8)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("amax_factor", [1.0, 0.5, 0.0])
def test_quantize_matches_independent_rounding(fp8_name, dtype, amax_factor):
    """amax_factor 0.5 forces saturation; 0 gives unit scales."""
    cpu = ce.device("cpu")
    x = data((37, 41), dtype, seed=2)
    x[0, :4] = [0, -0.0, 1e-30, -1e-30]
    amax = np.float32(np.abs(x.astype(np.float32)).max() * amax_factor)
    out = ce.Tensor.empty(fp8_name, (37, 41), cpu, name="q")
    out.abs_max.copy_from_numpy(np.array([amax], np.float32))
    fp8.quantize_with_abs_max(out, ce.Tensor.from_numpy(x, cpu))
    _, scale, scale_inv = stats_values(float(amax), ce.dtype(fp8_name))
    np.testing.assert_array_equal(out.fp8_stats(), np.array([amax, scale, scale_inv], np.float32))
    y = x.astype(np.float32) * np.float32(scale)  # the fp32 product is the rounding point
    np.testing.assert_array_equal(out.numpy().view(np.uint8).reshape(-1), nearest_fp8_codes(y, fp8_name))


def test_quantize_reads_a_given_slot_and_records_it():
    cpu = ce.device("cpu")
    x = data((8, 16), "bf16")
    slot = ce.Tensor.from_numpy(np.array([7.0], np.float32), cpu, name="slot")
    out = ce.Tensor.empty("e4m3", (8, 16), cpu, name="q")
    fp8.quantize_with_abs_max(out, ce.Tensor.from_numpy(x, cpu), abs_max=slot)
    np.testing.assert_array_equal(out.fp8_stats(), np.array(stats_values(7.0, ce.FP8_E4M3), np.float32))
    ref = np.clip(x.astype(np.float32) * np.float32(448 / np.float32(7)), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(out.numpy().view(np.uint8), ref.view(np.uint8))


@pytest.mark.parametrize("fp8_name", FP8)
@pytest.mark.parametrize("shape", [(1, 8), (37, 24), (3, 5, 40)])
def test_quantize_and_transpose_is_transposed_quantize(fp8_name, shape):
    cpu = ce.device("cpu")
    x = data(shape, "bf16", seed=4)
    c = shape[-1]
    n = x.size // c
    plain = ce.Tensor.empty(fp8_name, shape, cpu)
    tq = ce.Tensor.empty(fp8_name, (c, n), cpu)
    for t in (plain, tq):
        t.abs_max.copy_from_numpy(np.array([2.5], np.float32))  # below max|x|: saturation too
    fp8.quantize_with_abs_max(plain, ce.Tensor.from_numpy(x, cpu))
    fp8.quantize_and_transpose(tq, ce.Tensor.from_numpy(x, cpu))
    np.testing.assert_array_equal(tq.numpy().view(np.uint8), plain.numpy().reshape(n, c).T.view(np.uint8))
    np.testing.assert_array_equal(tq.fp8_stats(), plain.fp8_stats())


@pytest.mark.parametrize("fp8_name", FP8)
@pytest.mark.parametrize("shape", [(1, 8), (37, 24), (3, 5, 40)])
@pytest.mark.parametrize("shared", [True, False])
def test_quantize_dual_is_quantize_then_transpose(fp8_name, shape, shared):
    cpu = ce.device("cpu")
    x = ce.Tensor.from_numpy(data(shape, "bf16", seed=9), cpu)
    c = shape[-1]
    n = x.nelem // c
    plain, plain_t = ce.Tensor.empty(fp8_name, shape, cpu), ce.Tensor.empty(fp8_name, (c, n), cpu)
    plain.abs_max.copy_from_numpy(np.array([2.5], np.float32))  # below max|x|: saturation too
    fp8.quantize_with_abs_max(plain, x)
    fp8.transpose(plain_t, plain)
    out = ce.Tensor.empty(fp8_name, shape, cpu, name="q")
    out_tp = ce.Tensor.empty(fp8_name, (c, n), cpu, name="qt")
    if shared:
        out_tp = out_tp.with_stats(out.stats)
    out.abs_max.copy_from_numpy(np.array([2.5], np.float32))
    fp8.quantize_dual(out, out_tp, x)
    np.testing.assert_array_equal(out.numpy().view(np.uint8), plain.numpy().view(np.uint8))
    np.testing.assert_array_equal(out_tp.numpy().view(np.uint8), plain_t.numpy().view(np.uint8))
    np.testing.assert_array_equal(out.fp8_stats(), plain.fp8_stats())
    np.testing.assert_array_equal(out_tp.fp8_stats(), plain.fp8_stats())


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "e4m3", "e5m2", "byte"])
@pytest.mark.parametrize("shape", [(1, 1), (37, 5), (4, 3, 7)])
def test_transpose_moves_bits(dtype, shape):
    cpu = ce.device("cpu")
    dt = ce.dtype(dtype)
    bits = rng(5).integers(0, 256**dt.itemsize, shape).astype(_BITS[dt.itemsize])  # NaN payloads included
    inp = ce.Tensor.from_numpy(bits.view(dt.np), cpu, name="inp")
    c = shape[-1]
    out = ce.Tensor.empty(dt, (c, bits.size // c), cpu, name="out")
    fp8.transpose(out, inp)
    np.testing.assert_array_equal(out.numpy().view(bits.dtype), bits.reshape(-1, c).T)


@pytest.mark.parametrize("dbias_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("dout_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 7), (37, 40), (300, 3, 24)])
def test_bias_backward_accumulates_column_sums(dbias_dtype, dout_dtype, shape):
    cpu = ce.device("cpu")
    oc = shape[-1]
    dout = data(shape, dout_dtype, seed=6, scale=1.0)
    dbias0 = data((oc,), dbias_dtype, seed=7, scale=1.0)
    n = dout.size // oc
    scratch = ce.Tensor.empty(ce.FP32, fp8.bias_backward_scratch_shape(n, oc), cpu)
    dbias = ce.Tensor.from_numpy(dbias0, cpu, name="dbias")
    fp8.bias_backward(dbias, ce.Tensor.from_numpy(dout, cpu), scratch)
    expect = dbias0.astype(np.float64) + dout.astype(np.float64).reshape(n, oc).sum(axis=0)
    assert_close(dbias.numpy(), expect, dbias_dtype, "dbias", scale=math.sqrt(n))


def test_bias_backward_scratch_shape():
    assert fp8.bias_backward_scratch_shape(8192, 896) == (64, 896)
    assert fp8.bias_backward_scratch_shape(1, 5) == (1, 5)
    assert fp8.bias_backward_scratch_shape(129, 5) == (2, 5)


def _dual_entries(dev, shapes, dtype, fp8_name, amaxes, own_stats=(), inps=None):
    """(outs, outs_tp, inps) on `dev`: random inputs (or those given), each out's abs-max slot set from
    `amaxes`, out_tp sharing out's stats slot (its own for indices in `own_stats`)."""
    outs, outs_tp = [], []
    if inps is None:
        inps = [ce.Tensor.from_numpy(data(s, dtype, seed=10 + i), dev, name=f"x{i}") for i, s in enumerate(shapes)]
    for i, (shape, amax) in enumerate(zip(shapes, amaxes)):
        c = shape[-1]
        outs.append(ce.Tensor.empty(fp8_name, shape, dev, name=f"q{i}"))
        outs[-1].abs_max.copy_from_numpy(np.array([amax], np.float32))
        tp = ce.Tensor.empty(fp8_name, (c, math.prod(shape) // c), dev, name=f"qt{i}")
        outs_tp.append(tp if i in own_stats else tp.with_stats(outs[-1].stats))
    return outs, outs_tp, inps


@pytest.mark.parametrize("fp8_name", FP8)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_quantize_dual_multi_is_quantize_dual_per_entry(fp8_name, dtype):
    """The cpu twin: every entry's copies and stats are quantize_reference's (an empty entry is skipped),
    the out_tp slots get the stats whether shared or not, and each out's own abs-max lane is not written."""
    cpu = ce.device("cpu")
    shapes, amaxes = [(16, 8), (37, 24), (0, 8), (3, 5, 40), (160, 72)], [2.5, 0.0, 1.0, 1e-3, np.inf]
    assert fp8.quantize_dual_table_shape(shapes) == (4 * 64 + 4 * (1 + 1 + 1 + 4),)
    assert fp8.quantize_dual_table_shape([(0, 8)]) == (1,)
    outs, outs_tp, inps = _dual_entries(cpu, shapes, dtype, fp8_name, amaxes, own_stats=(1, 3))
    table = ce.Tensor.empty(ce.BYTE, fp8.quantize_dual_table_shape(shapes), cpu, name="table")
    tab = fp8.QuantizeDualTable(table, outs, outs_tp, inps)
    assert len(tab.entries) == 4 and tab.blocks == 7
    fp8.quantize_dual_multi(tab)
    for i, (out, out_tp, inp, amax) in enumerate(zip(outs, outs_tp, inps, amaxes)):
        if i == 2:
            continue
        c = inp.shape[-1]
        q, stats = fp8.quantize_reference(inp.numpy().reshape(-1, c), np.float32(amax), ce.dtype(fp8_name))
        np.testing.assert_array_equal(out.numpy().view(np.uint8).reshape(q.shape), q.view(np.uint8), err_msg=str(i))
        np.testing.assert_array_equal(out_tp.numpy().view(np.uint8), q.T.view(np.uint8), err_msg=str(i))
        np.testing.assert_array_equal(out.fp8_stats(), stats)
        np.testing.assert_array_equal(out_tp.fp8_stats(), stats)


def test_weights_requantize_through_the_table_equals_the_per_tensor_path(monkeypatch):
    """ModelWeights.requantize(abs_max_recorded=True) makes every FP8 copy (block matrices and the head) in one
    quantize_dual_multi call over its table, written on the first call and reused: copies, transposes and stats
    bitwise those of requantize() (an abs-max pass and one quantize_dual per copy) of the same weights."""
    from cuengine.alloc import TensorAllocator
    from cuengine.model import TransformerConfig
    from cuengine.model.weights import ModelWeights

    cfg = TransformerConfig.preset("tiny-llama")
    per_tensor, tabled = (ModelWeights(cfg, "bf16", TensorAllocator("cpu"), fp8=True, fp8_head=True) for _ in "ab")
    assert len(tabled.fp8) == 4 * cfg.num_layers + 1
    calls = []
    real_multi = fp8.quantize_dual_multi
    monkeypatch.setattr(fp8, "quantize_dual_multi", lambda table, stream=None: calls.append(table) or real_multi(table))
    for step in range(2):
        for w in (per_tensor, tabled):
            w.init(seed=step)  # other weights each time (init's own requantize takes the per-tensor path)
        calls.clear()
        per_tensor.requantize()
        assert calls == []
        tabled.zero_abs_max()  # what LlamaModel._update does, with the update recording the abs-maxes
        for name, slot in tabled.abs_max_slots.items():
            fp8.abs_max(slot, tabled[name])
        tabled.requantize(abs_max_recorded=True)
        assert len(calls) == 1 and calls[0] is tabled._fp8_table and len(calls[0].entries) == len(tabled.fp8)
        for name, q in tabled.fp8.items():
            want = per_tensor.fp8[name]
            np.testing.assert_array_equal(q.numpy().view(np.uint8), want.numpy().view(np.uint8), err_msg=name)
            np.testing.assert_array_equal(tabled.fp8_tp[name].numpy().view(np.uint8),
                                          per_tensor.fp8_tp[name].numpy().view(np.uint8), err_msg=name)  # fmt: skip
        np.testing.assert_array_equal(tabled.fp8_stats.numpy(), per_tensor.fp8_stats.numpy())
        assert tabled.fp8_stats.numpy()[:, 0].min() > 0


# ---- cpu: error paths -------------------------------------------------------------------------
def _t(dtype, shape, name="t"):
    return ce.Tensor.empty(dtype, shape, ce.device("cpu"), name=name)


def test_errors_abs_max():
    with pytest.raises(ValueError, match=r"abs_max: amax: expected shape \(1\)"):
        fp8.abs_max(_t(ce.FP32, (2,)), _t(ce.FP32, (4,)))
    with pytest.raises(ValueError, match=r"abs_max: inp: expected dtype fp32/bf16"):
        fp8.abs_max(_t(ce.FP32, (1,)), _t(ce.INT32, (4,)))


def test_errors_quantize():
    x = _t(ce.BF16, (4, 8))
    with pytest.raises(ValueError, match=r"out: expected dtype e4m3/e5m2, got tensor 'q' bf16"):
        fp8.quantize_with_abs_max(_t(ce.BF16, (4, 8), "q"), x)
    with pytest.raises(ValueError, match=r"inp: expected dtype fp32/bf16"):
        fp8.quantize_with_abs_max(_t("e4m3", (4, 8)), _t(ce.FP16, (4, 8)))
    bare = ce.Tensor(ce.FP8_E4M3, (4, 8), ce.device("cpu"), np.zeros(32, np.uint8), name="bare")
    with pytest.raises(ValueError, match=r"'bare'.*carries no FP8 stats"):
        fp8.quantize_with_abs_max(bare, x)
    with pytest.raises(ValueError, match=r"different numbers of elements"):
        fp8.quantize_with_abs_max(_t("e4m3", (4, 9)), x)
    with pytest.raises(ValueError, match=r"abs_max: expected shape \(1\)"):
        fp8.quantize_with_abs_max(_t("e4m3", (4, 8)), x, abs_max=_t(ce.FP32, (3,)))
    with pytest.raises(ValueError, match=r"quantize_and_transpose: out: expected shape \(8, 4\)"):
        fp8.quantize_and_transpose(_t("e5m2", (4, 8)), x)
    with pytest.raises(ValueError, match=r"quantize_dual: out_tp: expected shape \(8, 4\)"):
        fp8.quantize_dual(_t("e4m3", (4, 8)), _t("e4m3", (4, 8)), x)
    with pytest.raises(ValueError, match=r"quantize_dual: out_tp: expected dtype e4m3, got tensor 'qt' e5m2"):
        fp8.quantize_dual(_t("e4m3", (4, 8)), _t("e5m2", (8, 4), "qt"), x)
    with pytest.raises(ValueError, match=r"quantize_dual: out 't' \(4, 9\) and inp .* different numbers of elements"):
        fp8.quantize_dual(_t("e4m3", (4, 9)), _t("e4m3", (8, 4)), x)
    bare_t = ce.Tensor(ce.FP8_E4M3, (8, 4), ce.device("cpu"), np.zeros(32, np.uint8), name="bare_t")
    with pytest.raises(ValueError, match=r"quantize_dual \(out_tp\): out 'bare_t'.*carries no FP8 stats"):
        fp8.quantize_dual(_t("e4m3", (4, 8)), bare_t, x)


def test_errors_quantize_dual_table():
    x, y = _t(ce.BF16, (4, 8), "x"), _t(ce.BF16, (16, 8), "y")
    q, qt = _t("e4m3", (4, 8), "q"), _t("e4m3", (8, 4), "qt")
    r, rt = _t("e4m3", (16, 8), "r"), _t("e4m3", (8, 16), "rt")
    table = _t(ce.BYTE, fp8.quantize_dual_table_shape([(4, 8), (16, 8)]), "table")
    with pytest.raises(ValueError, match=r"QuantizeDualTable\[1\]: inp 'y32' is fp32 but 'x' is bf16; one table holds "
                       r"one input dtype and one FP8 dtype"):  # fmt: skip
        fp8.QuantizeDualTable(table, [q, r], [qt, rt], [x, _t(ce.FP32, (16, 8), "y32")])
    with pytest.raises(ValueError, match=r"QuantizeDualTable\[1\]: out 'r5' is e5m2 but 'q' is e4m3"):
        fp8.QuantizeDualTable(table, [q, _t("e5m2", (16, 8), "r5")], [qt, _t("e5m2", (8, 16))], [x, y])
    with pytest.raises(ValueError, match=r"QuantizeDualTable: table: expected shape \(136\), got tensor 'small'"):
        fp8.QuantizeDualTable(_t(ce.BYTE, (64,), "small"), [q, r], [qt, rt], [x, y])
    with pytest.raises(ValueError, match=r"QuantizeDualTable\[1\]: out_tp: expected shape \(8, 16\), got tensor 'rt'"):
        fp8.QuantizeDualTable(table, [q, r], [qt, rt.reshape(16, 8)], [x, y])
    with pytest.raises(ValueError, match=r"QuantizeDualTable\[1\]: out 'r' \(16, 8\) and inp 'x2' \(4, 8\) hold "
                       r"different numbers of elements"):  # fmt: skip
        fp8.QuantizeDualTable(table, [q, r], [qt, rt], [x, _t(ce.BF16, (4, 8), "x2")])
    with pytest.raises(ValueError, match=r"QuantizeDualTable\[0\]: inp: expected dtype fp32/bf16"):
        fp8.QuantizeDualTable(table, [q, r], [qt, rt], [_t(ce.FP16, (4, 8)), y])
    with pytest.raises(ValueError, match=r"QuantizeDualTable\[1\]: a stats slot of out 'r' or out_tp 'rt' is also "
                       r"one of entry 0's"):  # fmt: skip
        fp8.QuantizeDualTable(table, [q, r], [qt, rt.with_stats(q.stats)], [x, y])
    with pytest.raises(ValueError, match=r"QuantizeDualTable: outs has 1 entries and outs_tp 2, inps has 2"):
        fp8.QuantizeDualTable(table, [q], [qt, rt], [x, y])
    with pytest.raises(ValueError, match=r"QuantizeDualTable: no tensors"):
        fp8.QuantizeDualTable(table, [], [], [])
    fp8.QuantizeDualTable(table, [q, r], [qt, rt], [x, y])  # and the table of the right entries is taken


def test_errors_transpose():
    with pytest.raises(ValueError, match=r"only 1- and 2-byte dtypes"):
        fp8.transpose(_t(ce.FP32, (8, 4)), _t(ce.FP32, (4, 8)))
    with pytest.raises(ValueError, match=r"transpose: out: expected dtype bf16"):
        fp8.transpose(_t(ce.FP16, (8, 4)), _t(ce.BF16, (4, 8)))
    with pytest.raises(ValueError, match=r"transpose: out: expected shape \(8, 4\)"):
        fp8.transpose(_t(ce.BF16, (4, 8)), _t(ce.BF16, (4, 8)))
    with pytest.raises(ValueError, match=r"non-empty last dimension"):
        fp8.transpose(_t(ce.BF16, (0, 4)), _t(ce.BF16, (4, 0)))


def test_errors_bias_backward():
    with pytest.raises(ValueError, match=r"dbias: expected dtype fp32/bf16"):
        fp8.bias_backward(_t(ce.FP16, (8,)), _t(ce.BF16, (4, 8)), _t(ce.FP32, (1, 8)))
    with pytest.raises(ValueError, match=r"dbias: expected shape \(\*\)"):
        fp8.bias_backward(_t(ce.FP32, (2, 8)), _t(ce.BF16, (4, 8)), _t(ce.FP32, (1, 8)))
    with pytest.raises(ValueError, match=r"must end in OC = 8"):
        fp8.bias_backward(_t(ce.FP32, (8,)), _t(ce.BF16, (8, 4)), _t(ce.FP32, (1, 8)))
    with pytest.raises(ValueError, match=r"scratch 's'.*needs 16"):
        fp8.bias_backward(_t(ce.FP32, (8,)), _t(ce.BF16, (200, 8)), _t(ce.FP32, (8,), "s"))
    with pytest.raises(ValueError, match=r"scratch: expected dtype fp32"):
        fp8.bias_backward(_t(ce.FP32, (8,)), _t(ce.BF16, (4, 8)), _t(ce.BF16, (1, 8)))


# ---- cuda against the twin ----------------------------------------------------------------------
SHAPES = [(1, 8), (37, 5), (199, 760), (128, 1128), (760, 896), (1128, 37), (8192, 896)]


def both(fn):
    """Run fn(device) on cpu and cuda; return the two results."""
    return fn(ce.device("cpu")), fn(ce.device("cuda"))


def unaligned(dev, x, dtype):
    """A tensor holding x whose start is 2 elements past a 16-byte boundary."""
    padded = np.concatenate([np.zeros(2, x.dtype), x.reshape(-1)])
    t = ce.Tensor.from_numpy(padded, dev, name="x", dtype=dtype)
    return t[2:].reshape(x.shape)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 37, 199 * 760, 8192 * 896 + 3])
@pytest.mark.parametrize("align", [True, False])
def test_cuda_abs_max(dtype, n, align):
    x = data((n,), dtype, seed=n)
    x[n // 2] = -9.5  # the max sits in the middle

    def fn(dev):
        amax = ce.Tensor.from_numpy(np.array([0.5], np.float32), dev)
        fp8.abs_max(amax, ce.Tensor.from_numpy(x, dev) if align else unaligned(dev, x, dtype))
        return amax.numpy()

    cpu, cuda = both(fn)
    np.testing.assert_array_equal(cuda, cpu)


@pytest.mark.gpu
def test_cuda_abs_max_nan():
    x = data((5000,), "bf16")
    x[4321] = np.nan
    amax = ce.Tensor.from_numpy(np.zeros(1, np.float32), "cuda")
    fp8.abs_max(amax, ce.Tensor.from_numpy(x, "cuda"))
    assert np.isnan(amax.numpy()[0])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_name", FP8)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("slot", ["own", "given", "zero"])
def test_cuda_quantize(fp8_name, dtype, shape, slot):
    x = data(shape, dtype, seed=shape[0])
    amax = 0.0 if slot == "zero" else float(np.abs(x.astype(np.float32)).max()) * 0.9

    def fn(dev):
        out = ce.Tensor.empty(fp8_name, shape, dev, name="q")
        given = None
        if slot == "given":
            given = ce.Tensor.from_numpy(np.array([amax], np.float32), dev)
        else:
            out.abs_max.copy_from_numpy(np.array([amax], np.float32))
        inp = ce.Tensor.from_numpy(x, dev) if shape[0] % 2 else unaligned(dev, x, dtype)
        fp8.quantize_with_abs_max(out, inp, abs_max=given)
        return out.numpy(), out.fp8_stats()

    (q_cpu, s_cpu), (q_cuda, s_cuda) = both(fn)
    np.testing.assert_array_equal(s_cuda, s_cpu)
    fp8_close(q_cuda, q_cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_name", FP8)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES + [(4, 2, 96)])
def test_cuda_quantize_and_transpose(fp8_name, dtype, shape):
    x = data(shape, dtype, seed=shape[-1])
    c = shape[-1]
    n = x.size // c

    def fn(dev):
        out = ce.Tensor.empty(fp8_name, (c, n), dev, name="qt")
        slot = ce.Tensor.from_numpy(np.array([2.0], np.float32), dev)
        fp8.quantize_and_transpose(out, ce.Tensor.from_numpy(x, dev), abs_max=slot)
        return out.numpy(), out.fp8_stats()

    (q_cpu, s_cpu), (q_cuda, s_cuda) = both(fn)
    np.testing.assert_array_equal(s_cuda, s_cpu)
    fp8_close(q_cuda, q_cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_name", FP8)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES + [(4, 2, 96), (8192, 9728)])
@pytest.mark.parametrize("align", [True, False])
def test_cuda_quantize_dual_equals_quantize_then_transpose(fp8_name, dtype, shape, align):
    """Bit for bit the cuda quantize + transpose it replaces in the FP8 backward (and the weights'
    requantize), values and stats, aligned (16-byte kernels) or not (scalar kernels)."""
    x = data(shape, dtype, seed=shape[-1] + 1)
    c = shape[-1]
    n = x.size // c
    dev = ce.device("cuda")
    inp = ce.Tensor.from_numpy(x, dev) if align else unaligned(dev, x, dtype)
    plain, plain_t = ce.Tensor.empty(fp8_name, shape, dev), ce.Tensor.empty(fp8_name, (c, n), dev)
    plain.abs_max.copy_from_numpy(np.array([2.0], np.float32))
    fp8.quantize_with_abs_max(plain, inp)
    fp8.transpose(plain_t, plain)
    out = ce.Tensor.empty(fp8_name, shape, dev, name="q")
    out_tp = ce.Tensor.empty(fp8_name, (c, n), dev, name="qt").with_stats(out.stats)
    out.abs_max.copy_from_numpy(np.array([2.0], np.float32))
    fp8.quantize_dual(out, out_tp, inp)
    np.testing.assert_array_equal(out.numpy().view(np.uint8), plain.numpy().view(np.uint8))
    np.testing.assert_array_equal(out_tp.numpy().view(np.uint8), plain_t.numpy().view(np.uint8))
    np.testing.assert_array_equal(out.fp8_stats(), plain.fp8_stats())
    own = ce.Tensor.empty(fp8_name, (c, n), dev, name="qt_own")  # a separate stats slot gets the stats too
    fp8.quantize_dual(out, own, inp)
    np.testing.assert_array_equal(own.fp8_stats(), plain.fp8_stats())
    q_cpu = ce.Tensor.empty(fp8_name, shape, "cpu")
    q_cpu.abs_max.copy_from_numpy(np.array([2.0], np.float32))
    fp8.quantize_dual(q_cpu, ce.Tensor.empty(fp8_name, (c, n), "cpu"), ce.Tensor.from_numpy(x, "cpu"))
    fp8_close(out.numpy(), q_cpu.numpy())


# The FP8 weight copies of one 0.5B layer (qkv_w, atto_w, up_w, down_w), the tied head, and small tensors of 1 and
# 3 tiles between them: record boundaries inside the launch, several row and column tile counts.
QWEN_DUAL_SHAPES = [(1152, 896), (896, 896), (16, 8), (9728, 896), (48, 136), (896, 4864), (151936, 896)]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_name", FP8)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("misaligned", [False, True])
def test_cuda_quantize_dual_multi_equals_per_tensor_launches(fp8_name, dtype, misaligned):
    """One quantize_dual_multi launch gives the bits of one quantize_dual launch per entry (values, transposes,
    stats; shared and own out_tp slots); with one entry 2 elements past a 16-byte boundary it launches per
    entry (the scalar kernel for that one) with the same bits."""
    dev = ce.device("cuda")
    amaxes = [2.5, 1e-3, 0.0, 4.0, 1.0, 3.0, np.inf]
    single = _dual_entries(dev, QWEN_DUAL_SHAPES, dtype, fp8_name, amaxes, own_stats=(1, 4))
    if misaligned:
        single[2][4] = unaligned(dev, single[2][4].numpy(), dtype)
    multi = _dual_entries(dev, QWEN_DUAL_SHAPES, dtype, fp8_name, amaxes, own_stats=(1, 4), inps=single[2])
    for out, out_tp, inp in zip(*single):
        fp8.quantize_dual(out, out_tp, inp)
    table = ce.Tensor.empty(ce.BYTE, fp8.quantize_dual_table_shape(QWEN_DUAL_SHAPES), dev, name="table")
    tab = fp8.QuantizeDualTable(table, *multi)
    assert tab.vectorized != misaligned
    fp8.quantize_dual_multi(tab)
    for i, (got, want) in enumerate(zip(zip(*multi[:2]), zip(*single[:2]))):
        for a, b, what in zip(got, want, ("copy", "transpose")):
            np.testing.assert_array_equal(a.numpy().view(np.uint8), b.numpy().view(np.uint8), err_msg=f"{i} {what}")
            np.testing.assert_array_equal(a.stats.numpy(), b.stats.numpy(), err_msg=f"{i} {what} stats")
    q_cpu = ce.Tensor.empty(fp8_name, QWEN_DUAL_SHAPES[0], "cpu")
    q_cpu.abs_max.copy_from_numpy(np.array([amaxes[0]], np.float32))
    fp8.quantize_dual(q_cpu, ce.Tensor.empty(fp8_name, QWEN_DUAL_SHAPES[0][::-1], "cpu"),
                      ce.Tensor.from_numpy(single[2][0].numpy(), "cpu"))  # fmt: skip
    fp8_close(multi[0][0].numpy(), q_cpu.numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "e4m3", "e5m2", "fp16"])
@pytest.mark.parametrize("shape", SHAPES + [(4096, 64), (64, 4096)])
def test_cuda_transpose(dtype, shape):
    dt = ce.dtype(dtype)
    bits = rng(shape[0]).integers(0, 256**dt.itemsize, shape).astype(_BITS[dt.itemsize])
    c = shape[-1]

    def fn(dev):
        out = ce.Tensor.empty(dt, (c, bits.size // c), dev, name="out")
        fp8.transpose(out, ce.Tensor.from_numpy(bits.view(dt.np), dev))
        return out.numpy().view(bits.dtype)

    cpu, cuda = both(fn)
    np.testing.assert_array_equal(cuda, cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("dbias_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("dout_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_bias_backward(dbias_dtype, dout_dtype, shape):
    n, oc = shape
    dout, dbias = data(shape, dout_dtype, seed=oc, scale=1.0), data((oc,), dbias_dtype, seed=1, scale=1.0)
    check_op(fp8.bias_backward, {"dout": dout}, {"dbias": dbias}, scale={"dbias": math.sqrt(n)},
             scratch={"scratch": ("fp32", fp8.bias_backward_scratch_shape(n, oc))}, repeat=True)  # fmt: skip


# ---- delayed scaling: the abs-max history ----------------------------------------------------------------
# Four micro-steps of three tensors (E4M3, E5M2, E4M3) with a history of n = 3: each row's recorded abs-maxes
# and the scale after each roll, worked out by hand from the rule (the largest finite one of the last 3; 1 when
# that is 0; a NaN or an inf stays in the history, out of the max).
ROLL_AMAX = [[2.0, 4.0, 0.0], [1.0, 8.0, 0.0], [0.5, np.nan, 0.0], [np.inf, 1.0, np.inf]]
ROLL_WANT = [
    [[224.0, 2.0, 0.0, 0.0], [14336.0, 4.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]],
    [[224.0, 1.0, 2.0, 0.0], [7168.0, 8.0, 4.0, 0.0], [1.0, 0.0, 0.0, 0.0]],
    [[224.0, 0.5, 1.0, 2.0], [7168.0, np.nan, 8.0, 4.0], [1.0, 0.0, 0.0, 0.0]],
    [[448.0, np.inf, 0.5, 1.0], [7168.0, 1.0, np.nan, 8.0], [1.0, np.inf, 0.0, 0.0]],
]


def test_amax_history_roll_keeps_the_last_n_abs_maxes_and_scales_from_their_max(dev):
    stats_np = np.full((3, 2, ce.tensor.STATS_SLOTS), 7.0, np.float32)  # the tensors' slots: [0, 1], [1, 0], [2, 1]
    stats = ce.Tensor.from_numpy(stats_np, dev, name="stats")
    s = ce.tensor.STATS_SLOTS
    slots = ce.Tensor.from_numpy(np.array([s, 2 * s, 5 * s], np.int32), dev, name="slots")
    fp8_max = ce.Tensor.from_numpy(np.array([448.0, 57344.0, 448.0], np.float32), dev, name="fp8_max")
    history = ce.Tensor.from_numpy(np.zeros((3, 4), np.float32), dev, name="history")
    for amax, want in zip(ROLL_AMAX, ROLL_WANT):
        for (i, j), a in zip([(0, 1), (1, 0), (2, 1)], amax):
            stats_np[i, j, ce.tensor.STAT_ABS_MAX] = a
        stats.copy_from_numpy(stats_np)
        fp8.amax_history_roll(history, stats, slots, fp8_max)
        np.testing.assert_array_equal(history.numpy(), np.array(want, np.float32))
    np.testing.assert_array_equal(stats.numpy(), stats_np)  # only read


@pytest.mark.parametrize(
    "shapes,match",
    [
        (((3, 1), (3,), (3,)), "needs n \\+ 1 >= 2 columns"),
        (((3, 4), (2,), (3,)), r"slots: expected shape \(3\)"),
        (((3, 4), (3,), (4,)), r"fp8_max: expected shape \(3\)"),
    ],
)
def test_amax_history_roll_errors(shapes, match):
    h, sl, fm = shapes
    with pytest.raises(ValueError, match=match):
        fp8.amax_history_roll(ce.Tensor.empty("fp32", h, "cpu"), ce.Tensor.empty("fp32", (24,), "cpu"),
                              ce.Tensor.empty("int32", sl, "cpu"), ce.Tensor.empty("fp32", fm, "cpu"))  # fmt: skip


def test_emulated_amax_history_roll_equals_the_hand_worked_rolls(tmp_path, monkeypatch):
    """The compiled kernel on the host emulator (tests/kernel_emulator.py), through the real launcher."""
    import kernel_emulator as emu

    lib = emu.or_skip(emu.build("fp8", ["amax_history_roll"], tmp_path))
    monkeypatch.setattr(fp8._build, "launch", lambda *a, **kw: emu.launch(lib, *a))
    s = ce.tensor.STATS_SLOTS
    stats = emu.tensor(np.zeros(6 * s), "fp32", "stats")
    slots, fp8_max = (
        emu.tensor(np.array([s, 2 * s, 5 * s]), "int32", "slots"),
        emu.tensor([448, 57344, 448], "fp32", "m"),
    )
    history = emu.tensor(np.zeros((3, 4)), "fp32", "history")
    for amax, want in zip(ROLL_AMAX, ROLL_WANT):
        stats.array()[[s, 2 * s, 5 * s]] = amax
        fp8.amax_history_roll(history, stats, slots, fp8_max)
        np.testing.assert_array_equal(history.numpy(), np.array(want, np.float32))
    assert all(emu.margins_ok(t) for t in (stats, slots, fp8_max, history))
