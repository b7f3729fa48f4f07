"""AdamW: float64 reference over several steps, stochastic rounding, seeds, devices."""

import itertools
import shutil

import numpy as np
import pytest
from conftest import assert_close, rng

import cuengine as ce
from cuengine.kernels import _build, fp8
from cuengine.kernels.adamw import (
    CHUNK,
    MultiTensorTable,
    adamw_reference,
    adamw_update,
    adamw_update_multi,
    global_norm_squared_multi,
    make_hparams,
    sr_bits,
    stochastic_round_bf16,
)
from cuengine.kernels.adamw import multi_tensor_table_shape as table_shape
from cuengine.kernels.norm import NORM_SLOTS, global_norm_squared, norm_partials_shape

LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.95, 1e-8, 0.1


def reference64(p, g, m, v, steps, grad_scale=1.0, wd=WD, lr=LR):
    """Independent float64 AdamW with decoupled weight decay, `steps` steps on the same grad."""
    p, m, v = (a.astype(np.float64) for a in (p, m, v))
    g = g.astype(np.float64) * grad_scale
    for t in range(1, steps + 1):
        m = B1 * m + (1 - B1) * g
        v = B2 * v + (1 - B2) * g * g
        mhat, vhat = m / (1 - B1**t), v / (1 - B2**t)
        p = p - lr * (mhat / (np.sqrt(vhat) + EPS) + wd * p)
    return p, m, v


def state(n, seed=0, dtypes=("fp32",) * 4):
    r = rng(seed)
    p = r.standard_normal(n) * 0.02
    g = r.standard_normal(n) * 0.01
    m = r.standard_normal(n) * 1e-3
    v = r.random(n) * 1e-4 + 1e-6
    return [a.astype(ce.dtype(d).np) for a, d in zip((p, g, m, v), dtypes)]


def run(dev, arrays, steps, grad_scale=None, wd_on=True, seed=1234, unaligned=False, lr=LR):
    """`steps` updates on `dev`; returns (param, m, v) as NumPy arrays."""

    def tensor(a, name):
        if unaligned:  # start 1 element past an aligned address: the scalar kernels
            return ce.Tensor.from_numpy(np.concatenate([np.zeros(1, a.dtype), a]), dev, name=name)[1:]
        return ce.Tensor.from_numpy(a, dev, name=name)

    p, g, m, v = (tensor(a, k) for a, k in zip(arrays, "pgmv"))
    hp = ce.Tensor.empty(ce.FP32, (8,), dev, name="hparams")
    gs = None if grad_scale is None else ce.Tensor.from_numpy(np.array([grad_scale], np.float32), dev)
    for step in range(1, steps + 1):
        hp.copy_from_numpy(make_hparams(lr, B1, B2, EPS, WD, step))
        adamw_update(p, g, m, v, hp, gs, wd_on, seed)
    return p.numpy(), m.numpy(), v.numpy()


# ---- cpu: the twin against float64 ------------------------------------------------------------
@pytest.mark.parametrize("wd_on", [True, False])
@pytest.mark.parametrize("grad_scale", [None, 0.25])
def test_twin_matches_float64(wd_on, grad_scale):
    arrays = state(1000)
    p, m, v = run(ce.device("cpu"), arrays, 5, grad_scale, wd_on)
    rp, rm, rv = reference64(*arrays, 5, 1.0 if grad_scale is None else grad_scale, WD if wd_on else 0.0)
    np.testing.assert_allclose(p, rp, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(m, rm, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(v, rv, rtol=1e-5, atol=1e-10)


@pytest.mark.parametrize("dtypes", [("bf16", "bf16", "fp32", "fp32"), ("bf16", "fp32", "bf16", "bf16")])
def test_twin_bf16_state_close_to_float64(dtypes):
    arrays = state(4096, dtypes=dtypes)
    p, m, v = run(ce.device("cpu"), arrays, 3)
    rp, rm, rv = reference64(*arrays, 3)
    for got, want, dt in zip((p, m, v), (rp, rm, rv), dtypes[:1] + dtypes[2:]):
        assert_close(got, want, dt, scale=float(np.abs(want).max()))


def test_stochastic_rounding_is_unbiased():
    """Many identical elements: the mean of the bf16 results is the fp32 result, which RNE
    would miss by far more than the tolerance."""
    n = 200_000
    p0 = np.full(n, 0.5, np.float32)  # bf16 ulp at 0.5 is 2**-8
    g = np.full(n, 1.0, np.float32)
    m = v = np.zeros(n, np.float32)
    hp = make_hparams(3e-4, B1, B2, EPS, 0.0, 1)  # step 1: the update is about lr * sign(g)
    exact, _, _ = adamw_reference(p0, g, m, v, hp, None, False, seed=7)
    rounded, _, _ = adamw_reference(p0.astype(ce.BF16.np), g, m, v, hp, None, False, seed=7)
    values = rounded.astype(np.float64)
    ulp = 2.0**-9  # the result lies just below 0.5, where the bf16 ulp halves
    assert set(np.unique(values)) == {0.5 - ulp, 0.5}
    tol = 5 * ulp / (2 * np.sqrt(n))
    assert abs(values.mean() - exact[0]) < tol
    assert abs(float(np.float32(exact[0]).astype(ce.BF16.np)) - exact[0]) > 10 * tol  # RNE would fail


def test_stochastic_rounding_of_moments_is_unbiased():
    n = 100_000
    x = np.full(n, 1.0 + 2.0**-9, np.float32)  # a quarter of a bf16 ulp (2**-7) above 1
    out = stochastic_round_bf16(x, sr_bits(3, 1, 1, np.arange(n))).astype(np.float64)
    assert abs(out.mean() - x[0]) < 5 * 2.0**-7 / (2 * np.sqrt(n))
    assert 0.2 < np.mean(out > 1) < 0.3


def test_stochastic_rounding_keeps_non_finite():
    x = np.array([np.inf, -np.inf, np.nan, 3.0e38], np.float32)
    out = stochastic_round_bf16(x, np.full(4, 0xFFFF, np.uint32)).astype(np.float32)
    assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2])


def test_seeded_and_reproducible():
    arrays = state(5000, dtypes=("bf16", "bf16", "bf16", "bf16"))
    cpu = ce.device("cpu")
    a = run(cpu, arrays, 2, seed=11)
    b = run(cpu, arrays, 2, seed=11)
    c = run(cpu, arrays, 2, seed=12)
    for x, y, z in zip(a, b, c):
        np.testing.assert_array_equal(x.view(np.uint16), y.view(np.uint16))
        assert np.any(x.view(np.uint16) != z.view(np.uint16))


def test_random_bits_vary_with_every_input():
    idx = np.arange(4096)
    base = sr_bits(1, 1, 0, idx)
    for other in (sr_bits(2, 1, 0, idx), sr_bits(1, 2, 0, idx), sr_bits(1, 1, 1, idx), sr_bits(1, 1, 0, idx + 2**32)):
        assert np.mean(base == other) < 0.01
    low = base & 0xFFFF
    assert abs(low.mean() / 65535 - 0.5) < 0.02  # roughly uniform rounding thresholds


def test_fp32_state_is_not_randomised():
    arrays = state(300)
    a = run(ce.device("cpu"), arrays, 2, seed=1)
    b = run(ce.device("cpu"), arrays, 2, seed=2)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


# ---- cpu: error paths -------------------------------------------------------------------------
def _args(**override):
    cpu = ce.device("cpu")
    t = {
        "param": ce.Tensor.empty(ce.BF16, (4, 8), cpu, name="param"),
        "grad": ce.Tensor.empty(ce.BF16, (4, 8), cpu, name="grad"),
        "m": ce.Tensor.empty(ce.FP32, (32,), cpu, name="m"),
        "v": ce.Tensor.empty(ce.FP32, (32,), cpu, name="v"),
        "hparams": ce.Tensor.empty(ce.FP32, (8,), cpu, name="hparams"),
        "grad_scale": ce.Tensor.empty(ce.FP32, (1,), cpu, name="gs"),
    }
    for k, (dt, shape) in override.items():
        t[k] = ce.Tensor.empty(dt, shape, cpu, name=k)
    return t


@pytest.mark.parametrize(
    "override,match",
    [
        ({"param": (ce.FP16, (4, 8))}, r"param: expected dtype fp32/bf16"),
        ({"grad": (ce.INT32, (4, 8))}, r"grad: expected dtype fp32/bf16"),
        ({"m": (ce.FP8_E4M3, (32,))}, r"m: expected dtype fp32/bf16"),
        ({"v": (ce.FP16, (32,))}, r"v: expected dtype fp32/bf16"),
        ({"grad": (ce.BF16, (4, 9))}, r"grad 'grad' \(4, 9\) bf16 has 36 elements, param 'param' \(4, 8\) has 32"),
        ({"m": (ce.FP32, (31,))}, r"m 'm' \(31,\) fp32 has 31 elements"),
        ({"v": (ce.FP32, (33,))}, r"v 'v' \(33,\) fp32 has 33 elements"),
        ({"hparams": (ce.FP32, (7,))}, r"hparams: expected shape \(8\)"),
        ({"hparams": (ce.BF16, (8,))}, r"hparams: expected dtype fp32"),
        ({"grad_scale": (ce.FP32, (2,))}, r"grad_scale: expected shape \(1\)"),
    ],
)
def test_bad_arguments(override, match):
    t = _args(**override)
    with pytest.raises(ValueError, match=match):
        adamw_update(t["param"], t["grad"], t["m"], t["v"], t["hparams"], t["grad_scale"], True, 0)


# ---- cuda against the twin ----------------------------------------------------------------------
COMBOS = list(itertools.product(["fp32", "bf16"], repeat=4))  # param, grad, m, v


def _compare(cuda, cpu, dtypes):
    for got, want, dt in zip(cuda, cpu, (dtypes[0], dtypes[2], dtypes[3])):
        assert_close(got, want, dt, scale=float(np.abs(want.astype(np.float64)).max()) + 1e-30)
        # The twin makes the same fp32 roundings and draws the same bits: nearly all agree exactly.
        assert np.mean(got == want) > 0.999, f"{dt}: too many results differ from the twin"


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", COMBOS, ids=lambda d: "-".join(d))
@pytest.mark.parametrize("n", [1, 37, 760 * 3 + 5, 8192 * 7])
def test_cuda_matches_cpu(dtypes, n):
    arrays = state(n, seed=n, dtypes=dtypes)
    cpu = run(ce.device("cpu"), arrays, 3, grad_scale=0.5, seed=n)
    cuda = run(ce.device("cuda"), arrays, 3, grad_scale=0.5, seed=n)
    _compare(cuda, cpu, dtypes)


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", [("bf16", "bf16", "bf16", "bf16"), ("fp32", "bf16", "fp32", "fp32")])
@pytest.mark.parametrize("wd_on", [True, False])
def test_cuda_unaligned_and_no_scale(dtypes, wd_on):
    arrays = state(1128 * 37, seed=3, dtypes=dtypes)
    cpu = run(ce.device("cpu"), arrays, 2, wd_on=wd_on, unaligned=True)
    cuda = run(ce.device("cuda"), arrays, 2, wd_on=wd_on, unaligned=True)
    _compare(cuda, cpu, dtypes)


@pytest.mark.gpu
def test_cuda_captured_graph_follows_hparams(cuda):
    """One captured update replayed with new hparams equals eager updates."""
    arrays = state(4099, dtypes=("bf16", "bf16", "fp32", "fp32"))
    eager = run(cuda, arrays, 3)
    p, g, m, v = (ce.Tensor.from_numpy(a, cuda) for a in arrays)
    hp = ce.Tensor.empty(ce.FP32, (8,), cuda)
    graph = cuda.capture(lambda: adamw_update(p, g, m, v, hp, None, True, 1234))
    for step in range(1, 4):
        hp.copy_from_numpy(make_hparams(LR, B1, B2, EPS, WD, step))
        graph.launch()
    for got, want in zip((p.numpy(), m.numpy(), v.numpy()), eager):
        np.testing.assert_array_equal(got, want)


# ---- multi-tensor: one launch over a table of tensors ---------------------------------------------------
# (size, weight decay, index offset, unaligned): two chunks of adamw_multi, tails, an empty tensor
MULTI = [(37, True, 0, False), (1, False, 5, False), (0, True, 0, False), (2285, False, 0, True),
         (CHUNK + 13, True, 7, False), (4099, True, 0, True), (8, False, 1 << 33, False)]  # fmt: skip


def _multi_tensors(make, dtypes, sizes=MULTI, seed=0):
    """[(param, grad, m, v)] made by `make(array, dtype, name)`, unaligned ones one element past an aligned start."""
    out = []
    for k, (n, _, _, unaligned) in enumerate(sizes):
        arrays = state(n, seed=seed + k, dtypes=dtypes)
        out.append(tuple(make(a, d, f"{r}{k}", unaligned) for a, d, r in zip(arrays, dtypes, "pgmv")))
    return out


def _host_tensor(dev):
    def make(a, dtype, name, unaligned):
        a = np.asarray(a).astype(ce.dtype(dtype).np)
        if unaligned:
            return ce.Tensor.from_numpy(np.concatenate([np.zeros(1, a.dtype), a]), dev, name=name)[1:]
        return ce.Tensor.from_numpy(a, dev, name=name)

    return make


def _run_both(dev, make, dtypes, table_bytes, steps=2, grad_scale=0.5, sizes=MULTI):
    """The same tensors updated per tensor and through one table: [(p, m, v)] of each, as NumPy arrays."""
    seeds = [(1234 + 7919 * k) & 0x7FFFFFFF for k in range(len(sizes))]
    per, multi = _multi_tensors(make, dtypes, sizes), _multi_tensors(make, dtypes, sizes)
    hp = make(np.zeros(8), "fp32", "hparams", False)
    gs = make(np.array([grad_scale]), "fp32", "gs", False)
    p, g, m, v = (list(x) for x in zip(*multi))
    flags, offs = [s[1] for s in sizes], [s[2] for s in sizes]
    table = MultiTensorTable(table_bytes([t.nelem for t in p]), g, p, m, v, flags, seeds, offs)
    for step in range(1, steps + 1):
        hp.copy_from_numpy(make_hparams(LR, B1, B2, EPS, WD, step))
        for (tp, tg, tm, tv), wd, seed, off in zip(per, flags, seeds, offs):
            adamw_update(tp, tg, tm, tv, hp, gs, wd, seed, off)
        adamw_update_multi(table, hp, gs)
    return [[(t[0].numpy(), t[2].numpy(), t[3].numpy()) for t in ts] for ts in (per, multi)]


def _assert_bitwise(per, multi):
    for k, (a, b) in enumerate(zip(per, multi)):
        for x, y, what in zip(a, b, ("param", "m", "v")):
            np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=f"tensor {k} {what}")


@pytest.mark.parametrize("dtypes", [("bf16", "bf16", "fp32", "fp32"), ("fp32", "bf16", "bf16", "bf16")])
def test_multi_tensor_update_equals_per_tensor_cpu(dtypes):
    cpu = ce.device("cpu")
    per, multi = _run_both(cpu, _host_tensor(cpu), dtypes, lambda ns: ce.Tensor.empty(ce.BYTE, table_shape(ns), cpu))
    _assert_bitwise(per, multi)
    assert any(not np.array_equal(a[0], b) for a, b in zip(per, [s for s in state(37, dtypes=dtypes)[:1]]))


BIG = 1000.0  # the last tensor's slot starts above any |w|: the slot max-accumulates, it is not overwritten


def _run_with_slots(dev, make, dtypes, table_bytes, steps=2, grad_scale=0.5, sizes=MULTI):
    """`_run_both`'s multi-tensor run with an abs-max slot on every tensor but the second, zeroed before
    each step (the last one set to BIG): ([(p, m, v)] as NumPy arrays, the params, the slots)."""
    seeds = [(1234 + 7919 * k) & 0x7FFFFFFF for k in range(len(sizes))]
    multi = _multi_tensors(make, dtypes, sizes)
    hp = make(np.zeros(8), "fp32", "hparams", False)
    gs = make(np.array([grad_scale]), "fp32", "gs", False)
    p, g, m, v = (list(x) for x in zip(*multi))
    slots = [None if k == 1 else make(np.zeros(1), "fp32", f"amax{k}", False) for k in range(len(sizes))]
    flags, offs = [s[1] for s in sizes], [s[2] for s in sizes]
    table = MultiTensorTable(table_bytes([t.nelem for t in p]), g, p, m, v, flags, seeds, offs, abs_maxes=slots)
    for step in range(1, steps + 1):
        hp.copy_from_numpy(make_hparams(LR, B1, B2, EPS, WD, step))
        for k, a in enumerate(slots):
            if a is not None:
                a.copy_from_numpy(np.array([BIG if k == len(sizes) - 1 else 0.0], np.float32))
        adamw_update_multi(table, hp, gs)
    return [(t[0].numpy(), t[2].numpy(), t[3].numpy()) for t in multi], p, slots


def _assert_slots(params, slots, abs_max_of):
    """Every slot holds abs_max_of(param) (bitwise), but the last one BIG and the second none."""
    for k, (x, a) in enumerate(zip(params, slots)):
        if a is None:
            continue
        want = np.float32(BIG) if k == len(slots) - 1 else abs_max_of(x)
        assert a.numpy().view(np.uint32)[0] == np.float32(want).view(np.uint32), (k, a.numpy(), want)


@pytest.mark.parametrize("grad_scale", [0.5, np.nan])
def test_multi_tensor_update_records_abs_max_of_new_params_cpu(grad_scale):
    cpu = ce.device("cpu")
    dtypes = ("bf16", "bf16", "fp32", "fp32")
    table_bytes = lambda ns: ce.Tensor.empty(ce.BYTE, table_shape(ns), cpu)  # noqa: E731
    per, _ = _run_both(cpu, _host_tensor(cpu), dtypes, table_bytes, grad_scale=grad_scale)
    got, params, slots = _run_with_slots(cpu, _host_tensor(cpu), dtypes, table_bytes, grad_scale=grad_scale)
    _assert_bitwise(per, got)  # the slots change nothing else
    _assert_slots(params, slots, lambda x: np.abs(x.numpy().astype(np.float32)).max(initial=0))
    assert slots[0].numpy()[0] > 0


def _norm_both(dev, make, table_bytes, dtype="bf16", sizes=MULTI):
    """partials of one global_norm_squared launch per grad (zeroed first) and of the multi-tensor pass."""
    grads = [t[1] for t in _multi_tensors(make, ("fp32", dtype, "fp32", "fp32"), sizes)]
    per = make(np.zeros(norm_partials_shape()), "fp32", "per", False)
    for g in grads:
        global_norm_squared(per, g)
    table = MultiTensorTable(table_bytes([g.nelem for g in grads]), grads)
    multi = make(np.full(norm_partials_shape(), np.nan), "fp32", "multi", False)  # written, not added to
    sums = make(np.full(table.norm_sums_shape(), np.nan), "fp32", "sums", False)
    global_norm_squared_multi(multi, sums, table)
    return per.numpy(), multi.numpy(), grads


def test_multi_tensor_norm_equals_per_tensor_cpu():
    cpu = ce.device("cpu")
    per, multi, grads = _norm_both(cpu, _host_tensor(cpu), lambda ns: ce.Tensor.empty(ce.BYTE, table_shape(ns), cpu))
    np.testing.assert_array_equal(per.view(np.uint32), multi.view(np.uint32))
    want = sum(float(np.square(g.numpy().astype(np.float64)).sum()) for g in grads)
    np.testing.assert_allclose(multi.sum(dtype=np.float64), want, rtol=1e-5)


def _table_args(**override):
    cpu = ce.device("cpu")
    t = {r: [ce.Tensor.empty(ce.BF16 if r in "pg" else ce.FP32, (4, 8), cpu, name=f"{r}{i}") for i in range(2)]
         for r in "pgmv"}  # fmt: skip
    t["table"] = ce.Tensor.empty(ce.BYTE, table_shape([32, 32]), cpu, name="table")
    t.update(override)
    return t


@pytest.mark.parametrize(
    "override,match",
    [
        ({"g": []}, r"MultiTensorTable: no tensors"),
        ({"m": [ce.Tensor.empty(ce.FP32, (32,), "cpu", name="m0")]}, r"ms has 1 entries, grads has 2"),
        ({"v": [ce.Tensor.empty(ce.FP32, (32,), "cpu", name="v0"), ce.Tensor.empty(ce.BF16, (32,), "cpu", name="vb")]},
         r"v 'vb' is bf16 but 'v0' is fp32; one table holds one dtype per role"),
        ({"m": [ce.Tensor.empty(ce.FP32, (32,), "cpu", name="m0"), ce.Tensor.empty(ce.FP32, (31,), "cpu", name="m1")]},
         r"m 'm1' \(31,\) fp32 has 31 elements, param 'p1' \(4, 8\) has 32"),
        ({"p": [ce.Tensor.empty(ce.FP16, (32,), "cpu", name="h"), ce.Tensor.empty(ce.FP16, (32,), "cpu", name="h1")]},
         r"MultiTensorTable: param: expected dtype fp32/bf16, got tensor 'h' fp16"),
        ({"table": ce.Tensor.empty(ce.BYTE, (64,), "cpu", name="table")}, r"table: expected shape \(160\)"),
        ({"a": [None]}, r"MultiTensorTable: abs_maxes has 1 entries, grads has 2"),
        ({"a": [None, ce.Tensor.empty(ce.FP32, (2,), "cpu", name="a1")]},
         r"MultiTensorTable: abs_maxes: expected shape \(1\), got tensor 'a1' \(2,\)"),
        ({"a": [ce.Tensor.empty(ce.BF16, (1,), "cpu", name="a0"), None]},
         r"MultiTensorTable: abs_maxes: expected dtype fp32, got tensor 'a0' bf16"),
    ],
)  # fmt: skip
def test_multi_tensor_table_bad_arguments(override, match):
    t = _table_args(**override)
    with pytest.raises(ValueError, match=match):
        MultiTensorTable(t["table"], t["g"], t["p"], t["m"], t["v"], [True] * len(t["g"]), [1] * len(t["g"]),
                         abs_maxes=t.get("a"))  # fmt: skip


def test_norm_only_table_refuses_an_update():
    t = _table_args()
    table = MultiTensorTable(t["table"], t["g"])
    hp = ce.Tensor.empty(ce.FP32, (8,), "cpu")
    with pytest.raises(ValueError, match="adamw_update_multi: the table was built for the norm alone"):
        adamw_update_multi(table, hp, None)
    with pytest.raises(ValueError, match="a norm-only table \\(params None\\) takes no ms"):
        MultiTensorTable(t["table"], t["g"], ms=t["m"])
    with pytest.raises(ValueError, match="takes no ms, vs, flags, seeds, offsets or abs_maxes"):
        MultiTensorTable(t["table"], t["g"], abs_maxes=[None, None])
    bad = ce.Tensor.empty(ce.FP32, (3,), "cpu", name="sums")
    with pytest.raises(ValueError, match=r"global_norm_squared_multi: sums: expected shape \(2\)"):
        global_norm_squared_multi(ce.Tensor.empty(ce.FP32, norm_partials_shape(), "cpu"), bad, table)


# ---- the kernels on the host (tests/kernel_emulator.py): multi-tensor bits = per-tensor bits -------------
@pytest.fixture(scope="module")
def adamw_emu(tmp_path_factory):
    emu = pytest.importorskip("kernel_emulator")
    work = tmp_path_factory.mktemp("adamw_emu")
    for header in ("sr_hash.cuh", "norm_squared.cuh"):
        shutil.copy(_build.kernel_dir() / header, work)
    combos = [f"{p}_{g}_{m}_{v}" for p, g, m, v in itertools.product(["f32", "bf16"], repeat=4)]
    names = [f"adamw_{c}{s}" for c in combos for s in ("", "_scalar")] + [f"adamw_multi_{c}" for c in combos]
    names += ["global_norm_squared_multi_f32", "global_norm_squared_multi_bf16", "global_norm_fold_multi"]
    per_tensor_norms = [f"global_norm_squared_{t}{s}" for t in ("f32", "bf16") for s in ("", "_scalar")]
    lib = emu.or_skip(emu.build("adamw", names, work))
    # norm.cu's per-tensor kernels are the reference: the same emulator over norm.cu
    norm_work = tmp_path_factory.mktemp("norm_emu")
    shutil.copy(_build.kernel_dir() / "norm_squared.cuh", norm_work)
    norm_lib = emu.build("norm", per_tensor_norms, norm_work)
    abs_max_names = [f"abs_max_{t}{s}" for t in ("f32", "bf16") for s in ("", "_scalar")]  # fp8.abs_max: the reference
    fp8_lib = emu.build("fp8", abs_max_names, tmp_path_factory.mktemp("fp8_emu"))
    return emu, {"adamw": lib, "norm": norm_lib, "fp8": fp8_lib}


def _emu_setup(adamw_emu, monkeypatch):
    emu, libs = adamw_emu
    calls = []

    def launch(family, name, grid, block, args, device, stream=None, shared_mem=0, **kw):
        calls.append(name)
        args = tuple(np.int32(np.array(a, np.uint32).view(np.int32)) if isinstance(a, np.uint32) else a for a in args)
        emu.launch(libs[family], family, name, grid, block, args, device, stream, shared_mem)

    monkeypatch.setattr(_build, "launch", launch)

    def make(a, dtype, name, unaligned):
        t = emu.tensor(np.concatenate([np.zeros(1), np.asarray(a, np.float64)]) if unaligned else a, dtype, name)
        return t[1:] if unaligned else t

    return emu, make, calls


@pytest.mark.parametrize("dtypes", [("bf16", "bf16", "fp32", "fp32"), ("bf16", "bf16", "bf16", "bf16"),
                                    ("fp32", "fp32", "fp32", "bf16"), ("fp32", "bf16", "bf16", "fp32")])  # fmt: skip
def test_emulated_multi_tensor_adamw_equals_per_tensor_kernel(adamw_emu, monkeypatch, dtypes):
    emu, make, calls = _emu_setup(adamw_emu, monkeypatch)
    per, multi = _run_both(emu.DEV, make, dtypes, lambda ns: emu.tensor(np.zeros(table_shape(ns)), "byte", "table"))
    suffix = "_".join("f32" if d == "fp32" else d for d in dtypes)
    assert calls.count(f"adamw_multi_{suffix}") == 2 and f"adamw_{suffix}_scalar" in calls, set(calls)
    _assert_bitwise(per, multi)
    # and both are the NumPy twin's bits (the host has no FMA contraction to differ by)
    cpu = ce.device("cpu")
    monkeypatch.undo()
    twin, _ = _run_both(cpu, _host_tensor(cpu), dtypes, lambda ns: ce.Tensor.empty(ce.BYTE, table_shape(ns), cpu))
    _assert_bitwise(twin, multi)


def test_emulated_multi_tensor_adamw_skips_on_nan_scale(adamw_emu, monkeypatch):
    emu, make, _ = _emu_setup(adamw_emu, monkeypatch)
    sizes = MULTI[:2]
    before = [(t[0].numpy(), t[2].numpy(), t[3].numpy()) for t in _multi_tensors(make, ("bf16",) * 4, sizes)]
    _, multi = _run_both(emu.DEV, make, ("bf16",) * 4, lambda ns: emu.tensor(np.zeros(table_shape(ns)), "byte", "t"),
                         grad_scale=np.nan, sizes=sizes)  # fmt: skip
    _assert_bitwise(before, multi)


@pytest.mark.parametrize("dtypes", [("bf16", "bf16", "fp32", "fp32"), ("fp32", "fp32", "fp32", "bf16")])
@pytest.mark.parametrize("grad_scale", [0.5, np.nan])
def test_emulated_multi_tensor_adamw_records_abs_max_of_stored_params(adamw_emu, monkeypatch, dtypes, grad_scale):
    """Each record's slot holds, bitwise, what fp8.abs_max (fp8.cu's kernel) reads from the params the
    update stored (the unchanged ones on a skipped step), max-accumulated; params and moments are the
    per-tensor launches' bits; the NumPy twin's slots are the same bits."""
    emu, make, calls = _emu_setup(adamw_emu, monkeypatch)
    table_bytes = lambda ns: emu.tensor(np.zeros(table_shape(ns)), "byte", "table")  # noqa: E731
    per, _ = _run_both(emu.DEV, make, dtypes, table_bytes, grad_scale=grad_scale)
    got, params, slots = _run_with_slots(emu.DEV, make, dtypes, table_bytes, grad_scale=grad_scale)
    _assert_bitwise(per, got)
    for a in slots:
        assert a is None or emu.margins_ok(a)

    def kernel_abs_max(x):
        sep = emu.tensor(np.zeros(1), "fp32", "sep")
        fp8.abs_max(sep, x)
        return sep.numpy()[0]

    calls.clear()
    _assert_slots(params, slots, kernel_abs_max)
    assert {c for c in calls} >= {"abs_max_f32" if dtypes[0] == "fp32" else "abs_max_bf16"}, calls
    cpu = ce.device("cpu")
    monkeypatch.undo()
    twin, _, twin_slots = _run_with_slots(cpu, _host_tensor(cpu), dtypes,
                                          lambda ns: ce.Tensor.empty(ce.BYTE, table_shape(ns), cpu),
                                          grad_scale=grad_scale)  # fmt: skip
    _assert_bitwise(twin, got)
    for a, b in zip(slots, twin_slots):
        assert a is None or a.numpy().view(np.uint32)[0] == b.numpy().view(np.uint32)[0]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_emulated_multi_tensor_norm_equals_per_tensor_kernel(adamw_emu, monkeypatch, dtype):
    """bf16 with a tensor past NORM_SLOTS blocks (its grid is capped at 1024, so it folds into every slot)."""
    emu, make, calls = _emu_setup(adamw_emu, monkeypatch)
    sizes = [*MULTI, (NORM_SLOTS * 2048 + 77 if dtype == "bf16" else 5000, True, 0, True)]
    per, multi, _ = _norm_both(emu.DEV, make, lambda ns: emu.tensor(np.zeros(table_shape(ns)), "byte", "t"), dtype,
                               sizes)  # fmt: skip
    suffix = "f32" if dtype == "fp32" else dtype
    assert calls[-2:] == [f"global_norm_squared_multi_{suffix}", "global_norm_fold_multi"], calls[-3:]
    np.testing.assert_array_equal(per.view(np.uint32), multi.view(np.uint32))
    assert np.count_nonzero(multi) == max(min(NORM_SLOTS, -(-n // 2048)) for n, *_ in sizes)  # the widest grid


# ---- cuda: multi-tensor against per-tensor launches, bitwise ---------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", COMBOS, ids=lambda d: "-".join(d))
def test_cuda_multi_tensor_adamw_equals_per_tensor(cuda, dtypes):
    per, multi = _run_both(cuda, _host_tensor(cuda), dtypes, lambda ns: ce.Tensor.empty(ce.BYTE, table_shape(ns), cuda),
                           steps=3)  # fmt: skip
    _assert_bitwise(per, multi)


@pytest.mark.gpu
@pytest.mark.parametrize("grad_scale", [0.5, np.nan])
def test_cuda_multi_tensor_adamw_records_abs_max_of_stored_params(cuda, grad_scale):
    dtypes = ("bf16", "bf16", "fp32", "fp32")
    table_bytes = lambda ns: ce.Tensor.empty(ce.BYTE, table_shape(ns), cuda)  # noqa: E731
    per, _ = _run_both(cuda, _host_tensor(cuda), dtypes, table_bytes, steps=3, grad_scale=grad_scale)
    got, params, slots = _run_with_slots(cuda, _host_tensor(cuda), dtypes, table_bytes, steps=3, grad_scale=grad_scale)
    _assert_bitwise(per, got)

    def kernel_abs_max(x):
        sep = ce.Tensor.from_numpy(np.zeros(1, np.float32), cuda)
        fp8.abs_max(sep, x)
        return sep.numpy()[0]

    _assert_slots(params, slots, kernel_abs_max)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cuda_multi_tensor_norm_equals_per_tensor(cuda, dtype):
    sizes = [*MULTI, (NORM_SLOTS * 2048 * 3 + 77, True, 0, False), (NORM_SLOTS * 2048 + 5, True, 0, True)]
    per, multi, _ = _norm_both(cuda, _host_tensor(cuda), lambda ns: ce.Tensor.empty(ce.BYTE, table_shape(ns), cuda),
                               dtype, sizes)  # fmt: skip
    np.testing.assert_array_equal(per.view(np.uint32), multi.view(np.uint32))


@pytest.mark.gpu
def test_cuda_multi_tensor_update_in_a_captured_graph(cuda):
    """One captured multi-tensor update replayed with new hparams equals the per-tensor launches."""
    dtypes = ("bf16", "bf16", "fp32", "fp32")
    per, _ = _run_both(cuda, _host_tensor(cuda), dtypes, lambda ns: ce.Tensor.empty(ce.BYTE, table_shape(ns), cuda),
                       steps=3, grad_scale=0.5)  # fmt: skip
    make = _host_tensor(cuda)
    p, g, m, v = (list(x) for x in zip(*_multi_tensors(make, dtypes)))
    seeds = [(1234 + 7919 * k) & 0x7FFFFFFF for k in range(len(MULTI))]
    table = MultiTensorTable(ce.Tensor.empty(ce.BYTE, table_shape([t.nelem for t in p]), cuda), g, p, m, v,
                             [s[1] for s in MULTI], seeds, [s[2] for s in MULTI])  # fmt: skip
    hp = make(np.zeros(8), "fp32", "hp", False)
    gs = make(np.array([0.5]), "fp32", "gs", False)
    graph = cuda.capture(lambda: adamw_update_multi(table, hp, gs))
    for step in range(1, 4):
        hp.copy_from_numpy(make_hparams(LR, B1, B2, EPS, WD, step))
        graph.launch()
    _assert_bitwise(per, [(a.numpy(), b.numpy(), c.numpy()) for a, b, c in zip(p, m, v)])


# ---- the model's optimizer goes through the tables, with the per-tensor bits ------------------------------
def _train(device, per_tensor: bool, monkeypatch, steps=3, **opts):
    from cuengine.model import LlamaModel, TrainOptions, TransformerConfig
    from cuengine.model.optimizer import AdamWState

    if per_tensor:
        monkeypatch.setattr(AdamWState, "_table", lambda self, *a, **kw: None)
    m = LlamaModel(TransformerConfig.preset("tiny"), TrainOptions(**opts), device=device)
    m.init_weights(3)
    m.allocate_run_state(2, 16)
    g = np.random.default_rng(5)
    losses = []
    for _ in range(steps):
        x, y = (g.integers(0, 256, (2, 16)).astype(np.int32) for _ in range(2))
        losses.append(m.train_step(x, y, lr=1e-3))
    monkeypatch.undo()
    out = {n: t.numpy() for n, t in m.weights.tensors.items()}
    out.update({k: t.numpy() for k, t in m.opt_state.state_tensors().items()})
    return losses, m.opt_state.norm_result.numpy(), out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("opts", [{}, {"use_cuda_graphs": True, "opt_m_dtype": "bf16", "opt_v_dtype": "bf16"}])
def test_model_optimizer_multi_tensor_is_bitwise_the_per_tensor_loop(device, opts, monkeypatch):
    from cuengine.model import optimizer

    calls = []
    for name in ("adamw_update_multi", "global_norm_squared_multi"):
        real = getattr(optimizer.adamw, name)
        monkeypatch.setattr(optimizer.adamw, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    multi = _train(device, False, monkeypatch, **opts)
    if not opts.get("use_cuda_graphs") or device == "cpu":  # replayed graphs call no Python
        assert calls.count("adamw_update_multi") == 3 and calls.count("global_norm_squared_multi") == 3, calls
    per = _train(device, True, monkeypatch, **opts)
    assert multi[0] == per[0]
    np.testing.assert_array_equal(multi[1], per[1])
    for k in per[2]:
        np.testing.assert_array_equal(multi[2][k].view(np.uint8), per[2][k].view(np.uint8), err_msg=k)
