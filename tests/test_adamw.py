"""AdamW: float64 reference over several steps, stochastic rounding, seeds, devices."""

import itertools

import numpy as np
import pytest
from conftest import assert_close, rng

import cuengine as ce
from cuengine.kernels.adamw import adamw_reference, adamw_update, make_hparams, sr_bits, stochastic_round_bf16

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
