"""rmsnorm.cu's backward and fp8.cu's quantize_dual run on the host (tests/kernel_emulator.py), driven
by the real launchers: variant choice, tails, unaligned data and index arithmetic are checked on cpu.

The bitwise claims of the issue-13 kernels: the register-row backward (rmsnorm_backward_v<V>) gives
the looping kernel's bits, both leave the partials of rmsnorm_backward_partials_np (dweight's grouping),
the dweight reduce adds the partials in row order, and quantize_dual
equals quantize then transpose. adamw8bit's multi-tensor launch, and quantize_dual_multi's, give the bits of
their per-tensor launches."""

import kernel_emulator as emu
import numpy as np
import pytest
from conftest import assert_close

import cuengine as ce
from cuengine.kernels import _build, classifier, fp8
from cuengine.kernels import rmsnorm as R


def _library(tmp_path_factory, family, kernels):
    return emu.or_skip(emu.build(family, kernels, tmp_path_factory.mktemp(f"{family}_emu")))


@pytest.fixture(scope="module")
def rms_lib(tmp_path_factory):
    kinds = ("", "v1_", "v2_", "v4_", "v6_", "v8_")
    names = [f"rmsnorm_backward_{v}{t}" for v in kinds for t in ("bf16", "f32")]
    return _library(
        tmp_path_factory, "rmsnorm", names + ["rmsnorm_backward_dweight_bf16", "rmsnorm_backward_dweight_f32"]
    )


@pytest.fixture(scope="module")
def fp8_lib(tmp_path_factory):
    names = ["transpose_u8", "transpose_u8_scalar"]
    for t in ("bf16", "f32"):
        names += [f"abs_max_{t}", f"abs_max_{t}_scalar"]
        for q in ("e4m3", "e5m2"):
            names += [f"{k}_{t}_{q}{s}" for k in ("quantize", "quantize_dual") for s in ("", "_scalar")]
            names.append(f"quantize_dual_multi_{t}_{q}")
    return _library(tmp_path_factory, "fp8", names)


def _recording(lib, calls):
    def launch(*args, **kw):
        calls.append(args[1])
        emu.launch(lib, *args, **kw)

    return launch


def _rms_backward(n, c, dtype, seed):
    g = np.random.default_rng(seed)
    x, dout, dres = (g.standard_normal((n, c)) for _ in range(3))
    w = 1 + 0.3 * g.standard_normal(c)
    np_dt = ce.dtype(dtype).np
    _, rstd = R.rmsnorm_forward_np(x.astype(np_dt), w.astype(np_dt), 1e-5)
    t = {k: emu.tensor(v, dtype, k) for k, v in (("x", x), ("w", w), ("dout", dout), ("dres", dres))}
    t["dw"] = emu.tensor(g.standard_normal(c), dtype, "dw")
    t["rstd"] = emu.tensor(rstd, "fp32", "rstd")
    t["scratch"] = emu.tensor(np.full(R.rmsnorm_scratch_shape(n, c, dtype), np.nan), "fp32", "scratch")
    t["amax"] = emu.tensor(np.zeros(1), "fp32", "amax")
    dw0 = t["dw"].numpy().astype(np.float32)
    R.rmsnorm_backward(t["dres"], t["dw"], t["scratch"], t["dres"], t["dout"], t["x"], t["w"], t["rstd"],
                       abs_max=t["amax"])  # in place on dresidual, as the model runs it  # fmt: skip
    for k, v in t.items():
        assert emu.margins_ok(v), f"{k}: written out of bounds"
    partials = R.rmsnorm_backward_partials_np(t["dout"].numpy(), t["x"].numpy(), rstd)  # rows grouped as the kernels do
    np.testing.assert_array_equal(t["scratch"].numpy().view(np.uint32), partials.view(np.uint32), err_msg="partials")
    acc = np.zeros(c, np.float32)
    for p in t["scratch"].numpy():  # dweight = the partials added in row order, rounded once
        acc += p
    want = (dw0 + acc).astype(np_dt)
    np.testing.assert_array_equal(t["dw"].numpy().view(np.uint8), want.view(np.uint8))
    dx, dw_sum = R.rmsnorm_backward_np(dres.astype(np_dt), dout.astype(np_dt), x.astype(np_dt), w.astype(np_dt), rstd)
    # one rounding step of the stored dtype: the twin's dot adds in another order, and over thousands of
    # rows a few elements land on the other side of a bf16 rounding boundary
    rtol = 1e-5 if dtype == "fp32" else 2.0**-7
    np.testing.assert_allclose(t["dres"].numpy().astype(np.float32), dx.astype(np.float32), rtol=rtol, atol=1e-5)
    # each channel's partials are its own (a slot mix-up in the block's shared partials moves sums across channels)
    np.testing.assert_allclose(acc, dw_sum, rtol=1e-4, atol=1e-4 * np.sqrt(n))
    return {k: t[k].numpy() for k in ("dres", "dw", "amax")}


RMS_CASES = [(64, "bf16", "v1"), (264, "bf16", "v2"), (1000, "bf16", "v4"), (1536, "bf16", "v6"), (2048, "bf16", "v8"),
             (100, "fp32", "v1"), (1024, "fp32", "v8")]  # fmt: skip


@pytest.mark.parametrize("c,dtype,variant", RMS_CASES)
def test_emulated_rmsnorm_backward_register_rows_equal_the_looping_kernel(rms_lib, monkeypatch, c, dtype, variant):
    calls = []
    monkeypatch.setattr(R, "launch", _recording(rms_lib, calls))
    fast = _rms_backward(37, c, dtype, seed=c)
    assert calls[0] == f"rmsnorm_backward_{variant}_{'f32' if dtype == 'fp32' else dtype}", calls
    monkeypatch.setattr(R, "_REG_VECTORS", ())
    loop = _rms_backward(37, c, dtype, seed=c)
    assert calls[2].startswith("rmsnorm_backward_") and "_v" not in calls[2], calls
    for k in fast:
        np.testing.assert_array_equal(fast[k].view(np.uint8), loop[k].view(np.uint8), err_msg=k)


# (rows, C, variant, block cap): the real cap (132 blocks, 2-3 rows a warp, a ragged last round), fewer
# rows than one block has warps, a small cap that gives each warp ~18 rows through the staged pipeline,
# and one block whose warps take ~88 rows each (the rstd of 32 rows a lane at a time, reloaded twice)
PIPE_CASES = [(3000, 896, "v4", None), (5, 1536, "v6", None), (1000, 1536, "v6", 7), (301, 64, "v1", 3),
              (700, 64, "v1", 1)]  # fmt: skip


@pytest.mark.parametrize("n,c,variant,cap", PIPE_CASES)
def test_emulated_rmsnorm_backward_pipelined_rows_equal_the_looping_kernel(rms_lib, monkeypatch, n, c, variant, cap):
    """A warp stages its next row while it computes this one: over many rows per warp and ragged tails
    the register variants still give the looping kernel's bits, and the partials' grouping."""
    calls = []
    monkeypatch.setattr(R, "launch", _recording(rms_lib, calls))
    if cap is not None:
        monkeypatch.setattr(R, "_MAX_PARTIALS", cap)
    fast = _rms_backward(n, c, "bf16", seed=n)
    assert calls[0] == f"rmsnorm_backward_{variant}_bf16", calls
    monkeypatch.setattr(R, "_REG_VECTORS", ())
    loop = _rms_backward(n, c, "bf16", seed=n)
    assert calls[2] == "rmsnorm_backward_bf16", calls
    for k in fast:
        np.testing.assert_array_equal(fast[k].view(np.uint8), loop[k].view(np.uint8), err_msg=k)


def test_emulated_rmsnorm_dweight_reduce_over_two_chunks(rms_lib, monkeypatch):
    """P = 264 partial rows (a cap above the launcher's 132): the reduce, written for any P, stages them
    through shared memory in two chunks (256, then 8)."""
    monkeypatch.setattr(R, "launch", _recording(rms_lib, []))
    monkeypatch.setattr(R, "_MAX_PARTIALS", 264)
    assert R.rmsnorm_scratch_shape(4100, 8, "bf16")[0] == 264
    _rms_backward(4100, 8, "bf16", seed=3)


@pytest.mark.parametrize("dtype,fp8_name", [("bf16", "e4m3"), ("fp32", "e5m2")])
@pytest.mark.parametrize("shape", [(32, 64), (160, 72), (37, 24), (3, 5, 8), (130, 136)])
def test_emulated_quantize_dual_equals_quantize_then_transpose(fp8_lib, monkeypatch, dtype, fp8_name, shape):
    calls = []
    monkeypatch.setattr(_build, "launch", _recording(fp8_lib, calls))
    x = np.random.default_rng(sum(shape)).standard_normal(shape) * 3
    c = shape[-1]
    n = x.size // c
    inp = emu.tensor(x, dtype, "x")
    amax = emu.tensor(np.array([2.5]), "fp32", "amax")  # below max|x|: saturation too

    def fp8_tensor(shape, name):
        return emu.tensor(np.zeros(shape), fp8_name, name).with_stats(emu.tensor(np.zeros(12), "fp32", name + ".s"))

    plain, plain_t = fp8_tensor(shape, "q"), fp8_tensor((c, n), "qt")
    fp8.quantize_with_abs_max(plain, inp, amax)
    fp8.transpose(plain_t, plain)
    out, out_tp = fp8_tensor(shape, "o"), fp8_tensor((c, n), "ot")
    calls.clear()
    fp8.quantize_dual(out, out_tp, inp, amax)
    vec = c % 8 == 0 and n % 16 == 0
    assert calls == [_build.kernel_name("quantize_dual", inp, out, scalar=not vec)]
    for t in (out, out_tp, out.stats, out_tp.stats):
        assert emu.margins_ok(t)
    np.testing.assert_array_equal(out.numpy().view(np.uint8), plain.numpy().view(np.uint8))
    np.testing.assert_array_equal(out_tp.numpy().view(np.uint8), plain_t.numpy().view(np.uint8))
    np.testing.assert_array_equal(out.stats.numpy(), plain.stats.numpy())
    np.testing.assert_array_equal(out_tp.stats.numpy(), plain.stats.numpy())
    twin, _ = fp8.quantize_reference(x.astype(ce.dtype(dtype).np), np.float32(2.5), ce.dtype(fp8_name))
    np.testing.assert_array_equal(out.numpy().view(np.uint8), twin.view(np.uint8))


# (N, C) inputs meeting the 16-byte conditions, with 1, 4, 8, 2, 3 and 1 tiles of 128 rows x 64 columns: the
# records' boundaries fall inside the grid, and row-tile / column-tile counts differ from record to record.
MULTI_SHAPES = [(16, 8), (160, 72), (2, 96, 200), (256, 64), (48, 136), (128, 64)]
MULTI_AMAX = [2.5, 1e-3, 0.0, 4.0, 1.0, np.inf]  # saturation, everything saturated, 0 and inf (scale 1), plain


def _dual_operands(shapes, dtype, fp8_name, own_stats=(), unaligned=()):
    """(outs, outs_tp, inps) on the emulated device: random inputs (2 elements past a 16-byte boundary for
    indices in `unaligned`), each out's abs-max slot preset from MULTI_AMAX, out_tp sharing out's stats slot
    (its own, NaN-filled, for indices in `own_stats`)."""
    outs, outs_tp, inps = [], [], []
    for i, shape in enumerate(shapes):
        x = np.random.default_rng(i).standard_normal(shape) * 3
        c = shape[-1]
        if i in unaligned:
            inp = emu.tensor(np.concatenate([np.zeros(2), x.reshape(-1)]), dtype, f"x{i}")[2:].reshape(shape)
        else:
            inp = emu.tensor(x, dtype, f"x{i}")
        stats = emu.tensor(np.zeros(12), "fp32", f"s{i}")
        stats.array()[0] = MULTI_AMAX[i % len(MULTI_AMAX)]
        out = emu.tensor(np.zeros(shape), fp8_name, f"q{i}").with_stats(stats)
        tp = emu.tensor(np.zeros((c, x.size // c)), fp8_name, f"qt{i}")
        tp_stats = emu.tensor(np.full(12, np.nan), "fp32", f"st{i}") if i in own_stats else stats
        outs.append(out)
        outs_tp.append(tp.with_stats(tp_stats))
        inps.append(inp)
    return outs, outs_tp, inps


def _assert_same_copies(got, want):
    for o, t, x, wo, wt in zip(*got, *want[:2]):
        for a, b, what in ((o, wo, "copy"), (t, wt, "transpose"), (o.stats, wo.stats, "stats"),
                           (t.stats, wt.stats, "out_tp stats")):  # fmt: skip
            assert emu.margins_ok(a), f"{a.name}: written out of bounds"
            np.testing.assert_array_equal(
                a.numpy().view(np.uint8), b.numpy().view(np.uint8), err_msg=f"{x.name} {what}"
            )


@pytest.mark.parametrize("dtype,fp8_name", [("bf16", "e4m3"), ("fp32", "e5m2"), ("bf16", "e5m2"), ("fp32", "e4m3")])
def test_emulated_quantize_dual_multi_equals_per_tensor_launches(fp8_lib, monkeypatch, dtype, fp8_name):
    """quantize_dual_multi over tensors of different shapes and tile counts (one launch, record boundaries
    inside the grid) gives the bits of one quantize_dual launch per tensor: both copies and the stats, out_tp
    with out's stats slot or its own; each copy is also the twin's."""
    calls = []
    monkeypatch.setattr(_build, "launch", _recording(fp8_lib, calls))
    own = (1, 4)
    single = _dual_operands(MULTI_SHAPES, dtype, fp8_name, own_stats=own)
    for out, out_tp, inp in zip(*single):
        fp8.quantize_dual(out, out_tp, inp)
    assert calls == [_build.kernel_name("quantize_dual", ce.dtype(dtype), ce.dtype(fp8_name))] * len(MULTI_SHAPES)
    multi = _dual_operands(MULTI_SHAPES, dtype, fp8_name, own_stats=own)
    table = emu.tensor(np.zeros(fp8.quantize_dual_table_shape(MULTI_SHAPES)), "u8", "table")
    tab = fp8.QuantizeDualTable(table, *multi)
    assert tab.vectorized and tab.blocks == 1 + 4 + 8 + 2 + 3 + 1
    assert tab.owner.numpy().tolist() == [0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 4, 4, 4, 5]
    calls.clear()
    fp8.quantize_dual_multi(tab)
    assert calls == [_build.kernel_name("quantize_dual_multi", ce.dtype(dtype), ce.dtype(fp8_name))]
    assert emu.margins_ok(table)
    _assert_same_copies(multi, single)
    for i, (out, out_tp, inp) in enumerate(zip(*multi)):
        c = inp.shape[-1]
        amax = np.float32(MULTI_AMAX[i])
        q, stats = fp8.quantize_reference(inp.numpy().reshape(-1, c), amax, ce.dtype(fp8_name))
        np.testing.assert_array_equal(out.numpy().view(np.uint8).reshape(q.shape), q.view(np.uint8))
        np.testing.assert_array_equal(out_tp.numpy().view(np.uint8), q.T.view(np.uint8))
        np.testing.assert_array_equal(out_tp.fp8_stats(), stats)
        assert np.isnan(out_tp.stats.numpy()[1:4]).all() == (i in own)  # the lanes between the fields: untouched


def test_emulated_quantize_dual_multi_launches_per_tensor_when_one_misses_the_16_byte_kernel(fp8_lib, monkeypatch):
    """One input 2 elements past a 16-byte boundary, or N not a multiple of 16: the table launches quantize_dual
    per tensor (the scalar kernel for that one), with the same bits as the plain calls."""
    calls = []
    monkeypatch.setattr(_build, "launch", _recording(fp8_lib, calls))
    cases = [(MULTI_SHAPES[:3], (1,), ["", "_scalar", ""]), (MULTI_SHAPES[:2] + [(37, 24)], (), ["", "", "_scalar"])]
    for shapes, unaligned, variants in cases:
        single = _dual_operands(shapes, "bf16", "e4m3", unaligned=unaligned)
        for out, out_tp, inp in zip(*single):
            fp8.quantize_dual(out, out_tp, inp)
        multi = _dual_operands(shapes, "bf16", "e4m3", unaligned=unaligned)
        table = emu.tensor(np.zeros(fp8.quantize_dual_table_shape(shapes)), "u8", "table")
        tab = fp8.QuantizeDualTable(table, *multi)
        assert not tab.vectorized
        calls.clear()
        fp8.quantize_dual_multi(tab)
        assert calls == [f"quantize_dual_bf16_e4m3{v}" for v in variants]
        _assert_same_copies(multi, single)


@pytest.fixture(scope="module")
def cls_lib(tmp_path_factory):
    names = [f"fused_classifier_{t}{v}" for t in ("bf16", "f32") for v in ("", "_scalar", "_warp", "_scalar_warp")]
    return _library(tmp_path_factory, "classifier", names)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("n,v", [(11, 256), (9, 4099), (3, 4104), (2, 120000)])  # warp, scalar, block, cached
def test_emulated_classifier_abs_max_equals_abs_max_of_its_dlogits(cls_lib, fp8_lib, monkeypatch, dtype, n, v):
    """The max|dlogits| the fused classifier records is bitwise fp8.abs_max over the dlogits it wrote (the
    FP8 LM head's separate pass), in every kernel variant; losses, lse and dlogits are those of the launch
    without abs_max (the slot changes nothing else)."""
    g = np.random.default_rng(n + v)
    x = g.standard_normal((n, v)) * 4
    targets = g.integers(0, v, n).astype(np.int32)
    targets[::4] = -1
    libs = {"classifier": cls_lib, "fp8": fp8_lib}
    calls = []

    def launch(family, name, *a, **kw):
        calls.append(name)
        emu.launch(libs[family], family, name, *a, **kw)

    monkeypatch.setattr(classifier._build, "launch", launch)
    out = {}
    for fused in (False, True):
        t = {"logits": emu.tensor(x, dtype, "logits"), "losses": emu.tensor(np.zeros(n), "fp32", "losses"),
             "lse": emu.tensor(np.zeros(n), "fp32", "lse"), "targets": emu.tensor(targets, "int32", "targets"),
             "amax": emu.tensor(np.zeros(1), "fp32", "amax")}  # fmt: skip
        classifier.fused_classifier(t["logits"], t["losses"], t["lse"], t["targets"], 1.0 / n,
                                    abs_max=t["amax"] if fused else None)  # fmt: skip
        for k, tt in t.items():
            assert emu.margins_ok(tt), k
        out[fused] = {k: tt.numpy() for k, tt in t.items()}
    for k in ("logits", "losses", "lse"):
        np.testing.assert_array_equal(out[True][k].view(np.uint8), out[False][k].view(np.uint8), err_msg=k)
    sep = emu.tensor(np.zeros(1), "fp32", "sep")
    fp8.abs_max(sep, emu.tensor(out[False]["logits"], dtype, "dlogits"))
    assert out[True]["amax"].view(np.uint32)[0] == sep.numpy().view(np.uint32)[0] != 0
    assert out[False]["amax"][0] == 0
    kind = "_warp" if v <= 4096 else ""
    assert calls[0].startswith("fused_classifier_") and calls[0].endswith(kind), calls


# (rows, V, compute capability major): a row shorter than one 16-byte vector per thread, all of it in shared memory;
# a row longer than the 224 KB cache (bf16: one tail vector on some threads; fp32: more tail vectors than
# slots, so pass 2 reuses each slot); and the 32 KB cache of other devices (two slots, a tail waited for one
# vector at a time).
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("n,v,cc", [(4, 4104, 9), (4, 120000, 9), (4, 40000, 8)])
def test_emulated_classifier_pipelined_matches_the_twin(cls_lib, monkeypatch, dtype, n, v, cc):
    """The 16-byte block kernel (cp.async head, tail loaded ahead, tail re-read into freed slots) against the
    twin: dlogits, lse and losses, a target in the tail, an ignored row (zero gradient, loss untouched), a bad
    target (NaN loss); a row whose elements 89 below its lse get their subnormal gradient, as exp2f gives it
    and MUFU.EX2 alone would flush to 0. Copies landing at issue with warps at random speeds (eager) give the
    same bits as copies landing at the wait; the forward-only launch gives the same lse and losses."""
    g = np.random.default_rng(v + cc)
    x = g.standard_normal((n, v)) * 3
    x[1] = g.standard_normal(v)
    lse1 = np.log(np.exp(x[1]).sum())
    x[1, 3::7] = np.round(lse1) - 89
    targets = np.array([v - 1, 5, -1, v], np.int32)
    losses0 = np.linspace(0.5, 2, n)
    calls = []

    def launch(family, name, *a, **kw):
        calls.append(name)
        emu.launch(cls_lib, family, name, *a, **kw)

    monkeypatch.setattr(classifier._build, "launch", launch)
    monkeypatch.setattr(emu.DEV, "compute_capability", (cc, 0))
    out = {}
    for eager, write in ((0, True), (1, True), (0, False)):
        t = {"logits": emu.tensor(x, dtype, "logits"), "losses": emu.tensor(losses0, "fp32", "losses"),
             "lse": emu.tensor(np.zeros(n), "fp32", "lse"),
             "targets": emu.tensor(targets, "int32", "targets")}  # fmt: skip
        cls_lib.emu_set_eager(eager)
        try:
            classifier.fused_classifier(t["logits"], t["losses"], t["lse"], t["targets"], 1 / 3, 1e-3, write)
        finally:
            cls_lib.emu_set_eager(0)
        for k, tt in t.items():
            assert emu.margins_ok(tt), k
        out[eager, write] = {k: tt.numpy() for k, tt in t.items()}
    assert calls == [_build.kernel_name("fused_classifier", ce.dtype(dtype))] * 3
    for k in ("logits", "losses", "lse"):
        np.testing.assert_array_equal(out[1, True][k].view(np.uint8), out[0, True][k].view(np.uint8), err_msg=k)
    for k in ("losses", "lse"):
        np.testing.assert_array_equal(out[0, False][k].view(np.uint8), out[0, True][k].view(np.uint8), err_msg=k)
    np.testing.assert_array_equal(out[0, False]["logits"], x.astype(ce.dtype(dtype).np))
    got = out[0, True]
    want = {"logits": x.astype(ce.dtype(dtype).np), "losses": losses0.astype(np.float32),
            "lse": np.zeros(n, np.float32)}  # fmt: skip
    classifier.fused_classifier_reference(want["logits"], want["losses"], want["lse"], targets, np.float32(1 / 3), 1e-3)
    assert_close(got["logits"], want["logits"], dtype, "dlogits", scale=1e-9)
    assert_close(got["lse"], want["lse"], "fp32", "lse")
    assert_close(got["losses"][:3], want["losses"][:3], "fp32", "losses")
    assert got["losses"][2] == np.float32(losses0[2]) and np.isnan(got["losses"][3])
    assert np.all(got["logits"][2] == 0) and got["logits"][0, -1] < 0 and got["logits"][1, 5] < 0
    tiny = got["logits"][1, 3::7].astype(np.float32)
    assert np.all((tiny > 0) & (tiny < np.finfo(np.float32).tiny)), tiny[:8]


def test_emulated_classifier_pipelined_pass1_adds_subnormal_terms(cls_lib, monkeypatch):
    """Pass 1 of the pipelined kernel adds the exp2f values, subnormal ones included, where MUFU.EX2 alone
    would flush them: thread 0's first group of an fp32 row holds exact powers of two (x log2(e) rounds to an
    integer) 2^-127 nine times, 2^-121 twice, then 2^-96, 2^-72, 2^-48, 2^-24 and 1, each sum after the
    subnormals a rounding tie they tip upwards, so that the row's sum is 1 + 2^-23 with them and 1 without
    (lse > 0 against lse = 0); the rest of the row (-1000) adds 0."""
    log2e = np.float32(1.4426950408889634)

    def exact(k):  # an fp32 x whose x * log2(e), rounded to fp32, is k
        x = np.float32(k / float(log2e))
        for _ in range(16):
            if np.float32(np.float64(x) * np.float64(log2e)) == k:
                return x
            x = np.nextafter(x, np.float32(np.inf) if x * log2e < k else np.float32(-np.inf), dtype=np.float32)
        raise AssertionError(k)

    v = 16384
    x = np.full((1, v), -1000, np.float32)
    group = [u * 4096 + k for u in range(4) for k in range(4)]  # thread 0's first group (1024 threads, 4 floats)
    x[0, group] = [exact(k) for k in [-127] * 9 + [-121] * 2 + [-96, -72, -48, -24, 0]]
    calls = []

    def launch(family, name, *a, **kw):
        calls.append(name)
        emu.launch(cls_lib, family, name, *a, **kw)

    monkeypatch.setattr(classifier._build, "launch", launch)
    t = {"logits": emu.tensor(x, "fp32", "logits"), "losses": emu.tensor(np.zeros(1), "fp32", "losses"),
         "lse": emu.tensor(np.zeros(1), "fp32", "lse"), "targets": emu.tensor([5], "int32", "targets")}  # fmt: skip
    classifier.fused_classifier(t["logits"], t["losses"], t["lse"], t["targets"], 1.0, write_dlogits=False)
    assert calls == ["fused_classifier_f32"]
    assert t["lse"].numpy()[0] > 0, t["lse"].numpy()  # log(1 + 2^-23), where a sum of 1 gives 0


@pytest.fixture(scope="module")
def a8_lib(tmp_path_factory):
    return emu.or_skip(emu.adamw8bit_launcher(tmp_path_factory.mktemp("adamw8bit_emu")))


# A tensor smaller than one quantization block, exact blocks, tails, one over two launch blocks (8192 elements).
A8_SIZES = [1, 37, 256, 257, 1000, 8192 + 300, 512]
A8_ROLES = ("param", "grad", "qm", "qv", "absmax_m", "absmax_v")


def _a8_tensors(pdtype, gdtype):
    """Per tensor {role: host array}, moments as codes of random fp32 moments."""
    from cuengine.kernels import adamw8bit as A8

    out = []
    for k, n in enumerate(A8_SIZES):
        g = np.random.default_rng(k)
        qm, am = A8.quantize_reference(g.standard_normal(n).astype(np.float32) * 1e-3, True)
        qv, av = A8.quantize_reference((g.standard_normal(n).astype(np.float32) * 1e-3) ** 2, False)
        p = (g.standard_normal(n) * 0.1).astype(ce.dtype(pdtype).np)
        gr = (g.standard_normal(n) * 1e-2).astype(ce.dtype(gdtype).np)
        out.append({"param": p, "grad": gr, "qm": qm, "qv": qv, "absmax_m": am, "absmax_v": av})
    return out


@pytest.mark.parametrize("scale", [0.7, np.nan])
@pytest.mark.parametrize("pdtype,gdtype", [("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp32"), ("fp32", "bf16")])
def test_emulated_adamw8bit_multi_equals_per_tensor_launches(a8_lib, monkeypatch, pdtype, gdtype, scale):
    """adamw8bit_update_multi over tensors of mixed sizes (one launch) gives the bits of one
    adamw8bit_update launch per tensor: params (bf16 stochastic rounding with each tensor's seed),
    codes and block abs-maxes; a NaN clip scale writes nothing. The per-tensor kernel equals the twin."""
    from cuengine.kernels import adamw
    from cuengine.kernels import adamw8bit as A8

    calls = []

    def launch(*args, **kw):
        calls.append(args[1])
        a8_lib(*args, **kw)

    monkeypatch.setattr(_build, "launch", launch)
    arrays = _a8_tensors(pdtype, gdtype)
    hp = adamw.make_hparams(1e-2, 0.9, 0.95, 1e-8, 0.1, 3)
    decays = [k % 2 == 0 for k in range(len(A8_SIZES))]
    seeds = [(11 + 7919 * k) & 0x7FFFFFFF for k in range(len(A8_SIZES))]
    shared = {"qmaps": emu.tensor(A8.make_qmaps(), "fp32", "qmaps"), "hparams": emu.tensor(hp, "fp32", "hparams"),
              "scale": emu.tensor(np.array([scale]), "fp32", "scale")}  # fmt: skip

    def tensors():
        return [{r: emu.tensor(a[r], "u8" if r in ("qm", "qv") else (pdtype if r == "param" else gdtype)
                               if r in ("param", "grad") else "fp32", f"{r}{k}") for r in A8_ROLES}
                for k, a in enumerate(arrays)]  # fmt: skip

    single = tensors()
    for t, wd, seed in zip(single, decays, seeds):
        A8.adamw8bit_update(*(t[r] for r in A8_ROLES), shared["qmaps"], shared["hparams"], shared["scale"], wd, seed)
    assert calls == [_build.kernel_name("adamw8bit", ce.dtype(pdtype), ce.dtype(gdtype))] * len(A8_SIZES)
    multi = tensors()
    table = emu.tensor(np.zeros(A8.multi_tensor_table_shape(A8_SIZES)), "u8", "table")
    tab = A8.AdamW8bitTable(table, *([t[r] for t in multi] for r in A8_ROLES), decays, seeds)
    calls.clear()
    A8.adamw8bit_update_multi(tab, shared["qmaps"], shared["hparams"], shared["scale"])
    assert calls == [_build.kernel_name("adamw8bit_multi", ce.dtype(pdtype), ce.dtype(gdtype))]
    assert tab.chunks == sum(-(-n // 8192) for n in A8_SIZES)
    for k, (s, m, a) in enumerate(zip(single, multi, arrays)):
        want = A8.adamw8bit_reference(*(a[r] for r in A8_ROLES), hp, scale, decays[k], seeds[k])
        for r, w in zip(("param", "qm", "qv", "absmax_m", "absmax_v"), want):
            assert emu.margins_ok(m[r]) and emu.margins_ok(s[r]), f"{r}{k}: written out of bounds"
            np.testing.assert_array_equal(m[r].numpy().view(np.uint8), s[r].numpy().view(np.uint8), err_msg=f"{r}{k}")
            np.testing.assert_array_equal(s[r].numpy().view(np.uint8), w.view(np.uint8), err_msg=f"twin {r}{k}")
            if np.isnan(scale):
                np.testing.assert_array_equal(m[r].numpy().view(np.uint8), a[r].view(np.uint8), err_msg=f"{r}{k}")
    if not np.isnan(scale):
        assert not np.array_equal(multi[-2]["param"].numpy(), arrays[-2]["param"])


@pytest.fixture(scope="module")
def rope_lib(tmp_path_factory):
    return _library(tmp_path_factory, "rope", [f"rope_{t}_{f}" for t in ("f32", "bf16", "f16") for f in ("f32", "f16")])


# (B, T, Hq, Hkv, hs, dtype, table dtype). Heads go in pairs: H = Hq + 2 Hkv odd leaves the last pair
# one head short, Hq + Hkv odd pairs the last k head with a v head; hv = hs / 2 / (16-byte vector) of 6
# or 3 divides no stride of 128-thread blocks, so every digit of the grid-stride counter carries.
ROPE_CASES = [(2, 100, 4, 2, 32, "bf16", "fp16"), (3, 40, 3, 1, 96, "bf16", "fp32"), (2, 100, 2, 1, 24, "fp32", "fp32"),
              (2, 50, 6, 2, 48, "fp16", "fp16"), (1, 45, 14, 2, 64, "bf16", "fp16")]  # fmt: skip


@pytest.mark.parametrize("aligned_table", [True, False])
@pytest.mark.parametrize("in_place,with_abs_max", [(False, False), (True, False), (True, True), (False, True)])
@pytest.mark.parametrize("case", ROPE_CASES)
def test_emulated_rope_equals_the_twin(rope_lib, monkeypatch, case, in_place, with_abs_max, aligned_table):
    """rope.cu (two heads per thread, loads before stores, the grid-stride counter) gives the twin's bits,
    forward and backward, in place or not, with the table read as vectors or (misaligned) as scalars;
    abs_max is max|out| over the whole output, v heads included. One block per SM (4): each thread
    loops over several items."""
    from cuengine.kernels import rope as RP

    B, T, hq, hkv, hs, dtype, table = case
    calls = []
    monkeypatch.setattr(RP, "launch", lambda *a, **kw: calls.append(a[2]) or emu.launch(rope_lib, *a, **kw))
    monkeypatch.setattr(RP, "_BLOCKS_PER_SM", 1)
    g = np.random.default_rng(hs + T)
    H = hq + 2 * hkv
    x = g.standard_normal((B, T, H * hs)) * 2
    x[-1, -1, -1] = 40.0  # the largest |x| in the last v head: abs_max must see it, unrotated
    freqs = RP.rope_freqs(T + 3, hs, 1e4, ce.dtype(table).np)
    itemsize = ce.dtype(table).itemsize
    f = emu.tensor(freqs, table, "freqs", pad=4096 if aligned_table else 4096 + itemsize)
    assert (f.ptr % 16 == 0) == aligned_table
    for inverse, fn in ((False, RP.rope_forward), (True, RP.rope_backward)):
        inp = emu.tensor(x, dtype, "inp")
        out = inp if in_place else emu.tensor(np.full(x.shape, 1234.5), dtype, "out")
        amax = emu.tensor(np.zeros(1), "fp32", "amax") if with_abs_max else None
        calls.clear()
        fn(out, inp, f, hq, hkv, abs_max=amax)
        want = RP.rope_np(x.astype(ce.dtype(dtype).np), freqs, hq, hkv, inverse)
        np.testing.assert_array_equal(out.numpy().view(np.uint8), want.view(np.uint8), err_msg=f"inverse={inverse}")
        for t in (out, inp, f) + ((amax,) if amax is not None else ()):
            assert emu.margins_ok(t), f"{t.name}: written out of bounds"
        if amax is not None:
            assert amax.numpy()[0] == np.abs(want.astype(np.float32)).max() == 40.0
        pairs = -(-(H if not in_place or with_abs_max else hq + hkv) // 2)
        items = B * T * pairs * hs // 2 // (16 // ce.dtype(dtype).itemsize)
        assert calls == [4] and items >= 2 * 4 * 128, (calls, items)  # two or more items per thread
